"""What a ``peftlab tune`` found: its trials, the candidates' seed re-runs, the winner, and what it spent.

The summary is built from the study's trials and the results store (the runs' result.json), written to
``<output_dir>/tune.json`` after every trial, and rendered by ``peftlab tune SPEC --summary`` and by
``peftlab report`` for a store that has a ``tune.json`` beside it.

The winner: among the ``top_k`` complete trials (best dev metric of their best epoch), the one whose seed
re-runs have the best mean; a candidate any of whose seeds diverged, collapsed or failed ranks below every
candidate whose seeds all trained (a lambda that breaks one seed in five is not the one to pick).
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any, Iterable

from peftlab.lab.store import FINISHED

SUMMARY_FILE = "tune.json"


def epochs_trained(row: dict | None) -> int:
    """Epochs a finished run trained (a diverged run's last, partial epoch counts whole)."""
    result = (row or {}).get("result") or {}
    epochs = len(result.get("epochs_log") or [])
    return epochs + (1 if (row or {}).get("status") == "diverged" else 0)


def best_value(result: dict | None, metric: str) -> float | None:
    value = (((result or {}).get("best") or {}).get("metrics") or {}).get(metric)
    return float(value) if isinstance(value, (int, float)) else None


def trial_outcome(row: dict | None, metric: str) -> dict:
    """How a trial's run ended: outcome (complete, pruned, diverged, collapsed, failed), the Optuna state
    to tell, the objective value, epochs trained and the reason."""
    status = (row or {}).get("status")
    result = (row or {}).get("result") or {}
    epochs = epochs_trained(row)
    if status == "failed" or status not in FINISHED:
        return {"outcome": "failed", "state": "failed", "value": None, "epochs": epochs,
                "reason": (row or {}).get("error") or result.get("status_reason") or "the run did not finish"}
    if status in ("diverged", "collapsed"):
        return {"outcome": status, "state": "pruned", "value": None, "epochs": epochs,
                "reason": result.get("status_reason")}
    if result.get("stopped_early"):
        return {"outcome": "pruned", "state": "pruned", "value": best_value(result, metric), "epochs": epochs,
                "reason": result["stopped_early"].get("reason")}
    return {"outcome": "complete", "state": "complete", "value": best_value(result, metric), "epochs": epochs,
            "reason": None}


def rank_key(value: float | None, direction: str):
    if value is None:
        return float("inf")
    return -value if direction == "maximize" else value


def build_summary(tune, trials: list[dict], rows: Iterable[dict]) -> dict[str, Any]:
    """The summary as JSON-able data (``tune`` is a TuneSpec; ``trials`` from StudyKeeper.trials())."""
    from peftlab.lab.tune_spec import run_config

    by_key = {row["key"]: row for row in rows}
    seen: set[str] = set()
    trial_rows, search_epochs = [], 0
    for trial in trials:
        attrs = trial["attrs"]
        key = attrs.get("key")
        duplicate = key in seen
        seen.add(key)
        row = by_key.get(key)
        if trial["state"] == "running":
            outcome = {"outcome": "running", "value": None, "epochs": len(trial["intermediate"]), "reason": None}
        elif row is not None and row["status"] in (*FINISHED, "failed"):
            outcome = trial_outcome(row, tune.metric)
        else:
            outcome = {"outcome": attrs.get("outcome", trial["state"]), "value": trial["value"],
                       "epochs": attrs.get("epochs", 0), "reason": attrs.get("reason")}
        if duplicate:
            outcome = {**outcome, "outcome": "duplicate", "epochs": 0, "reason": "same run as an earlier trial"}
        search_epochs += outcome["epochs"]
        trial_rows.append({"number": trial["number"], "params": trial["params"], "key": key, **outcome,
                           "state": trial["state"]})
    complete = [t for t in trial_rows if t["outcome"] == "complete"]
    complete.sort(key=lambda t: rank_key(t["value"], tune.direction))
    candidates, seed_epochs, seed_runs_done = [], 0, True
    for trial in complete[:tune.top_k]:
        values, statuses, runs = [], {}, []
        for seed in tune.seed_list:
            run = run_config(tune, trial["params"], seed)
            row = by_key.get(run.key)
            status = row["status"] if row else "missing"
            statuses[str(seed)] = status
            if run.key != trial["key"]:
                seed_epochs += epochs_trained(row) if row else 0
            if status == "ok":
                value = best_value(row["result"], tune.metric)
                if value is not None:
                    values.append(value)
            if status not in (*FINISHED, "failed"):
                seed_runs_done = False
            runs.append(run.key)
        not_ok = sum(1 for s in statuses.values() if s in ("diverged", "collapsed", "failed"))
        candidates.append({"trial": trial["number"], "params": trial["params"], "search_value": trial["value"],
                           "values": values, "statuses": statuses, "n": len(values), "not_ok": not_ok,
                           "mean": statistics.fmean(values) if values else None,
                           "std": statistics.stdev(values) if len(values) > 1 else None})
    winner = None
    if candidates and seed_runs_done:
        ranked = sorted(candidates, key=lambda c: (c["not_ok"], rank_key(c["mean"], tune.direction)))
        winner = ranked[0] if ranked[0]["mean"] is not None else None
    spent = search_epochs + seed_epochs
    grid = tune.grid_epochs
    return {
        "spec": str(tune.spec_path), "description": tune.description, "metric": tune.metric,
        "direction": tune.direction, "epochs_per_run": tune.epochs, "grid_size": tune.grid_size,
        "seeds": tune.seeds, "top_k": tune.top_k, "pruner": tune.pruner.describe(),
        "budget_epochs": tune.budget_epochs, "search_budget": tune.search_budget,
        "trials": trial_rows, "candidates": candidates, "winner": winner, "finished": winner is not None,
        "search_epochs": search_epochs, "seed_epochs": seed_epochs, "spent_epochs": spent, "grid_epochs": grid,
        "fraction_of_grid": (spent / grid) if grid else None,
    }


def write_summary(path: Path, summary: dict) -> None:
    from peftlab.io_utils import atomic_write_text

    atomic_write_text(path, json.dumps(summary, indent=1, default=str) + "\n")


# --------------------------------------------------------------------------- rendering


def _point(params: dict) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _num(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render_summary(summary: dict) -> str:
    metric = summary["metric"]
    lines = [f"## peftlab tune: {Path(summary['spec']).name}" + (f" ({summary['description']})"
                                                                  if summary.get("description") else ""), ""]
    lines += [f"Trials (objective: {metric}, best epoch, {summary['direction']}; pruner: {summary['pruner']}):", "",
              "| trial | point | outcome | epochs | " + metric + " | note |", "|---|---|---|---|---|---|"]
    for trial in summary["trials"]:
        note = (trial.get("reason") or "").replace("|", "/")
        lines.append(f"| {trial['number']} | {_point(trial['params'])} | {trial['outcome']} | {trial['epochs']} | "
                     f"{_num(trial['value'])} | {note[:90]} |")
    counts: dict[str, int] = {}
    for trial in summary["trials"]:
        counts[trial["outcome"]] = counts.get(trial["outcome"], 0) + 1
    lines += ["", "trials: " + ", ".join(f"{n} {name}" for name, n in sorted(counts.items())), ""]
    if summary["candidates"]:
        lines += [f"Top {len(summary['candidates'])} re-run with {summary['seeds']} seeds:", "",
                  f"| point | {metric} mean ± std (n) | seeds not ok |", "|---|---|---|"]
        for cand in summary["candidates"]:
            std = f" ± {cand['std']:.4f}" if cand["std"] is not None else ""
            bad = ", ".join(f"seed {s}: {st}" for s, st in cand["statuses"].items() if st != "ok") or "-"
            lines.append(f"| {_point(cand['params'])} | {_num(cand['mean'])}{std} ({cand['n']}) | {bad} |")
        lines.append("")
    winner = summary.get("winner")
    if winner:
        std = f" ± {winner['std']:.4f}" if winner["std"] is not None else ""
        lines.append(f"winner: {_point(winner['params'])}: {metric} {_num(winner['mean'])}{std} "
                     f"over {winner['n']} seed(s)")
    else:
        lines.append("winner: none yet" + (" (no trial completed)" if not summary["candidates"] else
                                           " (seed re-runs unfinished)"))
    spent = summary["spent_epochs"]
    compute = (f"compute: {spent} epochs trained (search {summary['search_epochs']}, seed re-runs "
               f"{summary['seed_epochs']}); budget {summary['budget_epochs']:g}")
    if summary.get("grid_epochs"):
        compute += (f"; the full grid ({summary['grid_size']} points x {summary['seeds']} seeds x "
                    f"{summary['epochs_per_run']} epochs) is {summary['grid_epochs']}: "
                    f"{100 * summary['fraction_of_grid']:.1f}% of it")
    lines.append(compute)
    return "\n".join(lines) + "\n"


def summaries_beside(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Rendered summaries of the tunes whose store (or output folder) is among ``paths`` (for peftlab report)."""
    out = []
    for path in paths:
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        file = folder / SUMMARY_FILE
        if file.is_file():
            try:
                out.append(render_summary(json.loads(file.read_text())))
            except (OSError, ValueError, KeyError, TypeError):
                out.append(f"(unreadable tune summary: {file})\n")
    return out
