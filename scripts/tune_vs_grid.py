"""docs/RESULTS.md "Choosing lambda within a budget": `peftlab tune`'s pick against the full grid's best.

Reads only data: the grid's runs in a results store (configs/sweeps/lambda_grid_minilm.yaml) and each tune's
tune.json (configs/tune/lambda_<task>_minilm.yaml). Prints one Markdown table.

    python scripts/tune_vs_grid.py runs/study_minilm/results.sqlite runs/lambda_{sst2,stsb,qqp}_minilm
"""

from __future__ import annotations

import json
import sqlite3
import statistics
import sys
from collections import defaultdict
from pathlib import Path

LAMBDAS, LRS = (1.0, 2.0, 4.0, 8.0, 16.0), (1e-3, 2e-3)
NOT_OK = ("diverged", "collapsed", "failed")


def grid_cells(store: Path, task: str, samples: int) -> dict[tuple[float, float], list[float]]:
    """(lr, lambda) -> the 5 seeds' best-epoch metric (a diverged/collapsed seed counts at its metric, or chance)."""
    cells: dict[tuple[float, float], list[float]] = defaultdict(list)
    with sqlite3.connect(store) as db:
        for config, result, status in db.execute("SELECT config, result, status FROM runs"):
            c = json.loads(config)
            if (c["task"], c["method"], c["targets"], c["epochs"], c["max_train_samples"]) != \
                    (task, "lora", "q,v", 2, samples) or c["lr"] not in LRS or float(c["lr_ratio"]) not in LAMBDAS:
                continue
            if status not in ("ok", "diverged", "collapsed"):  # pending, running or failed: not a finished seed
                continue
            r = json.loads(result) if result else {}
            best = (r.get("best") or {}).get("metrics", {}).get(r.get("primary_metric", ""))
            if best is None:
                best = (r.get("final") or {}).get("metrics", {}).get(r.get("primary_metric", ""), float("nan"))
            cells[(c["lr"], float(c["lr_ratio"]))].append(float(best))
    return cells


def main(store: str, *tune_dirs: str) -> None:
    print("| task | grid best (lambda, eta_QK): mean ± std over 5 seeds | tune's pick | its 5-seed mean ± std "
          "| gap (points) | within grid-best std | epochs: tune / grid (fraction) | trials (pruned) |")
    print("|---|---|---|---|---|---|---|---|")
    for tune_dir in tune_dirs:
        tune = json.loads((Path(tune_dir) / "tune.json").read_text())
        with sqlite3.connect(Path(tune_dir) / "results.sqlite") as db:
            config = json.loads(db.execute("SELECT config FROM runs LIMIT 1").fetchone()[0])
        task, samples = config["task"], config["max_train_samples"]
        cells = grid_cells(Path(store), task, samples)
        complete = {k: v for k, v in cells.items() if len(v) == 5}
        best_key = max(complete, key=lambda k: statistics.mean(complete[k]))
        best = complete[best_key]
        w = tune["winner"]
        gap = 100 * (statistics.mean(best) - w["mean"])
        within = gap <= 100 * statistics.stdev(best) or gap <= 0.5
        pruned = sum(1 for t in tune["trials"] if t["outcome"] == "pruned")
        print(f"| {task} ({samples} train) | {100 * statistics.mean(best):.1f} ± {100 * statistics.stdev(best):.1f} "
              f"(λ={best_key[1]:g}, {best_key[0]:g}) | λ={w['params']['lr_ratio']:g}, {w['params'].get('lr', ''):g} "
              f"| {100 * w['mean']:.1f} ± {100 * w['std']:.1f} | {gap:+.1f} | {'yes' if within else 'no'} "
              f"| {tune['spent_epochs']} / {tune['grid_epochs']} ({tune['fraction_of_grid']:.0%}) "
              f"| {len(tune['trials'])} ({pruned}) |")
        missing = [k for k, v in cells.items() if len(v) != 5]
        if missing or len(cells) != len(LAMBDAS) * len(LRS):
            print(f"<!-- {task}: grid incomplete: {len(complete)} of {len(LAMBDAS) * len(LRS)} points have 5 seeds -->")


if __name__ == "__main__":
    main(*sys.argv[1:])
