"""``peftlab`` command line: a table of subcommands, each module imported only when its subcommand runs, so
``peftlab --help`` imports neither torch nor transformers. A subcommand module's ``add_parser(sub)`` (or the row's
``register``) sets ``func``, which returns an exit status; a :class:`PeftlabError` becomes one line, exit 2."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from dataclasses import dataclass

from peftlab import __version__
from peftlab.errors import USER_ERROR_EXIT, PeftlabError, closest


@dataclass(frozen=True)
class Subcommand:
    name: str
    module: str  # imported only when this subcommand runs
    help: str  # the line `peftlab --help` shows
    register: str = "add_parser"  # the module's function that adds the full parser to the subparsers


SUBCOMMANDS = (
    Subcommand("models", "peftlab.cli.listing", "list registered models and whether each is installed",
               "add_models_parser"),
    Subcommand("methods", "peftlab.cli.listing", "list fine-tuning methods, their default learning rates and limits",
               "add_methods_parser"),
    Subcommand("train", "peftlab.training.loop", "fine-tune one model on one task with one method"),
    Subcommand("probe", "peftlab.training.probe_cli",
               "per-group loss curvature of a run before training: lambda_max, stable and suggested rates, lambda"),
    Subcommand("evaluate", "peftlab.training.evaluate_cli", "evaluate a saved run's adapter on its task's dev set"),
    Subcommand("predict", "peftlab.training.predict",
               "predict labels (or STS-B scores) for a file of texts with a trained run"),
    Subcommand("export", "peftlab.training.export",
               "write a trained run as a merged, standard transformers model folder"),
    Subcommand("sweep", "peftlab.lab.sweep", "run a grid of fine-tuning runs into a results store"),
    Subcommand("tune", "peftlab.lab.tune.run",
               "choose lambda (and other keys) within a budget: pruned search, then seed re-runs"),
    Subcommand("study", "peftlab.lab.study_cli",
               "check the lambda or KaSA claim on your model and data as a reviewer would, in one command"),
    Subcommand("store", "peftlab.lab.store_check",
               "check a results store (integrity, every status against its result, stale runs); --repair"),
    Subcommand("report", "peftlab.lab.report",
               "table of results stores or run folders: paired tests, CIs, equivalence and power vs a baseline"),
    Subcommand("plot", "peftlab.lab.plot",
               "figures from a results store: eta_QK x eta_V grid, heatmap, learning curves, KaSA sigma, rank"),
    Subcommand("bench", "peftlab.cli.bench_moved", "moved: python benchmarks/<benchmark>.py in a source checkout"),
    Subcommand("serve-judge", "peftlab.tasks.judge_server",
               "serve a local model as an OpenAI-compatible MT-Bench judge (a weak judge, offline)"),
    Subcommand("nlg-score", "peftlab.tasks.nlg_score",
               "score outputs against references as the official E2E NLG script does (BLEU ... CIDEr)"),
)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose errors (a bad int, an unknown choice, a missing argument) are one line, as every
    other user error is, instead of the usage block and a line without a fix. Subcommand parsers inherit it."""

    def error(self, message: str):
        # a value refused by its declaration's check (a `type=`) already says how to fix it: keep that fix
        what, _, fix = message.partition("; fix: ")
        print(f"peftlab: error: {PeftlabError(what, where=self.prog, fix=fix or f'see `{self.prog} --help`')}",
              file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT)


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand named on the command line: its first word that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``peftlab`` parser; only the subcommand that ``argv`` names gets its full parser (module imported)."""
    command = chosen_command(sys.argv[1:] if argv is None else argv)
    parser = OneLineParser(
        prog="peftlab",
        description="Attention-targeted parameter-efficient fine-tuning lab (Yao et al. lambda, KaSA, baselines).",
    )
    parser.add_argument("--version", action="version", version=f"peftlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for entry in SUBCOMMANDS:
        if entry.name == command:
            getattr(importlib.import_module(entry.module), entry.register)(sub)
        else:
            sub.add_parser(entry.name, help=entry.help)
    return parser


def _unknown_flags(parser: argparse.ArgumentParser, args, extra: list[str]) -> PeftlabError:
    """One line for flags no parser knows, with the closest flag of the subcommand (argparse gives none)."""
    command = getattr(args, "command", None)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    known = list(sub.choices[command]._option_string_actions) if sub is not None and command in sub.choices else []
    flags = [a for a in extra if a.startswith("-")] or extra
    flag = flags[0].split("=", 1)[0]
    hint = closest(flag, known)
    where = f"peftlab {command}" if command else "peftlab"
    return PeftlabError(f"unknown flag '{flag}'{hint}" if flag.startswith("-") else f"unexpected argument '{flag}'",
                        where=where, fix=f"see `{where} --help`")


def _quiet_libraries() -> None:
    """datasets' per-map progress bars drown our own progress and errors. The variable keeps them off in a
    datasets imported later (and in worker processes) without importing it here (a second of start-up)."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation chatter, not user news
    _quiet_libraries()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        print(f"peftlab: error: {_unknown_flags(parser, args, extra)}", file=sys.stderr)
        return USER_ERROR_EXIT
    if not getattr(args, "func", None):
        parser.print_help()
        return USER_ERROR_EXIT
    try:
        return int(args.func(args) or 0)
    except PeftlabError as err:
        for line in err.lines():  # one line per problem (a preflight may find several)
            print(f"peftlab: error: {line}", file=sys.stderr)
        return USER_ERROR_EXIT
    except OSError as err:  # a path the OS refused (below a file, a name too long, read-only): one line, no stack
        from peftlab.errors import os_error  # what the OS said, which path; PEFTLAB_DEBUG=1: the traceback

        if os.environ.get("PEFTLAB_DEBUG", "") not in ("", "0"):
            raise
        print(f"peftlab: error: {os_error(err, getattr(args, 'command', None))}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print("peftlab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
