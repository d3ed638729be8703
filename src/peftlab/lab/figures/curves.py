"""``peftlab plot --kind curves``: learning curves, one panel per task, one line per config.

Points are result.json's ``curve`` (every ``--eval-steps`` and epoch-end evaluation; a run without one
contributes its ``epochs_log``, and its line says so). A run trained with a selection split evaluated only that
split during training (its test split is read once, after): its curve is the selection split's, and the title says
so. Each line is the median over the seeds that ended ok with a quantile band, never mean ± std, and never
outside the metric's valid range; runs that failed to learn are thin dotted lines of their own, not in the band.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from peftlab.errors import PeftlabError
from peftlab.lab.figures.paper import (
    Drawn, config_lines, fixed_keys, legend_below, line_style, metric_label, metric_range, panel_grid, panel_title,
    suptitle, task_metrics)
from peftlab.lab.records import RunRecord
from peftlab.tasks.table import SELECTION_PREFIX, task_title

BANDS = {"quartiles": (0.25, 0.75), "range": (0.0, 1.0)}
BAND_TEXT = {"quartiles": "25-75\u00a0% quantiles", "range": "min-max range"}
CURVE_X = ("epoch", "step")
X_TITLES = {"epoch": "epoch", "step": "optimizer step"}
FRACTIONAL = "epoch (fractional)"
# runs drawn on their own: thin and dotted (config lines are solid, dashed or dash-dotted), a marker per status
THIN_MARKERS = {"collapsed": "x", "no_learning": ".", "diverged": "+"}
EPOCH_ENDS = "epoch ends only"


@dataclass
class CurveBand:
    """One config's line on one task: the median and band over its ok runs at each x."""

    task: str
    series: str  # "metric" or "train_loss"
    label: str
    x: list[float]
    median: list[float]
    low: list[float]
    high: list[float]
    n: list[int]  # runs at each x
    epoch_ends_only: int  # of its runs, how many had no step-level curve
    runs: int


@dataclass
class CurveRun:
    """A run drawn on its own (it did not end ok): its points as they are."""

    task: str
    series: str
    label: str
    seed: int
    status: str
    x: list[float]
    y: list[float]


@dataclass
class CurvesData:
    x: str
    band: str
    bands: list[CurveBand]
    thin: list[CurveRun]
    tasks: list[str]
    metrics: dict[str, list[str]]
    ranges: dict[str, tuple[float, float] | None]  # task -> the metric's valid range (scaled)
    series: tuple[str, ...]
    notes: list[str]
    split: str = "dev"  # what training's evaluations read: "dev", or "selection-split" (the test split read after)


def run_points(rec: RunRecord, *, x: str, series: str, scale: float) -> tuple[list[tuple[float, float]], bool]:
    """(x, value) pairs of one run and whether they come from the step-level curve (else epoch ends)."""
    result = rec.result or {}
    curve = result.get("curve") if series == "metric" else None
    metric = (rec.metric if not result.get("selection") else SELECTION_PREFIX + rec.metric)
    if curve:
        entries = [(e.get(x), (e.get("metrics") or {}).get(metric)) for e in curve]
        from_curve = True
    else:
        if x == "step":
            raise PeftlabError(f"run {rec.key[:12]} ({rec.task}, seed {rec.seed}) has no step-level curve "
                               "(result.json 'curve')",
                               fix="use --curve-x epoch (epoch-end evaluations), or re-run with --eval-steps N")
        name = "train_loss" if series == "train_loss" else None
        entries = [(e.get("epoch"), e.get(name) if name else (e.get("metrics") or {}).get(metric))
                   for e in result.get("epochs_log") or []]
        from_curve = False
    factor = scale if series == "metric" else 1.0
    points = [(float(px), float(v) * factor) for px, v in entries
              if px is not None and v is not None and math.isfinite(float(v))]
    return sorted(points), from_curve


