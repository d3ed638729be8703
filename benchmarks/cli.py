"""What every benchmark's command line shares: the output flags, argparse types, the thread setting, and
one-line errors (``PeftlabError``: what, where, fix; exit 2), as ``peftlab`` itself reports them.

Each benchmark script builds its parser with :func:`parser` (``--out-dir``, ``--name``, ``--quiet``, optionally
``--threads``), adds only its own flags with fixed defaults, and hands its ``run(args) -> result`` to :func:`main`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable

from peftlab.errors import USER_ERROR_EXIT, PeftlabError


def _number(kind: type, low: float, strict: bool, what: str) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'") from None
        if not (value > low if strict else value >= low) or not math.isfinite(value) or abs(value) >= 2**31:
            raise argparse.ArgumentTypeError(f"expected {what}, got '{text}'")
        return value

    return parse


positive_int = _number(int, 0, True, "a positive integer")
nonnegative_int = _number(int, 0, False, "an integer >= 0")
positive_float = _number(float, 0.0, True, "a positive finite number")
threads = _number(int, 0, True, "a positive integer (torch CPU threads)")


def seeds(value: str) -> list[int]:
    """A comma list of seeds (``0,1,2``)."""
    pieces = [piece.strip() for piece in value.split(",") if piece.strip()]
    try:
        parsed = [int(piece) for piece in pieces]
    except ValueError:
        parsed = []
    if not parsed or any(not 0 <= s < 2**32 for s in parsed):
        raise argparse.ArgumentTypeError(f"expected a comma list of seeds in [0, 2**32), got '{value}'")
    return parsed


def names(value: str) -> list[str]:
    """A comma list of names (tasks, methods), lower case, each once."""
    parsed = list(dict.fromkeys(piece.strip().lower() for piece in value.split(",") if piece.strip()))
    if not parsed:
        raise argparse.ArgumentTypeError(f"expected a comma list of names, got '{value}'")
    return parsed


def check_glue_tasks(tasks: list[str]) -> None:
    """``--tasks`` of a GLUE-style benchmark: classification or regression tasks only."""
    from peftlab.errors import unknown
    from peftlab.tasks.table import TASKS

    glue = [name for name, task in TASKS.items() if task.kind in ("classification", "regression")]
    for task in tasks:
        if task not in glue:
            raise unknown("GLUE task", task, glue, where="--tasks")


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``(default: ...)`` in ``--help``, but once: train's flags (``add_dataclass_flags``) say theirs."""

    def _get_help_string(self, action):
        return action.help if "(default: " in (action.help or "") else super()._get_help_string(action)


def parser(doc: str, script: str, *, with_threads: bool = True) -> argparse.ArgumentParser:
    """The parser of the benchmark in file ``script``: its docstring's first paragraph as description, and the
    flags every benchmark has."""
    made = argparse.ArgumentParser(prog=f"benchmarks/{Path(script).name}", description=doc.split("\n\n")[0],
                                   formatter_class=_DefaultsHelp)
    made.add_argument("--out-dir", default="bench_out", help="where the JSON and Markdown go")
    made.add_argument("--name", default=None, help="file name stem (default: derived from the settings)")
    made.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    if with_threads:
        made.add_argument("--threads", type=threads, default=None, dest="torch_threads",
                          help="torch CPU threads (default: torch's); 1 is far steadier on a shared machine")
    return made


def progress(quiet: bool) -> Callable[[str], None]:
    """The progress printer of a run: ``[bench] ...`` lines on stderr, or nothing with ``--quiet``."""
    if quiet:
        return lambda message: None
    return lambda message: print(f"[bench] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, benchmark: Callable[[argparse.Namespace], dict]) -> dict:
    """``benchmark(args)`` under ``--threads`` (torch's own count restored after, for callers in the same
    process); prints the Markdown it wrote and where both files are."""
    import warnings

    import torch

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft -> transformers, every build
    before = torch.get_num_threads()
    if getattr(args, "torch_threads", None):
        torch.set_num_threads(args.torch_threads)
    try:
        result = benchmark(args)
    finally:
        torch.set_num_threads(before)
    print(Path(result["files"]["markdown"]).read_text())
    print(f"wrote {result['files']['json']} and {result['files']['markdown']}")
    return result


def main(made: argparse.ArgumentParser, benchmark: Callable[[argparse.Namespace], dict],
         argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the benchmark; a :class:`PeftlabError` is its one line on stderr and exit 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = made.parse_args(argv)
    try:
        run(args, benchmark)
    except PeftlabError as err:
        print(f"{made.prog}: error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT
    return 0
