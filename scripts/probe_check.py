"""probe_check: does ``peftlab probe`` predict the committed lambda grids? The numbers of docs/RESULTS.md's
"Choosing lambda without a grid: the curvature probe", from the grid's store and the probe's probe.json files.

    python scripts/probe_check.py docs/study/lambda/results.sqlite stsb.json sst2.json [--kind preconditioned]

The grid: LoRA {q,v} on MiniLM-L6, eta_QK x lambda, 2 epochs of 500 examples, selection seeds 0 and 1 on every
cell, held-out seeds 100-109 on the study's three picks per task. Per task and kind of curvature it reports:

* the grid's best cell (no failed seed, highest mean over the selection seeds: the study's own pick) and its
  **best region** in lambda: every lambda whose best cell (no failed seed) is within the best cell's seed standard
  deviation of it; the probe's lambda (lambda_max(q) / lambda_max(v), no constant involved) is *inside* when it
  lies in the region's span widened by half a grid step (x/÷ sqrt 2);
* the rule rate = c / lambda_max: c fitted by least squares in log rate on the best cells (eta_QK for q, eta_V for
  v) of both tasks (the constant the probe prints), and, honestly out of sample, of the *other* task only;
* the probe-chosen config (eta_QK = c_other / lambda_max(q), lambda as above) at the nearest grid cell (log2
  distance; outside the grid it is the edge cell), its selection mean against the grid-chosen one and, where
  the study ran that cell on the held-out seeds, the paired held-out difference (95 % CI, TOST at +-1 point);
* compute: the probe's wall seconds against the grid's run hours.

A reader of run records and probe.json files only (it imports neither models nor training); research code beside
the package, on its public readers.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from peftlab.errors import PeftlabError
from peftlab.lab.records import collect, load_rows

GRID_WHERE = {"method": "lora", "targets": "q,v", "epochs": 2, "max_train_samples": 500, "model": "minilm-l6"}
SELECTION_SEEDS = (0, 1)
HELDOUT_SEEDS = tuple(range(100, 110))
MARGIN = 1.0  # points: the lambda study's equivalence margin
SCALE = 100.0  # metrics in points


@dataclass
class Cell:
    lr: float
    ratio: float
    selection: list = field(default_factory=list)  # points, failed runs included at their value
    failed: int = 0
    heldout: dict = field(default_factory=dict)  # seed -> points
    seconds: float = 0.0

    @property
    def mean(self) -> float:
        return float(np.mean(self.selection)) if self.selection else float("nan")

    @property
    def sd(self) -> float:
        return float(np.std(self.selection, ddof=1)) if len(self.selection) > 1 else 0.0


def grid_cells(rows: list[dict], task: str) -> dict[tuple[float, float], Cell]:
    """The task's (eta_QK, lambda) cells with their selection and held-out seeds."""
    records, _ = collect(rows, where={**GRID_WHERE, "task": task})
    cells: dict[tuple[float, float], Cell] = {}
    for rec in records:
        if rec.value is None:
            continue
        key = (float(rec.config["lr"]), float(rec.config["lr_ratio"]))
        cell = cells.setdefault(key, Cell(*key))
        if rec.seed in SELECTION_SEEDS:
            cell.selection.append(SCALE * rec.value)
            cell.failed += rec.status != "ok"
            cell.seconds += float((rec.result or {}).get("timings", {}).get("total_s") or 0.0)
        elif rec.seed in HELDOUT_SEEDS:
            cell.heldout[rec.seed] = SCALE * rec.value
    return {k: c for k, c in cells.items() if len(c.selection) == len(SELECTION_SEEDS)}


def grid_seconds(rows: list[dict], task: str) -> float:
    """Run time of every grid run of the task (selection, held-out and plateau arms): what the grid cost."""
    return sum(float(r.get("seconds") or 0.0) for r in rows
               if r["config"].get("task") == task and r["config"].get("method") == "lora")


def best_cell(cells: dict) -> Cell:
    trained = [c for c in cells.values() if not c.failed]
    return max(trained, key=lambda c: c.mean)


def best_region(cells: dict) -> tuple[list[float], dict[float, Cell], float]:
    """(lambdas of the region, each lambda's best trained cell, the threshold)."""
    best = best_cell(cells)
    profile: dict[float, Cell] = {}
    for cell in cells.values():
        if not cell.failed and (cell.ratio not in profile or cell.mean > profile[cell.ratio].mean):
            profile[cell.ratio] = cell
    threshold = best.mean - best.sd
    return sorted(r for r, c in profile.items() if c.mean >= threshold), profile, threshold


