"""Re-render the Markdown beside a benchmark's JSON; no benchmark is run.

    python benchmarks/rerender.py docs/bench/e2e-minilm-l6.json

The JSON's ``kind`` names the benchmark whose ``rerender(result)`` writes its table (an e2e or against-trainer
summary is recomputed from the recorded runs); the Markdown is written beside the JSON and printed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repository root, not its own folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from peftlab.errors import USER_ERROR_EXIT, PeftlabError

KINDS = {"micro": "benchmarks.micro", "e2e": "benchmarks.e2e", "against_trainer": "benchmarks.against_trainer",
         "against_trainer_decoder": "benchmarks.against_trainer_decoder",
         "sweep_overhead": "benchmarks.sweep_overhead", "decode": "benchmarks.decode"}


def rerender(path: str | Path) -> str:
    """Rewrite ``<path>.md`` from the bench JSON at ``path``; returns the Markdown."""
    from peftlab.io_utils import atomic_write_text

    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PeftlabError(f"cannot read bench results {path}: {err}",
                           fix="pass a .json written by a benchmark in benchmarks/") from None
    module = KINDS.get(result.get("kind") if isinstance(result, dict) else None)
    if module is None:
        raise PeftlabError(f"{path} is not a benchmark result (kind: one of {', '.join(KINDS)})",
                           fix="pass a .json written by a benchmark in benchmarks/")
    text = importlib.import_module(module).rerender(result)
    atomic_write_text(path.with_suffix(".md"), text)
    return text


def main(argv: list[str] | None = None) -> int:
    made = argparse.ArgumentParser(prog="benchmarks/rerender.py", description=__doc__.split("\n\n")[0])
    made.add_argument("json", help="a result .json written by a benchmark")
    args = made.parse_args(argv)
    try:
        print(rerender(args.json))
    except PeftlabError as err:
        print(f"{made.prog}: error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
