"""The data behind ``peftlab plot --kind heatmap`` and ``--kind lr-grid``: panels of cells over two config keys,
and the one cell a figure may call best.

A cell's mean is over its runs that ended ok; the others are counted, never averaged; a cell no run reached is NaN
(blank). The best cell is marked only when it is *distinguishable* from the runner-up (a paired 95 % t CI over
their common seeds excludes 0), and only cells whose runs all ended ok are candidates. A one-row or one-column
heatmap is refused or drawn as lines (:class:`LineInstead`): it says nothing a line would not say better.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.lab.figures.paper import (AXIS_TITLES, config_label, fixed_keys, fmt_tick, key_value, log_axis, log_edges,
                                      lower_is_better, num_key, split_by_config, task_metrics, trained_runs)
from peftlab.lab.records import RunRecord, fmt_value
from peftlab.lab.table_model import Cell

CONFIDENCE = 0.95


@dataclass(frozen=True)
class GridAxis:
    """One axis of a heatmap panel: a config key's values (or, ``key == "config"``, the configs themselves)."""

    key: str
    title: str
    values: tuple
    labels: tuple[str, ...]
    log: bool  # cells spaced by log(value): learning rates and lambda

    def centres(self) -> list[float]:
        """Where the ticks are: the values on a log axis, else 0, 1, ..."""
        return [float(v) for v in self.values] if self.log else [float(i) for i in range(len(self.values))]

    def cell_centres(self) -> list[float]:
        """The middle of each cell (where its text goes): on a log axis the geometric mean of its edges, which
        differs from the value when its neighbours lie unevenly far."""
        if not self.log:
            return self.centres()
        edges = self.edges()
        return [math.sqrt(a * b) for a, b in zip(edges, edges[1:])]

    def edges(self) -> list[float]:
        return log_edges(self.values) if self.log else [i - 0.5 for i in range(len(self.values) + 1)]


@dataclass(frozen=True)
class BestCell:
    """Which cell is best, whether it is distinguishable from the runner-up, and the caption that says so."""

    cell: tuple[int, int] | None  # (row, column) of the best candidate; None: fewer than two candidates
    runner_up: tuple[int, int] | None
    difference: float | None  # mean paired difference best - runner-up, oriented so that > 0 favours the best
    ci: tuple[float, float] | None  # its 95 % t interval
    pairs: int  # seeds both cells ran
    marked: bool  # the interval excludes 0: the figure marks the best cell
    note: str


@dataclass
class HeatPanel:
    row: int
    col: int
    task: str
    subtitle: str  # the other config keys of this panel ('' when nothing else varies)
    x: GridAxis
    y: GridAxis
    mean: Any  # (len(y), len(x)) mean over the runs that ended ok; NaN: no such run (blank, or all failed)
    n_ok: Any  # (len(y), len(x)) ints
    n_failed: Any  # (len(y), len(x)) ints: runs that did not end ok
    failed: dict[tuple[int, int], dict[str, int]]  # their statuses
    seeds: dict[tuple[int, int], dict[int, float]]  # ok runs' values by seed (duplicates of a seed: their mean)
    best: BestCell


@dataclass
class HeatmapData:
    panels: list[HeatPanel]
    n_rows: int
    n_cols: int
    metrics: dict[str, list[str]]  # task -> metric names
    lower: dict[str, bool]  # task -> lower is better
    limits: dict[str, tuple[float, float]]  # task -> colour limits, shared by all its panels
    folded: bool  # rows are configs (x or y took one value everywhere)
    seed_axis: bool
    diagonal: bool  # x and y are both learning rates: lambda = 1 is the diagonal
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class LineInstead:
    """A heatmap would have a single value on one axis in every panel: draw ``vary`` as a line instead."""

    vary: str  # the key with several values
    note: str