def curves_data(records: list[RunRecord], *, x: str = "epoch", band: str = "quartiles", scale: float = 100.0,
                loss: bool = False) -> CurvesData:
    if loss and x == "step":
        raise PeftlabError("--loss draws the train loss logged at each epoch's end: it has no step axis",
                           fix="use --curve-x epoch with --loss")
    runs = [r for r in records if r.result and (r.result.get("curve") or r.result.get("epochs_log"))]
    if not runs:
        raise PeftlabError("no run in the selection has a learning curve (result.json curve or epochs_log)",
                           fix="select trained runs (epochs > 0) with --where")
    metrics = task_metrics(runs)
    ranges = {}
    for t, names in metrics.items():
        found = {metric_range(m, t) for m in names}
        valid = found.pop() if len(found) == 1 else None
        ranges[t] = None if valid is None else (valid[0] * scale, valid[1] * scale)
    series = ("metric", "train_loss") if loss else ("metric",)
    bands, thin, skipped = [], [], []
    for task, label, recs in config_lines(runs, fixed_keys(runs)):
        for what in series:
            curve, thin_runs, skipped_runs = _series_lines(
                recs, task=task, what=what, label=label, x=x, scale=scale, band=band,
                limits=ranges[task] if what == "metric" else None)
            bands += [curve] if curve is not None else []
            thin += thin_runs
            skipped += skipped_runs
    if not bands and not thin:
        names = ", ".join(sorted(set().union(*metrics.values())))
        raise PeftlabError(f"no run in the selection has a point of its metric ({names}) in its curve or epochs_log",
                           fix="select other runs with --where, or plot --metric M")
    notes = ([f"left out {len(skipped)} run(s) that did not end ok and have no step-level curve: "
              + "; ".join(skipped)] if skipped else [])
    split = "selection-split" if any((r.result or {}).get("selection") for r in runs) else "dev"
    return CurvesData(x, band, bands, thin, list(metrics), metrics, ranges, series, notes, split)


def _series_lines(recs: list[RunRecord], *, task: str, what: str, label: str, x: str, scale: float, band: str,
                  limits: tuple[float, float] | None) -> tuple[CurveBand | None, list[CurveRun], list[str]]:
    """One config's ``what`` series on one task: the band of its runs that ended ok (None without a point), a
    thin line per run that did not, and the notes on those left out (no step-level curve for --curve-x step)."""
    import numpy as np

    by_x: dict[float, list[float]] = defaultdict(list)
    ok = from_steps = 0
    thin, skipped = [], []
    for rec in recs:
        if rec.status != "ok" and x == "step" and not (rec.result or {}).get("curve"):
            skipped.append(f"{task} {label} seed {rec.seed} ({rec.status})")
            continue
        points, from_curve = run_points(rec, x=x, series=what, scale=scale)
        if rec.status == "ok":
            ok, from_steps = ok + 1, from_steps + from_curve
            for px, v in points:
                by_x[round(px, 9)].append(v)
        elif points:
            thin.append(CurveRun(task, what, label, rec.seed, rec.status, *map(list, zip(*points))))
    if not by_x:
        return None, thin, skipped
    xs = sorted(by_x)
    lo, hi = limits or (-np.inf, np.inf)
    median, low, high = np.clip([np.quantile(by_x[v], (0.5, *BANDS[band])) for v in xs], lo, hi).T.tolist()
    counts = [len(by_x[v]) for v in xs]
    return CurveBand(task, what, label, xs, median, low, high, counts, ok - from_steps, ok), thin, skipped


