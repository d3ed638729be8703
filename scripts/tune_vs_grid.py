"""docs/RESULTS.md "Choosing lambda within a budget": the full grid's best, the naive search's pick and
`peftlab tune`'s pick, each scored on the seeds that chose it and on held-out seeds that did not.

Reads only data (tune_compare.py beside it does the work): the grid's runs (configs/sweeps/lambda_grid_minilm.yaml)
in a results store, each tune's spec and its output (tune.json + results.sqlite, which holds its winner's
held-out runs), and any further stores (e.g. a sweep of the other picks' held-out seeds). Prints one Markdown table.

    python scripts/tune_vs_grid.py docs/study/lambda_grid.sqlite configs/tune/lambda_{sst2,stsb,qqp}_minilm.yaml
    python scripts/tune_vs_grid.py GRID.sqlite configs/tune/lambda_sst2_minilm.yaml=runs/tune-sst2 --store more.sqlite

SPEC=WHERE names the tune's output: its folder (tune.json, results.sqlite) or its tune.json (pass its store
with --store); without =WHERE, the spec's own output_dir. --naive-top-k K re-seeds K points in the naive search
(default: the spec's top_k); --naive-equal-budget sizes K to the tune's budget instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from peftlab.errors import PeftlabError
from peftlab.lab.store import STORE_NAME
from peftlab.lab.tune.spec import SUMMARY_FILE, load_tune_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tune_compare.py, beside this script
from tune_compare import compare_files, render_comparison  # noqa: E402


def comparison_for(item: str, grid_store: str, stores: list[str], naive_top_k: int | None, equal_budget: bool):
    spec, _, where = item.partition("=")
    tune = load_tune_spec(spec)
    if where and not Path(where).is_dir():  # a tune.json; its store comes with --store
        folder, summary = None, Path(where)
    else:
        folder = Path(where) if where else tune.output_root
        summary = folder / SUMMARY_FILE if (folder / SUMMARY_FILE).is_file() or where else None
    tune_store = [str(folder / STORE_NAME)] if folder is not None and (folder / STORE_NAME).is_file() else []
    return compare_files(spec, [grid_store, *tune_store, *stores], summary=summary, naive_top_k=naive_top_k,
                         naive_budget=tune.budget_epochs if equal_budget else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("grid_store", help="results store holding the full grid x selection seeds")
    parser.add_argument("specs", nargs="+", metavar="SPEC[=WHERE]", help="tune spec, optionally =its output")
    parser.add_argument("--store", action="append", default=[], help="another store to read runs from")
    parser.add_argument("--naive-top-k", type=int, default=None, metavar="K")
    parser.add_argument("--naive-equal-budget", action="store_true")
    args = parser.parse_intermixed_args(argv)
    try:
        comparisons = [comparison_for(item, args.grid_store, args.store, args.naive_top_k, args.naive_equal_budget)
                       for item in args.specs]
    except PeftlabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(render_comparison(comparisons), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
