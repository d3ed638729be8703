"""Tune against grid against the naive search, each pick judged on seeds that did not choose it.

Three ways to choose a search point of a tune spec's space (``search:``, every key a list), all read from
results stores (no training here):

* **grid**: the full grid, every point x the selection seeds (``seeds: S``, base seed + i, what a sweep of the
  same space trains); the best mean over those seeds wins.
* **naive**: every point once at the base seed (no pruning), the ``top_k`` of those re-run on the selection
  seeds; the best mean wins. Its cost: points x epochs + top_k x (S - 1) x epochs (actual epochs, from the runs).
* **tune**: ``peftlab tune``'s winner (its ``tune.json``), at the epochs its search and re-runs spent.

A mean over the seeds that chose a point flatters it (the best of several noisy means), so each pick is also
scored on the tune's held-out seeds (``heldout_seeds`` from ``heldout_seed_start``), when the stores hold
those runs (the tune runs them for its winner; :func:`run_heldout` here for the others). A pick
whose held-out runs are missing says so.

Only finished ``ok`` runs give values. Ranking, as the tune's winner (:mod:`peftlab.lab.tune.summary`): a
point any of whose seeds diverged, collapsed, failed or never left chance ranks below every point whose seeds
all trained; a naive first-round point whose base-seed run is not ok is never re-seeded. Every run is found by
its config key (:func:`peftlab.lab.tune.spec.run_config`), so the grid's sweep and the tune must share configs
(configs/tune/*.yaml are written to match configs/sweeps/lambda_grid_minilm.yaml).
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from peftlab.errors import PeftlabError
from peftlab.lab.store import Store, resolve_store_path
from peftlab.lab.store_schema import FINISHED, effective_status
from peftlab.lab.runner import InProcess
from peftlab.lab.tune.run import exclusive, run_plain
from peftlab.lab.tune.spec import SUMMARY_FILE, TuneSpec, heldout_runs
from peftlab.lab.tune.summary import rank_key, reported_metric, seed_scores


@dataclass(frozen=True)
class Scores:
    """One point's runs on some seeds: the ok runs' best-epoch metric, and what the others were."""

    seeds: tuple[int, ...]
    values: tuple[float, ...]  # finished ok runs only
    statuses: dict[int, str] = field(default_factory=dict)  # seed -> status, "missing" when not in the stores
    epochs: int = 0  # epochs those runs trained
    mean: float | None = None
    std: float | None = None

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def not_ok(self) -> int:
        """Seeds whose complete run ended other than ok (diverged, collapsed, no_learning, failed)."""
        return sum(1 for s in self.statuses.values() if s in (*FINISHED, "failed") and s not in ("ok", "pruned"))

    @property
    def missing(self) -> tuple[int, ...]:
        """Seeds without a complete finished run: none in the stores, unfinished, or only a pruned trial."""
        return tuple(s for s, st in self.statuses.items() if st not in (*FINISHED, "failed") or st == "pruned")

    def describe(self, digits: int = 4) -> str:
        if not self.values:
            if self.missing:
                return f"missing ({len(self.missing)} of {len(self.seeds)} seed runs not in the stores)"
            return f"n/a (no ok run of {len(self.seeds)})"
        std = f" ± {self.std:.{digits}f}" if self.std is not None else ""
        return f"{self.mean:.{digits}f}{std} ({self.n} of {len(self.seeds)})"


@dataclass(frozen=True)
class Pick:
    search: str  # grid | naive | tune
    params: dict[str, Any]
    selection: Scores  # on the selection seeds (the ones that chose it)
    cost_epochs: float | None  # epochs the search trained to make this pick
    heldout: Scores | None  # on the held-out seeds; None when the spec has heldout_seeds: 0
    how: str  # how it was chosen, one line

    @property
    def point(self) -> str:
        return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params.items())


@dataclass(frozen=True)
class Comparison:
    spec: str
    task: str
    metric: str
    direction: str
    grid_points: int
    grid_epochs: int  # epochs the full grid's runs trained
    picks: tuple[Pick, ...]
    notes: tuple[str, ...] = ()

    def pick(self, search: str) -> Pick | None:
        return next((p for p in self.picks if p.search == search), None)


# --------------------------------------------------------------------------- rows


def load_rows(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Every row of the stores (files or output folders) at ``paths``, each opened read-only."""
    rows: list[dict] = []
    for path in paths:
        with Store(resolve_store_path(path), create=False) as store:
            rows += store.rows()
    return rows


