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

from peftlab.errors import USER_ERROR_EXIT, PeftlabError

# Imported lazily by name so that `peftlab models` does not pay for torch/transformers start-up twice.
SUBCOMMAND_MODULES = (
    "peftlab.cli_models",
    "peftlab.train",
    "peftlab.evaluate",
    "peftlab.sweep",
    "peftlab.report",
    "peftlab.plot",
    "peftlab.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peftlab",
        description="Attention-targeted parameter-efficient fine-tuning lab (Yao et al. lambda, KaSA, baselines).",
    )
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
    args = parser.parse_args(argv)
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
