"""What a ``peftlab tune`` found: its trials, the candidates' seed re-runs, the winner, and what it spent; written
to ``<output_dir>/tune.json`` after every trial, rendered by ``--summary`` and by ``peftlab report``.

The winner: among the ``top_k`` complete trials, the one whose seed re-runs have the best mean; a candidate any
of whose seeds did not end ok ranks below every candidate whose seeds all trained (a lambda that breaks one seed
in five is not the one to pick), so a ``no_learning`` trial wins only where nothing learned, and then there is no
winner. The selection seeds' mean flatters the winner: the held-out seeds' mean ± std is reported apart.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from peftlab.lab.store_schema import FINISHED, NOT_OK, effective_status
from peftlab.lab.tune.spec import SUMMARY_FILE, run_config
from peftlab.tasks.table import SELECTION_PREFIX


def epochs_trained(row: dict | None) -> int:
    """Epochs a finished run trained (a diverged run's last, partial epoch counts whole)."""
    result = (row or {}).get("result") or {}
    logged = len(result.get("epochs_log") or []) + (1 if (row or {}).get("status") == "diverged" else 0)
    ran = result.get("epochs_run")
    return max(logged, ran) if isinstance(ran, int) and not isinstance(ran, bool) else logged


def best_value(result: dict | None, metric: str) -> float | None:
    value = (((result or {}).get("best") or {}).get("metrics") or {}).get(metric)
    return float(value) if isinstance(value, (int, float)) else None


def trial_outcome(row: dict | None, metric: str) -> dict:
    """How a trial's run ended: outcome (complete, pruned, diverged, collapsed, failed), the Optuna state
    to tell, the objective value, epochs trained and the reason."""
    result = (row or {}).get("result") or {}
    status = effective_status((row or {}).get("status"), result)  # a schema-1 store's pruned "ok" is pruned
    epochs = epochs_trained(row)
    if status == "failed" or status not in FINISHED:
        return {"outcome": "failed", "state": "failed", "value": None, "epochs": epochs,
                "reason": (row or {}).get("error") or result.get("status_reason") or "the run did not finish"}
    if status in ("diverged", "collapsed"):
        return {"outcome": status, "state": "pruned", "value": None, "epochs": epochs,
                "reason": result.get("status_reason")}
    # no_learning ran every epoch: Optuna gets its value; the candidate counts it not ok
    reason = {"ok": None, "no_learning": result.get("status_reason"),
              "pruned": (result.get("stopped_early") or {}).get("reason") or result.get("status_reason")}[status]
    state = "pruned" if status == "pruned" else "complete"
    return {"outcome": "complete" if status == "ok" else status, "state": state,
            "value": best_value(result, metric), "epochs": epochs, "reason": reason}


def reported_metric(metric: str) -> str:
    """The metric a held-out score reports: a ``selection_<name>`` objective chose (--selection-samples), its test
    split's ``<name>`` reports."""
    return metric.removeprefix(SELECTION_PREFIX)


def seed_scores(tune, params: dict, seeds: list[int], by_key: dict[str, dict], metric: str | None = None
                ) -> dict[str, Any]:
    """One search point's runs on ``seeds``: status per seed (``missing`` when not in the store), the values of
    the ok ones (only those: never a diverged, collapsed or no-learning seed's metric), mean, std, epochs; the
    value is ``metric`` at the best epoch (default: the tune's objective)."""
    metric = metric or tune.metric
    values, statuses, epochs, keys = [], {}, 0, []
    for seed in seeds:
        run = run_config(tune, params, seed)
        row = by_key.get(run.key)
        status = effective_status(row["status"], row.get("result")) if row else "missing"
        statuses[str(seed)] = status
        keys.append(run.key)
        epochs += epochs_trained(row) if row else 0
        value = best_value(row["result"], metric) if status == "ok" else None
        if value is not None:
            values.append(value)
    return {"params": params, "seeds": list(seeds), "statuses": statuses, "keys": keys, "values": values,
            "n": len(values), "not_ok": sum(1 for st in statuses.values() if st in NOT_OK), "epochs": epochs,
            "done": all(st in (*FINISHED, "failed") for st in statuses.values()),
            "mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None}


def rank_key(value: float | None, direction: str):
    if value is None:
        return float("inf")
    return -value if direction == "maximize" else value


def build_summary(tune, trials: list[dict], rows: Iterable[dict]) -> dict[str, Any]:
    """The summary as JSON-able data (``tune`` is a TuneSpec; ``trials`` from StudyKeeper.trials())."""
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
    complete = [t for t in trial_rows if t["outcome"] in ("complete", "no_learning")]
    complete.sort(key=lambda t: rank_key(t["value"], tune.direction))
    candidates, seed_epochs = [], 0
    for trial in complete[:tune.top_k]:
        scores = seed_scores(tune, trial["params"], tune.seed_list, by_key)
        # the trial itself is the candidate's first seed: its epochs are the search's
        seed_epochs += sum(epochs_trained(by_key.get(key)) for key in scores["keys"] if key != trial["key"])
        candidates.append({"trial": trial["number"], "search_value": trial["value"], **scores})
    winner = None
    if candidates and all(c["done"] for c in candidates):
        ranked = sorted(candidates, key=lambda c: (c["not_ok"], rank_key(c["mean"], tune.direction)))
        winner = ranked[0] if ranked[0]["mean"] is not None else None
    heldout = (seed_scores(tune, winner["params"], tune.heldout_seed_list, by_key, reported_metric(tune.metric))
               if winner is not None and tune.heldout_seeds else None)
    spent = search_epochs + seed_epochs
    heldout_epochs = heldout["epochs"] if heldout else 0
    grid = tune.grid_epochs
    return {
        "spec": str(tune.spec_path), "description": tune.description, "metric": tune.metric,
        "direction": tune.direction, "epochs_per_run": tune.epochs, "grid_size": tune.grid_size,
        "seeds": tune.seeds, "selection_seeds": tune.seed_list, "top_k": tune.top_k,
        "pruner": tune.pruner.describe(), "budget_epochs": tune.budget_epochs, "search_budget": tune.search_budget,
        "trials": trial_rows, "candidates": candidates, "winner": winner,
        "heldout_seeds": tune.heldout_seeds, "heldout_seed_start": tune.heldout_seed_start, "heldout": heldout,
        "finished": winner is not None and (heldout is None or heldout["done"]),
        "search_epochs": search_epochs, "seed_epochs": seed_epochs, "spent_epochs": spent, "grid_epochs": grid,
        "fraction_of_grid": (spent / grid) if grid else None,
        "heldout_epochs": heldout_epochs, "total_epochs": spent + heldout_epochs,
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
    counts = Counter(trial["outcome"] for trial in summary["trials"])
    lines += ["", "trials: " + ", ".join(f"{n} {name}" for name, n in sorted(counts.items())), ""]
    if summary["candidates"]:
        lines += [f"Top {len(summary['candidates'])} re-run with {summary['seeds']} seeds:", "",
                  f"| point | {metric} mean ± std (n) | seeds not ok |", "|---|---|---|"]
        for cand in summary["candidates"]:
            bad = ", ".join(f"seed {s}: {st}" for s, st in cand["statuses"].items() if st != "ok") or "-"
            lines.append(f"| {_point(cand['params'])} | {_mean_std(cand)} ({cand['n']}) | {bad} |")
        lines.append("")
    winner = summary.get("winner")
    if winner:
        bad = f"; {winner['not_ok']} seed(s) not ok" if winner.get("not_ok") else ""
        lines.append(f"winner: {_point(winner['params'])}: {metric} {_mean_std(winner)} over {winner['n']} "
                     f"selection seed(s){_seed_range(summary.get('selection_seeds'))} (the seeds that chose it{bad})")
        lines.append(_heldout_line(summary, metric))
    else:
        lines.append("winner: " + no_winner_reason(summary))
    spent = summary["spent_epochs"]
    compute = (f"compute: {spent} epochs trained (search {summary['search_epochs']}, seed re-runs "
               f"{summary['seed_epochs']}); budget {summary['budget_epochs']:g}")
    if summary.get("grid_epochs"):
        compute += (f"; the full grid ({summary['grid_size']} points x {summary['seeds']} seeds x "
                    f"{summary['epochs_per_run']} epochs) is {summary['grid_epochs']}: "
                    f"{100 * summary['fraction_of_grid']:.1f}% of it")
    if summary.get("heldout_seeds"):
        compute += f"; held-out check {summary.get('heldout_epochs', 0)} epochs more, outside the budget"
    lines.append(compute)
    return "\n".join(lines) + "\n"


def no_winner_reason(summary: dict) -> str:
    if not summary["candidates"]:
        return "none yet (no trial completed)"
    if not all(c.get("done", True) for c in summary["candidates"]):
        return "none yet (seed re-runs unfinished)"
    return "none (no candidate has a seed run that finished ok: see the seeds not ok above)"


def _mean_std(scores: dict) -> str:
    std = f" ± {scores['std']:.4f}" if scores.get("std") is not None else ""
    return f"{_num(scores.get('mean'))}{std}"


def _seed_range(seeds) -> str:
    return f" {seeds[0]}..{seeds[-1]}" if seeds else ""


def _heldout_line(summary: dict, metric: str) -> str:
    """The winner's score on seeds nothing chose it on (or why there is none)."""
    if "heldout_seeds" not in summary:  # a tune.json from before held-out seeds existed
        return "held-out: none (this tune predates held-out seeds): the score above flatters the winner"
    if not summary["heldout_seeds"]:
        return "held-out: none (heldout_seeds: 0): the score above is on the seeds that chose the winner"
    heldout = summary.get("heldout") or {}
    asked = len(heldout.get("seeds") or []) or summary["heldout_seeds"]
    seeds = heldout.get("seeds") or [summary["heldout_seed_start"] + i for i in range(asked)]
    bad = ", ".join(f"seed {s}: {st}" for s, st in (heldout.get("statuses") or {}).items() if st != "ok")
    if not heldout.get("n"):
        return (f"held-out: no finished ok run yet of {asked} held-out seed(s){_seed_range(seeds)}"
                + (f" ({bad})" if bad else ""))
    return (f"held-out: {reported_metric(metric)} {_mean_std(heldout)} over {heldout['n']} of {asked} held-out seed(s)"
            f"{_seed_range(seeds)} (never used to choose)" + (f"; not ok or missing: {bad}" if bad else ""))


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