def index_rows(rows: Iterable[dict]) -> dict[str, dict]:
    """Rows by key; where several stores hold a key, an ok row wins over another finished one, and a finished
    row over an unfinished one (a grid's complete run over an old tune store's pruned trial of that key)."""
    def rank(row: dict) -> int:
        status = effective_status(row["status"], row.get("result"))
        return 2 if status == "ok" else 1 if status in (*FINISHED, "failed") else 0

    by_key: dict[str, dict] = {}
    for row in rows:
        row = {**row, "status": effective_status(row["status"], row.get("result"))}
        if row["key"] not in by_key or rank(row) > rank(by_key[row["key"]]):
            by_key[row["key"]] = row
    return by_key


def scores(tune, by_key: dict[str, dict], params: dict, seeds: Iterable[int]) -> Scores:
    """A point's scores on ``seeds``: the objective on the seeds that choose, the reported (test) metric on the
    held-out seeds (they differ with --selection-samples)."""
    seeds = list(seeds)
    held_out = bool(seeds) and seeds == list(tune.heldout_seed_list)
    raw = seed_scores(tune, params, seeds, by_key, reported_metric(tune.metric) if held_out else None)
    return Scores(seeds=tuple(raw["seeds"]), values=tuple(raw["values"]),
                  statuses={int(s): st for s, st in raw["statuses"].items()}, epochs=raw["epochs"],
                  mean=raw["mean"], std=raw["std"])


def _points(tune) -> list[dict]:
    """The grid's points in the spec's order (the search keys' lists, last key fastest)."""
    if tune.grid_size is None:
        raise PeftlabError(f"{Path(tune.spec_path).name}: a search with a range has no grid to compare against",
                           where=str(tune.spec_path), fix="give every search key a list of values")
    names = list(tune.search)
    return [dict(zip(names, combo)) for combo in itertools.product(*(tune.search[n].values for n in names))]


def _ranked(candidates: list[tuple[dict, Scores]], direction: str) -> list[tuple[dict, Scores]]:
    return sorted(candidates, key=lambda c: (c[1].not_ok, rank_key(c[1].mean, direction)))


def _require(what: str, tune, missing: list[tuple[dict, int]]) -> None:
    if missing:
        params, seed = missing[0]
        point = " ".join(f"{k}={v}" for k, v in params.items())
        raise PeftlabError(f"{what}: {len(missing)} run(s) of the grid are not finished in the stores, e.g. "
                           f"{{{point}}} seed {seed}", where=str(tune.spec_path),
                           fix="run the grid's sweep (same configs, seeds base .. base + seeds - 1) into a store "
                               "and pass it")


# --------------------------------------------------------------------------- the three picks


def grid_best(tune, by_key: dict[str, dict]) -> Pick:
    """The full grid's best point by its mean over the selection seeds."""
    table = [(params, scores(tune, by_key, params, tune.seed_list)) for params in _points(tune)]
    _require("grid best", tune, [(p, s) for p, sc in table for s in sc.missing])
    params, best = _ranked(table, tune.direction)[0]
    heldout = scores(tune, by_key, params, tune.heldout_seed_list) if tune.heldout_seeds else None
    return Pick("grid", params, best, cost_epochs=sum(sc.epochs for _, sc in table), heldout=heldout,
                how=f"best mean over {tune.seeds} selection seed(s) of all {len(table)} points")