def best_cell(mean, n_ok, n_failed, seeds: dict[tuple[int, int], dict[int, float]], *, lower: bool,
              seed_axis: bool = False, unit: str = "") -> BestCell:
    """The best candidate cell and whether a paired 95 % t interval against the runner-up excludes 0
    (``unit``: "pt" when values are metric points, ×100, written to 2 decimals)."""
    import numpy as np
    from scipy import stats

    if seed_axis:
        return BestCell(None, None, None, None, 0, False, "no best marked: one run per cell (seed is an axis)")
    candidates = [(int(i), int(j)) for i, j in zip(*np.nonzero((n_ok >= 2) & (n_failed == 0)))]
    candidates.sort(key=lambda c: mean[c], reverse=not lower)
    if len(candidates) < 2:
        return BestCell(candidates[0] if candidates else None, None, None, None, 0, False,
                        "no best marked: fewer than two cells with 2+ runs, all ok")
    best, runner_up = candidates[0], candidates[1]
    common = sorted(set(seeds[best]) & set(seeds[runner_up]))
    if len(common) < 2:
        return BestCell(best, runner_up, None, None, len(common), False,
                        f"best not distinguishable: {len(common)} seed(s) shared with the runner-up, 2 needed")
    better = [seeds[best][s] for s in common]
    other = [seeds[runner_up][s] for s in common]
    if lower:
        better, other = other, better  # differences > 0 favour the best
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # identical differences: scipy warns, the interval holds
        result = stats.ttest_rel(better, other)
        low, high = (float(v) for v in result.confidence_interval(CONFIDENCE))
    difference = statistics.fmean(b - o for b, o in zip(better, other))
    marked = math.isfinite(low) and low > 0
    shown = _num(difference, unit, sign=True) + (f" {unit}" if unit else "")
    interval = f", 95\u00a0% CI [{_num(low, unit)}, {_num(high, unit)}]" if math.isfinite(low) else ""
    head = "best, distinguishable from runner-up" if marked else "best not distinguishable from runner-up"
    note = f"{head}:\n{shown}{interval}, {len(common)} pairs"
    return BestCell(best, runner_up, difference, (low, high), len(common), marked, note)


def _num(value: float, unit: str, *, sign: bool = False) -> str:
    """A difference in metric points to 2 decimals (``+0.07``), else to 3 significant digits; never rounded to
    a zero that hides which side of 0 it lies on."""
    plus = "+" if sign else ""
    text = f"{value:{plus}.2f}" if unit and (abs(value) >= 0.005 or value == 0) else f"{value:{plus}.2g}"
    return text.replace("-", "−")


def _fill(recs: list[RunRecord], x_of, y_of, x: GridAxis, y: GridAxis, scale: float):
    """The cells of ``recs`` over ``x`` by ``y`` (``x_of``, ``y_of``: a run's value on each): HeatPanel's mean,
    n_ok, n_failed, failed and seeds."""
    import numpy as np

    failed: dict[tuple[int, int], Counter] = defaultdict(Counter)
    values: dict[tuple[int, int], list[tuple[int, float]]] = defaultdict(list)
    for rec in recs:
        cell = (y.values.index(y_of(rec)), x.values.index(x_of(rec)))
        if rec.status == "ok" and rec.value is not None:
            values[cell].append((rec.seed, rec.value * scale))
        else:
            failed[cell][rec.status if rec.status != "ok" else "missing"] += 1
    shape = (len(y.values), len(x.values))
    mean, n_ok, n_failed = np.full(shape, np.nan), np.zeros(shape, dtype=int), np.zeros(shape, dtype=int)
    for cell, pairs in values.items():
        mean[cell], n_ok[cell] = statistics.fmean(v for _, v in pairs), len(pairs)
    for cell, counts in failed.items():
        n_failed[cell] = counts.total()
    by_seed = {cell: Cell(values=[v for _, v in pairs], seeds=[s for s, _ in pairs]).per_seed()
               for cell, pairs in values.items()}  # a seed run twice in a cell: its mean
    return mean, n_ok, n_failed, dict(failed), by_seed


