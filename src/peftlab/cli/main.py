"""``peftlab`` command line: one subcommand per module, each registering its own parser.

A subcommand module exposes ``add_parser(subparsers)`` which sets ``func`` on its parser; ``func(args)``
returns an exit status. User errors (:class:`PeftlabError`) become one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from peftlab.errors import USER_ERROR_EXIT, PeftlabError, closest

# Imported lazily by name so that `peftlab models` does not pay for torch/transformers start-up twice.
SUBCOMMAND_MODULES = (
    "peftlab.cli.listing",
    "peftlab.training.loop",
    "peftlab.training.evaluation",
    "peftlab.training.predict",
    "peftlab.training.export",
    "peftlab.lab.sweep",
    "peftlab.lab.report",
    "peftlab.lab.plot",
    "peftlab.bench.suite",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peftlab",
        description="Attention-targeted parameter-efficient fine-tuning lab (Yao et al. lambda, KaSA, baselines).",
    )
    parser.add_argument("--version", action="version", version=f"peftlab {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:  # a subcommand not written yet
                continue
            raise
        module.add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("peftlab")
    except PackageNotFoundError:  # run from a source tree without installing
        return "unknown (not installed)"


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
    """datasets' per-map progress bars and transformers' load reports drown our own progress and errors."""
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)  # library deprecation chatter, not user news
    _quiet_libraries()
    parser = build_parser()
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
        print(f"peftlab: error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print("peftlab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
