"""argparse ``type=`` checks for the plain options of subcommands (those not declared in ``TrainConfig``).

A value outside what the libraries below accept is refused while the arguments are parsed, so it becomes
argparse's one line (``peftlab.cli.main.OneLineParser``) before any model is loaded, instead of a traceback
from deep below or an option silently read as something else. The bounds are those of
:mod:`peftlab.config_roles` (integers fit in int64; numbers are finite); a folder option is checked for
its kind as ``check_paths`` checks a config's, and nothing is created while parsing.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from peftlab.config_roles import INT64_MAX
from peftlab.io_utils import path_problem

SEED_LIMIT = 2**32  # numpy's seeds are < 2**32


def bounded_int(text: str, low: int, high: int, meaning: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {meaning}, got '{text}'") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected {meaning}, got {value}")
    return value


def positive_int(text: str) -> int:
    return bounded_int(text, 1, INT64_MAX, f"a positive integer <= {INT64_MAX}")


def nonnegative_int(text: str) -> int:
    return bounded_int(text, 0, INT64_MAX, f"an integer >= 0 and <= {INT64_MAX}")


def seed(text: str) -> int:
    return bounded_int(text, 0, SEED_LIMIT - 1, f"a seed >= 0 and < {SEED_LIMIT} (numpy's seed range)")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """A number >= 0 (a share of a device: 0 is none of it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


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


def output_folder(value: str) -> str:
    """A folder to write into: not blank, not a file, not below a file, no name too long, its nearest existing
    folder writable (it may not exist yet; nothing is created here)."""
    return _output(value, "folder", "a folder to write into")


def output_file(value: str) -> str:
    """A file to write: not blank, not a folder, not below a file, no name too long, its nearest existing folder
    writable (it and its folders may not exist yet; nothing is created here)."""
    return _output(value, "file", "a file to write")


def _output(value: str, kind: str, what: str) -> str:
    text(value)
    problem = path_problem(value, kind=kind)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"expected {what}, got '{value}': {problem}")
    return value