def plot_curves(records: list[RunRecord], *, x: str = "epoch", band: str = "quartiles", scale: float = 100.0,
                loss: bool = False, title: str | None = None) -> Drawn:
    from matplotlib.ticker import MaxNLocator

    data = curves_data(records, x=x, band=band, scale=scale, loss=loss)
    labels = list(dict.fromkeys([b.label for b in data.bands] + [t.label for t in data.thin]))
    width = 3.2
    plt, fig, axes = panel_grid(len(data.series), len(data.tasks), width=width, height=2.5)
    for j, task in enumerate(data.tasks):
        for i, what in enumerate(data.series):
            ax = axes[i][j]
            for b in (b for b in data.bands if b.task == task and b.series == what):
                look = line_style(labels.index(b.label))
                marker = look["marker"] if len(b.x) <= 12 else None
                ax.fill_between(b.x, b.low, b.high, color=look["color"], alpha=0.22, lw=0)
                ax.plot(b.x, b.median, color=look["color"], ls=look["linestyle"], marker=marker, ms=3, lw=1.4)
            for t in (t for t in data.thin if t.task == task and t.series == what):
                look = line_style(labels.index(t.label))
                ax.plot(t.x, t.y, color=look["color"], ls=":", lw=0.8, alpha=0.9,
                        marker=THIN_MARKERS.get(t.status, "v") if len(t.x) <= 12 else None, ms=3.5)
            if what == "metric":
                if i == 0:
                    panel_title(ax, task_title(task), width)
                ax.set_ylabel(metric_label(data.metrics[task], scale))
            else:
                ax.set_ylabel("train loss (epoch end)")
            if i == len(data.series) - 1:
                ax.set_xlabel(FRACTIONAL if _fractional(data, task, what) else X_TITLES[data.x])
            xs = sorted({v for b in data.bands if b.task == task for v in b.x} |
                        {v for t in data.thin if t.task == task for v in t.x})
            if data.x == "epoch":
                whole = list(range(math.ceil(xs[0]), math.floor(xs[-1]) + 1)) if xs else []
                if 0 < len(whole) <= 12:
                    ax.set_xticks(whole)
                else:
                    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                if len(xs) == 1:
                    ax.set_xlim(xs[0] - 0.5, xs[0] + 0.5)
            ax.grid(alpha=0.3, lw=0.5)
    legend_below(fig, *_legend(data, labels))
    source = f"{data.split} evaluations during training" if any(b.epoch_ends_only < b.runs for b in data.bands) \
        else f"epoch-end {data.split} evaluations (no step-level curve recorded)"
    suptitle(fig, title or f"learning curves: {source}; line: median over the seeds that ended ok, band: their "
                           f"{BAND_TEXT[data.band]} (within the metric's range)")
    return Drawn(fig, data, list(data.notes))


def _legend(data: CurvesData, labels: list[str]) -> tuple[list, list[str]]:
    """A line per config (its seeds per task, and how many runs have epoch-end points only), then a thin line per
    status of the runs that did not end ok."""
    from matplotlib.lines import Line2D

    handles, names = [], []
    for label in labels:
        look = line_style(labels.index(label))
        bands = [b for b in data.bands if b.label == label and b.series == "metric"]
        counts = sorted({b.runs for b in bands})  # per task: the legend is shared, the tasks may differ
        runs = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        ends = sum(b.epoch_ends_only for b in bands)
        total = sum(b.runs for b in bands)
        suffix = f" (n={runs}" + (f"; {EPOCH_ENDS}" if ends and ends == total else
                                  f"; {ends} of {total} runs {EPOCH_ENDS}" if ends else "") + ")"
        handles.append(Line2D([], [], color=look["color"], ls=look["linestyle"], marker=look["marker"], ms=3))
        names.append(label + suffix)
    for status in sorted({t.status for t in data.thin}):
        count = sum(1 for t in data.thin if t.status == status and t.series == "metric")
        handles.append(Line2D([], [], color="#555555", ls=":", lw=0.8, marker=THIN_MARKERS.get(status, "v"), ms=3.5))
        names.append(f"{count} run(s) {status}: thin, not in the band")
    return handles, names


def _fractional(data: CurvesData, task: str, series: str) -> bool:
    return data.x == "epoch" and any(not float(v).is_integer() for b in data.bands
                                     if b.task == task and b.series == series for v in b.x)