def placement(value: float, region: list[float], grid: list[float]) -> str:
    """Whether the probe's lambda is in the region, in the grid but not the region, or where the grid never went
    (each at half a grid step: x/÷ sqrt 2)."""
    step = math.sqrt(2)
    if min(region) / step <= value <= max(region) * step:
        return "yes"
    if min(grid) / step <= value <= max(grid) * step:
        return "no"
    return f"no: below the grid (lambda < {min(grid):g} untested)" if value < min(grid) else "no: above the grid"


def fit_constant(pairs: list[tuple[float, float]]) -> float:
    """c of rate = c / lambda_max, least squares in log rate over (best rate, lambda_max) pairs."""
    return float(np.exp(np.mean([math.log(rate) + math.log(lam) for rate, lam in pairs])))


def block_lambda(probe: dict, kind: str, block: str) -> float:
    return float(probe["kinds"][kind][block]["lambda_max"]["mean"])


def calibration_pairs(probe: dict, kind: str, best: Cell) -> list[tuple[float, float]]:
    return [(best.lr, block_lambda(probe, kind, "q")), (best.lr * best.ratio, block_lambda(probe, kind, "v"))]


def nearest_cell(cells: dict, lr: float, ratio: float) -> Cell:
    return min(cells.values(), key=lambda c: abs(math.log2(c.lr / lr)) + abs(math.log2(c.ratio / ratio)))


def paired(a: dict, b: dict) -> str:
    """a - b over their common held-out seeds: mean [95 % CI], TOST at +-MARGIN; or why there is none."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return "no held-out runs of that cell"
    diff = np.array([a[s] - b[s] for s in seeds])
    mean, se, dof = diff.mean(), diff.std(ddof=1) / math.sqrt(len(diff)), len(diff) - 1
    if se == 0:
        return f"{mean:+.2f} on {len(diff)} pairs (the same cell)"
    half = stats.t.ppf(0.975, dof) * se
    tost = max(stats.t.sf((mean + MARGIN) / se, dof), stats.t.cdf((mean - MARGIN) / se, dof))
    return f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}] on {len(diff)} pairs, TOST ±{MARGIN:g} p = {tost:.2f}"


def check_task(task: str, probe: dict, other: tuple[dict, Cell] | None, cells: dict, kind: str,
               c_all: float) -> dict:
    """One row of the table: the probe's lambda against the region, the rule's rate against the best cell."""
    best = best_cell(cells)
    region, _, threshold = best_region(cells)
    lam = block_lambda(probe, kind, "q") / block_lambda(probe, kind, "v")
    c_other = fit_constant(calibration_pairs(other[0], kind, other[1])) if other else None
    eta = (c_other or c_all) / block_lambda(probe, kind, "q")
    chosen = nearest_cell(cells, eta, lam)
    return {"task": task, "kind": kind, "lambda_q": block_lambda(probe, kind, "q"),
            "lambda_v": block_lambda(probe, kind, "v"), "probe_lambda": lam, "region": region,
            "threshold": threshold, "inside": placement(lam, region, sorted({c.ratio for c in cells.values()})),
            "best": best, "c_all": c_all,
            "c_other": c_other, "eta_qk": eta, "chosen": chosen,
            "heldout": paired(chosen.heldout, best.heldout) if chosen is not best else "the grid's own pick",
            "probe_s": float(probe["wall_s"])}


def render(rows: list[dict], grid_hours: dict[str, float]) -> str:
    head = ("| task | curvature | lambda_max q / v | probe lambda | grid best cell (selection mean) | best region "
            "(lambda) | inside? | c (both tasks) | c (other task) | probe eta_QK | nearest cell (selection mean)"
            " | held-out: nearest cell − grid pick | probe s / study h |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        best, chosen = r["best"], r["chosen"]
        lines.append(
            f"| {r['task']} | {r['kind']} | {r['lambda_q']:.3g} / {r['lambda_v']:.3g} | {r['probe_lambda']:.3g} | "
            f"eta_QK {best.lr:g}, lambda {best.ratio:g} ({best.mean:.1f}) | "
            f"{{{', '.join(f'{x:g}' for x in r['region'])}}} (≥ {r['threshold']:.1f}) | "
            f"{r['inside']} | {r['c_all']:.3g} | "
            f"{'n/a' if r['c_other'] is None else format(r['c_other'], '.3g')} | {r['eta_qk']:.2g} | "
            f"eta_QK {chosen.lr:g}, lambda {chosen.ratio:g} ({chosen.mean:.1f}"
            f"{f', {chosen.failed} failed' if chosen.failed else ''}) | {r['heldout']} | "
            f"{r['probe_s']:.0f} s / {grid_hours[r['task']]:.2f} h |")
    return "\n".join(lines)


def heldout_of(rows: list[dict], task: str) -> tuple[dict, int, str]:
    """A probe-chosen config's runs (run folders of ``peftlab train``) on the held-out seeds of ``task``:
    (seed -> points, failed runs, the config as eta_QK / lambda)."""
    records, _ = collect(rows, where={"task": task})
    values = {rec.seed: SCALE * rec.value for rec in records if rec.seed in HELDOUT_SEEDS and rec.value is not None}
    failed = sum(rec.status != "ok" for rec in records if rec.seed in HELDOUT_SEEDS)
    configs = {(rec.config["lr"], rec.config["lr_ratio"]) for rec in records}
    return values, failed, ", ".join(f"eta_QK {lr:g}, lambda {ratio:g}" for lr, ratio in sorted(configs))


def render_runs(rows: list[dict], cells: dict[str, dict]) -> str:
    """The probe-chosen configs themselves on the held-out seeds, paired with the grid-chosen cell's runs."""
    lines = ["| task | probe-chosen config (preconditioned, c from the other task) | held-out mean ± sd (n, failed) "
             "| grid-chosen cell, held-out | probe config − grid cell, paired |", "|---|---|---|---|---|"]
    for task, task_cells in cells.items():
        values, failed, config = heldout_of(rows, task)
        if not values:
            continue
        best, arr = best_cell(task_cells), np.array(list(values.values()))
        grid = np.array(list(best.heldout.values()))
        lines.append(f"| {task} | {config} | {arr.mean():.1f} ± {arr.std(ddof=1):.1f} ({len(arr)}, {failed}) | "
                     f"eta_QK {best.lr:g}, lambda {best.ratio:g}: {grid.mean():.1f} ± {grid.std(ddof=1):.1f} "
                     f"({len(grid)}) | {paired(values, best.heldout)} |")
    return "\n".join(lines)