def _axis(key: str, recs: list[RunRecord]) -> GridAxis:
    values = sorted({key_value(r.config, key) for r in recs}, key=num_key)
    return GridAxis(key, AXIS_TITLES.get(key, key), tuple(values), tuple(fmt_tick(v, key) for v in values),
                    log_axis(key, values))


def _of_task(recs: list[RunRecord], task: str) -> list[RunRecord]:
    return [r for r in recs if r.task == task]


@dataclass(frozen=True)
class _Grid:
    """A heatmap's trained runs grouped by their config less the axes (in order), and how its panels are filled."""

    groups: dict
    configs: dict
    varying: list[str]
    lower: dict[str, bool]
    seed_axis: bool
    scale: float

    def panel(self, row: int, col: int, task: str, sub: str, recs: list[RunRecord], x: GridAxis, y: GridAxis,
              x_of, y_of) -> HeatPanel:
        filled = _fill(recs, x_of, y_of, x, y, self.scale)
        return HeatPanel(row, col, task, sub, x, y, *filled,
                         best=best_cell(*filled[:3], filled[4], lower=self.lower[task], seed_axis=self.seed_axis,
                                        unit="pt" if self.scale == 100 else ""))


def heatmap_data(records: list[RunRecord], *, x: str, y: str, scale: float, fold: bool = True
                 ) -> HeatmapData | LineInstead:
    """Panels of cells (one per task, and per combination of any other key that varies); see the module doc.

    With ``fold``, when x or y takes one value in every task while other keys vary, the panels fold into one
    per task whose rows are the configs (a methods x lambda table, say); without it (``--kind lr-grid``, whose
    axes are the point) such a selection is drawn as lines."""
    trained = trained_runs(records)
    groups, configs, varying = split_by_config(trained, fixed_keys(trained, x, y))
    metrics = task_metrics(trained)
    tasks = list(metrics)
    lower = {t: lower_is_better(m) for t, m in metrics.items()}
    grid = _Grid(groups, configs, varying, lower, "seed" in (x, y), scale)
    x_const = all(len(_axis(x, _of_task(trained, t)).values) == 1 for t in tasks)
    y_const = all(len(_axis(y, _of_task(trained, t)).values) == 1 for t in tasks)
    folded = fold and len(groups) > 1 and (x_const or y_const)
    if folded and x_const and y_const:
        raise PeftlabError(f"every run of a task has one {x} and one {y}: there is no grid to draw",
                           fix=f"compare the configs with --kind rank --x {varying[0]} (or peftlab report)")
    notes: list[str] = []
    if folded:
        panels = _folded_panels(grid, trained, tasks, const_key=x if x_const else y, col_key=y if x_const else x)
        n_rows, n_cols = 1, len(tasks)
    else:
        panels = _config_panels(grid, tasks, x, y)
        line = _degenerate(panels, x, y, varying)
        if line is not None:
            return line
        panels, notes = _grids_only(panels, x, y, configs, list(groups), varying)
        rows = sorted({p.row for p in panels})
        tasks = [t for t in tasks if any(p.task == t for p in panels)]
        for p in panels:  # no empty row or column of panels where flat ones were left out
            p.row, p.col = rows.index(p.row), tasks.index(p.task)
        n_rows, n_cols = len(rows), len(tasks)
    diagonal = not folded and x in ("lr", "qk_lr") and y == "v_lr"
    return HeatmapData(panels, n_rows, n_cols, metrics, lower, _colour_limits(panels, tasks), folded,
                       grid.seed_axis, diagonal, notes)


def _folded_panels(grid: _Grid, trained: list[RunRecord], tasks: list[str], *, const_key: str, col_key: str
                   ) -> list[HeatPanel]:
    """One panel per task: rows are the configs, columns the axis key that varies (``const_key`` does not)."""
    group_of = {id(rec): g for g, recs in grid.groups.items() for rec in recs}
    varying = grid.varying
    panels = []
    for j, task in enumerate(tasks):
        recs = _of_task(trained, task)
        rows = [g for g in grid.groups if any(group_of[id(r)] == g for r in recs)]
        labels = [config_label(grid.configs[g], varying) if len(varying) != 1 else
                  fmt_tick(grid.configs[g].get(varying[0])) for g in rows]
        row_axis = GridAxis("config", varying[0] if len(varying) == 1 else "", tuple(rows), tuple(labels), False)
        const = ", ".join(_axis(const_key, recs).labels)
        panels.append(grid.panel(0, j, task, f"{const_key}={const} in all runs", recs, _axis(col_key, recs),
                                 row_axis, lambda r: key_value(r.config, col_key), lambda r: group_of[id(r)]))
    return panels


