"""argparse ``type=`` checks for the plain options of subcommands (not ``TrainConfig``'s: those come from their
declarations), worded as :mod:`peftlab.config_roles` words its ranges; nothing is created while parsing.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Callable

from peftlab.config_roles import INT64_MAX, SEED, Range
from peftlab.io_utils import path_problem


def bounded_int(text: str, low: int, high: int, meaning: str) -> int:
    return _number("bounded_int", int, Range(low, high), meaning)(text)


def _number(name: str, kind: type, check: Range, meaning: str | None = None) -> Callable[[str], int | float]:
    """An argparse ``type=`` reading a ``kind`` number that ``check`` admits (a float: also finite), worded as the
    config's declarations word their ranges (:class:`~peftlab.config_roles.Range`) unless ``meaning`` is given."""
    meaning = meaning or check.describe(kind is int)

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {meaning}, got '{text}'") from None
        if not check.admits(value) or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected {meaning}, got {text}")
        return value

    parse.__name__ = name  # argparse's fallback message, and what the CLI fuzz test sorts the options by
    return parse


positive_int = _number("positive_int", int, Range(1, INT64_MAX))
nonnegative_int = _number("nonnegative_int", int, Range(0, INT64_MAX))
seed = _number("seed", int, SEED)
positive_float = _number("positive_float", float, Range(0, low_open=True))
nonnegative_float = _number("nonnegative_float", float, Range(0))  # a share of a device: 0 is none of it


def text(value: str) -> str:
    """Text that is not blank (a name, a device, a list)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"expected non-empty text, got '{value}'")
    return value


def assignments(value: str) -> str:
    """A ``K=V,...`` list that sets something: a blank one or ``,`` would silently set nothing. The keys and
    values themselves are checked where the list is read (:func:`peftlab.lab.records.parse_filter`)."""
    if not any("=" in piece for piece in value.split(",")):
        raise argparse.ArgumentTypeError(f"expected key=value pairs (K=V,...), got '{value}'")
    return value


def folder(value: str) -> str:
    """A folder that is there (data to read)."""
    problem = path_problem(value, kind="folder", write=False)
    if problem is None and not Path(value).expanduser().is_dir():
        problem = "it is not there"
    if problem is not None:
        raise argparse.ArgumentTypeError(f"expected an existing folder, got '{value}': {problem}")
    return value


def _output(kind: str, what: str) -> Callable[[str], str]:
    """A path to write (it may not exist yet): :func:`peftlab.io_utils.path_problem`'s checks."""
    def parse(value: str) -> str:
        text(value)
        problem = path_problem(value, kind=kind)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"expected {what}, got '{value}': {problem}")
        return value

    parse.__name__ = f"output_{kind}"
    return parse


output_folder = _output("folder", "a folder to write into")
output_file = _output("file", "a file to write")
