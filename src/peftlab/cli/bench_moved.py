"""``peftlab bench``: the benchmarks left the installed package for the repository's ``benchmarks/`` folder (one
command per benchmark, on peftlab's public API: docs/BENCHMARKS.md). What stays is this entry, so that an old
command line gets one line saying where each benchmark went, and exit status 2."""

from __future__ import annotations

from peftlab.errors import PeftlabError

# the old mode flag -> the benchmark that replaced it
MOVED = {"--e2e": "e2e.py", "--against": "against_trainer.py (GLUE) or against_trainer_decoder.py (decoders)",
         "--sweep-overhead": "sweep_overhead.py", "--decode": "decode.py", "--render": "rerender.py"}


def add_parser(sub) -> None:
    # no options of its own (prefix_chars that no flag uses): every word, --help included, reaches run()
    parser = sub.add_parser("bench", help="moved: python benchmarks/<benchmark>.py in a source checkout",
                            description=__doc__.split("\n\n")[0], prefix_chars="\x00", add_help=False)
    parser.add_argument("words", nargs="*")
    parser.set_defaults(func=run)


def run(args) -> int:
    flag = next((word.split("=", 1)[0] for word in args.words if word.split("=", 1)[0] in MOVED), None)
    benchmark = MOVED[flag] if flag else "micro.py"  # the old default benchmark
    raise PeftlabError("the benchmarks moved out of the installed package into the repository's benchmarks/ folder",
                       where="peftlab bench", fix=f"from a source checkout run python benchmarks/{benchmark} --help; "
                                                 "every benchmark: docs/BENCHMARKS.md")