def render_edges(probes: dict[str, dict], cells: dict[str, dict]) -> str:
    """Adam's edge of stability from the preconditioned curvature, beside the grid's lambda-1 diagonal and the
    cells whose eta_V is at least the edge."""
    lines = ["| task | Adam edge 38/lambda_max, q / v | lambda 1 on the grid: rate: selection mean (failed seeds) | "
             "failed seeds, cells with eta_V below / above the v edge |", "|---|---|---|---|"]
    for task, probe in probes.items():
        if "preconditioned" not in probe["kinds"]:
            continue
        edge = [38 / block_lambda(probe, "preconditioned", b) for b in ("q", "v")]
        diagonal = sorted((c for c in cells[task].values() if c.ratio == 1), key=lambda c: c.lr)
        shown = "; ".join(f"{c.lr:g}: {c.mean:.1f}" + (f" ({c.failed}/{len(c.selection)})" if c.failed else "")
                          for c in diagonal)
        lost = []
        for side in (False, True):
            group = [c for c in cells[task].values() if (c.lr * c.ratio > edge[1]) == side]
            lost.append(f"{sum(c.failed for c in group)}/{sum(len(c.selection) for c in group)} in {len(group)} cells")
        lost = " / ".join(lost)
        lines.append(f"| {task} | {edge[0]:.2g} / {edge[1]:.2g} | {shown} | {lost} |")
    return "\n".join(lines)


def load_probe(path: str) -> dict:
    try:
        probe = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise PeftlabError(f"cannot read probe.json {path}: {err}", fix="pass files written by peftlab probe") from None
    return probe


def run(store: str, probe_paths: list[str], kinds: list[str] | None = None, runs: list[str] | None = None) -> str:
    rows = load_rows([store])
    probes = {p["config"]["task"]: p for p in map(load_probe, probe_paths)}
    cells = {task: grid_cells(rows, task) for task in probes}
    bests = {task: best_cell(c) for task, c in cells.items()}
    kinds = kinds or [k for k in next(iter(probes.values()))["kinds"] if all(k in p["kinds"] for p in probes.values())]
    out = []
    for kind in kinds:
        c_all = fit_constant([pair for task, probe in probes.items()
                              for pair in calibration_pairs(probe, kind, bests[task])])
        for task, probe in probes.items():
            others = [t for t in probes if t != task]
            other = (probes[others[0]], bests[others[0]]) if len(others) == 1 else None
            out.append(check_task(task, probe, other, cells[task], kind, c_all))
    hours = {task: grid_seconds(rows, task) / 3600 for task in probes}
    parts = [render(out, hours), render_edges(probes, cells)]
    if runs:
        parts.append(render_runs(load_rows(runs), cells))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/probe_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("store", help="the lambda study's results.sqlite")
    parser.add_argument("probes", nargs="+", help="probe.json files, one per task")
    parser.add_argument("--kind", action="append", help="raw_init, raw_after_adam, preconditioned (default: all)")
    parser.add_argument("--runs", nargs="+", help="run folders of the probe-chosen configs on the held-out seeds")
    args = parser.parse_args(argv)
    try:
        print(run(args.store, args.probes, args.kind, args.runs))
    except PeftlabError as err:
        print(f"peftlab: error: {err}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