def _config_panels(grid: _Grid, tasks: list[str], x: str, y: str) -> list[HeatPanel]:
    """One x-by-y panel per (config, task) that has runs: a row of panels per config."""
    panels = []
    for i, (gkey, group) in enumerate(grid.groups.items()):
        sub = config_label(grid.configs[gkey], grid.varying) if grid.varying else ""
        for j, task in enumerate(tasks):
            if recs := _of_task(group, task):
                panels.append(grid.panel(i, j, task, sub, recs, _axis(x, recs), _axis(y, recs),
                                         lambda r: key_value(r.config, x), lambda r: key_value(r.config, y)))
    return panels


def _colour_limits(panels: list[HeatPanel], tasks: list[str]) -> dict[str, tuple[float, float]]:
    """One colour scale per task: the range of its panels' finite means (a single value widened by 0.5)."""
    import numpy as np

    limits = {}
    for task in tasks:
        finite = np.concatenate([p.mean[np.isfinite(p.mean)] for p in panels if p.task == task] or [[]])
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        limits[task] = (lo, hi) if hi > lo else (lo - 0.5, hi + 0.5)
    return limits


def _flat(panel: HeatPanel) -> bool:
    return len(panel.x.values) < 2 or len(panel.y.values) < 2


def _degenerate(panels: list[HeatPanel], x: str, y: str, varying: list[str]) -> LineInstead | None:
    """None when some panel is a real grid (2+ values on both axes); a LineInstead when every panel has one
    value on the same axis; refuses when every panel is one cell."""
    if not all(_flat(p) for p in panels):
        return None
    single_x = all(len(p.x.values) < 2 for p in panels)
    single_y = all(len(p.y.values) < 2 for p in panels)
    if single_x and single_y:
        key = varying[0] if varying else "<a key that varies>"
        raise PeftlabError(f"every panel would be a single cell (one {x}, one {y} per config and task)",
                           fix=f"compare the configs with --kind rank --x {key} (or peftlab report)")
    if not (single_x or single_y):
        raise PeftlabError(f"every panel has a single {x} or a single {y}, not the same one: no grid to draw",
                           fix=f"select runs with --where, or draw lines with --kind rank --x {x} (or {y})")
    vary, const = (y, x) if single_x else (x, y)
    values = sorted({v for p in panels for v in (p.x if const == x else p.y).values}, key=num_key)
    shown = ", ".join(fmt_tick(v, const) for v in values)
    return LineInstead(vary, f"one {const} per panel ({shown}): drawn as lines over {vary}, "
                             f"not as a one-{'column' if const == x else 'row'} heatmap")


def _grids_only(panels: list[HeatPanel], x: str, y: str, configs: dict, order: list, varying: list[str]
                ) -> tuple[list[HeatPanel], list[str]]:
    """The panels that are grids, and a note naming those left out (a single x or y: not a heatmap)."""
    flat = [p for p in panels if _flat(p)]
    if not flat:
        return panels, []
    by_task = bool({p.row for p in flat} & {p.row for p in panels if not _flat(p)}) or not varying
    keys = varying + ["task"] if by_task else varying
    where = [{**configs[order[p.row]], "task": p.task} for p in flat]
    shown = "; ".join(dict.fromkeys(",".join(f"{k}={fmt_value(config.get(k))}" for k in keys) for config in where))
    return [p for p in panels if not _flat(p)], [
        f"left out, one {x} or {y} (no grid): {shown}; draw them with --kind rank --x {y}"]