def naive_top_k_within(tune, budget_epochs: float) -> int:
    """The most points the naive search can re-seed within ``budget_epochs`` (0: it cannot even visit every
    point once)."""
    first_round = len(_points(tune)) * tune.epochs
    per_point = (tune.seeds - 1) * tune.epochs
    if budget_epochs < first_round:
        return 0
    if per_point == 0:
        return len(_points(tune))
    return min(len(_points(tune)), int((budget_epochs - first_round) // per_point))


def naive_pick(tune, by_key: dict[str, dict], *, top_k: int | None = None) -> Pick:
    """Every point once at the base seed, the ``top_k`` (default: the spec's) re-run on the selection seeds,
    the best mean wins."""
    top_k = tune.top_k if top_k is None else top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise PeftlabError(f"the naive search's top_k must be a positive integer, got {top_k!r}",
                           fix="re-seed at least the best point of the first round")
    points = _points(tune)
    first = [(params, scores(tune, by_key, params, [tune.base_seed])) for params in points]
    _require("naive search, first round", tune, [(p, s) for p, sc in first for s in sc.missing])
    # a point whose base-seed run is not ok has no value: ranked last (rank_key(None)), never re-seeded
    order = sorted(range(len(first)), key=lambda i: rank_key(first[i][1].mean, tune.direction))
    chosen = [first[i][0] for i in order[:top_k] if first[i][1].mean is not None]
    if not chosen:
        raise PeftlabError("naive search: no point's base-seed run finished ok", where=str(tune.spec_path))
    reseeded = [(params, scores(tune, by_key, params, tune.seed_list)) for params in chosen]
    _require("naive search, re-seeded points", tune, [(p, s) for p, sc in reseeded for s in sc.missing])
    params, best = _ranked(reseeded, tune.direction)[0]
    others = [s for s in tune.seed_list if s != tune.base_seed]
    cost = sum(sc.epochs for _, sc in first) + sum(scores(tune, by_key, p, others).epochs for p in chosen)
    heldout = scores(tune, by_key, params, tune.heldout_seed_list) if tune.heldout_seeds else None
    return Pick("naive", params, best, cost_epochs=cost, heldout=heldout,
                how=f"all {len(points)} points at seed {tune.base_seed} (no pruning), top {len(chosen)} re-run on "
                    f"{tune.seeds} selection seed(s), best mean")


def tune_pick(tune, by_key: dict[str, dict], summary: dict) -> Pick | None:
    """``peftlab tune``'s winner (from its summary), scored from the stores like the other picks."""
    winner = summary.get("winner")
    if not winner:
        return None
    params = dict(winner["params"])
    heldout = scores(tune, by_key, params, tune.heldout_seed_list) if tune.heldout_seeds else None
    return Pick("tune", params, scores(tune, by_key, params, tune.seed_list),
                cost_epochs=summary.get("spent_epochs"), heldout=heldout,
                how=f"peftlab tune ({summary.get('pruner', 'pruned search')}), top {summary.get('top_k')} "
                    f"re-run on {tune.seeds} selection seed(s)")


def compare(tune, rows: Iterable[dict], *, summary: dict | None = None, naive_top_k: int | None = None,
            naive_budget: float | None = None) -> Comparison:
    """The grid's best, the naive pick and, given its summary, the tune's winner, each with its held-out scores.
    ``rows``: the grid's and the tune's stores' rows. The naive search re-seeds ``naive_top_k`` points, else as
    many as ``naive_budget`` epochs allow (e.g. the tune's budget: equal cost), else the spec's ``top_k``."""
    by_key = index_rows(rows)
    grid = grid_best(tune, by_key)
    picks, notes = [grid], []
    if naive_top_k is None and naive_budget is not None:
        naive_top_k = naive_top_k_within(tune, naive_budget)
        if naive_top_k == 0:
            notes.append(f"no naive pick: {naive_budget:g} epochs do not cover one run of each of the "
                         f"{tune.grid_size} points ({tune.grid_size * tune.epochs} epochs)")
    if naive_top_k != 0:
        picks.append(naive_pick(tune, by_key, top_k=naive_top_k))
    if summary is not None:
        picked = tune_pick(tune, by_key, summary)
        if picked is None:
            notes.append("the tune has no winner yet")
        else:
            picks.append(picked)
    notes.append("; ".join(f"{pick.search}: {pick.how}" for pick in picks))
    lacking = [f"{pick.search} {{{pick.point}}} seed(s) {_seed_list(pick.heldout.missing)}" for pick in picks
               if pick.heldout is not None and pick.heldout.missing]
    if lacking:
        notes.append("held-out runs missing: " + "; ".join(lacking) + " (tune_compare.run_heldout trains them)")
    if not tune.heldout_seeds:
        notes.append("heldout_seeds: 0 in the spec: every pick is scored on the seeds that chose it")
    return Comparison(spec=str(tune.spec_path), task=str(tune.base.get("task")), metric=tune.metric,
                      direction=tune.direction, grid_points=tune.grid_size, grid_epochs=int(grid.cost_epochs),
                      picks=tuple(picks), notes=tuple(notes))


def compare_files(spec: str | os.PathLike, stores: Iterable[str | os.PathLike], *,
                  summary: str | os.PathLike | None = None, naive_top_k: int | None = None,
                  naive_budget: float | None = None) -> Comparison:
    """:func:`compare` from files: a tune spec, results stores (the grid's, the tune's, held-out sweeps) and the
    tune's summary (``tune.json``; default ``<spec output_dir>/tune.json`` when it exists)."""
    from peftlab.lab.tune.spec import load_tune_spec

    tune = load_tune_spec(spec)
    path = Path(summary) if summary is not None else tune.output_root / SUMMARY_FILE
    if summary is not None and not path.is_file():
        raise PeftlabError(f"tune summary not found: {path}", fix="pass the tune.json a peftlab tune wrote")
    data = json.loads(path.read_text()) if path.is_file() else None
    return compare(tune, load_rows(stores), summary=data, naive_top_k=naive_top_k, naive_budget=naive_budget)


# --------------------------------------------------------------------------- rendering


def _seed_list(seeds) -> str:
    seeds = list(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}..{seeds[-1]}"
    return ", ".join(map(str, seeds))


def render_comparison(comparisons: Iterable[Comparison]) -> str:
    """One Markdown table: per task, the three picks, their selection and held-out scores and their cost."""
    lines = ["| task | search | pick | selection mean ± std (n) | held-out mean ± std (n) | epochs to pick "
             "(of the grid's) |", "|---|---|---|---|---|---|"]
    notes = []
    for comp in comparisons:
        for pick in comp.picks:
            heldout = "not asked (heldout_seeds: 0)" if pick.heldout is None else pick.heldout.describe()
            bad = [f"seed {s}: {st}" for s, st in pick.selection.statuses.items() if st != "ok"]
            selection = pick.selection.describe() + (f" [{', '.join(bad)}]" if bad else "")
            cost = "n/a" if pick.cost_epochs is None else f"{pick.cost_epochs:g}"
            share = f" ({pick.cost_epochs / comp.grid_epochs:.0%})" if pick.cost_epochs and comp.grid_epochs else ""
            lines.append(f"| {comp.task} | {pick.search} | {pick.point} | {selection} | {heldout} | "
                         f"{cost}{share} |")
        notes += [f"{comp.task}: {note}" for note in comp.notes]
        first = comp.picks[0]
        if first.heldout is not None:
            notes.append(f"{comp.task}: {comp.metric} ({comp.direction}, best epoch); held-out seeds "
                         f"{_seed_list(first.heldout.seeds)}, never used to choose")
    return "\n".join(lines + [""] + [f"- {note}" for note in notes]) + "\n"


def run_heldout(tune: TuneSpec, points: list[dict], *, train_fn: Callable | str | None = None,
                progress: bool = True, capture_output: bool = True) -> list[dict]:
    """Train search ``points`` (e.g. the grid's best and the naive search's pick beside the tune's winner) on
    ``tune``'s held-out seeds into its store, as the tune's own held-out check does (resumable: finished runs
    are found by key); returns each point's scores (:func:`peftlab.lab.tune.summary.seed_scores`)."""
    if not tune.heldout_seeds:
        raise PeftlabError(f"{tune.spec_path.name} has heldout_seeds: 0: there are no held-out seeds to run",
                           where=str(tune.spec_path), fix="set heldout_seeds: N (e.g. 10) in the tune spec")
    say = print if progress else (lambda *a, **k: None)
    with exclusive(tune.output_root):
        with Store(tune.store_path) as store:
            store.prepare([run.key for point in points for run in heldout_runs(tune, point)])
            executor = InProcess(store, train_fn, tune.output_root / "logs" if capture_output else None)
            for point in points:
                run_plain(heldout_runs(tune, point), store, executor, tune.metric, say,
                          what=f"held-out check of {' '.join(f'{k}={v}' for k, v in point.items())}")
            by_key = {row["key"]: row for row in store.rows()}
    return [seed_scores(tune, point, tune.heldout_seed_list, by_key, reported_metric(tune.metric)) for point in points]
