"""``peftlab plot --kind rank`` (and what a one-row / one-column heatmap is drawn as): the metric against one
config key, one line per other varying config, one panel per task.

The line joins the means over the runs that ended ok (the number a report's cell shows); every such run is a
dot beside it, so the spread and any bimodality stay visible; a run that did not end ok is a cross at its
value (never in the mean). Learning rates and lambda lie on log axes, ticks at the values present.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from peftlab.lab.figures.paper import (
    AXIS_TITLES, Drawn, config_lines, fixed_keys, fmt_tick, is_number, key_value, legend_of, line_style, log_axis,
    metric_label, num_key, panel_grid, panel_title, set_ticks, suptitle, task_metrics, trained_runs, underlying)
from peftlab.lab.records import RunRecord
from peftlab.tasks.table import task_title


@dataclass
class PointsLine:
    task: str
    label: str
    xs: list  # the key's values this config ran, sorted
    means: list[float | None]  # mean over the ok runs at each x (None: none ended ok)
    ok: dict = field(default_factory=dict)  # x -> [(seed, value)] of the ok runs
    failed: dict = field(default_factory=dict)  # x -> [(seed, status, value or None)]


@dataclass
class PointsData:
    x: str
    xs: list  # every value of the key, sorted
    log: bool
    lines: list[PointsLine]
    tasks: list[str]
    tied: list[str] = field(default_factory=list)  # keys equal to x in every run (a head rate tied to lr)


def tied_to(records: list[RunRecord], x: str) -> list[str]:
    """The keys equal to x in every run (a study's head rate tied to lr): no line of their own; the axis names them."""
    keys = sorted({k for r in records for k in r.config} - underlying(x))
    return [k for k in keys if all(r.config.get(k) == key_value(r.config, x) for r in records)]


def points_data(records: list[RunRecord], *, x: str, scale: float) -> PointsData:
    trained = trained_runs(records)
    tied = tied_to(trained, x)
    all_x = sorted({key_value(r.config, x) for r in trained}, key=num_key)
    lines = []
    for task, label, recs in config_lines(trained, fixed_keys(trained, x, *tied)):
        ok: dict = defaultdict(list)
        failed: dict = defaultdict(list)
        for rec in recs:
            xv = key_value(rec.config, x)
            if rec.status == "ok" and rec.value is not None:
                ok[xv].append((rec.seed, rec.value * scale))
            else:
                failed[xv].append((rec.seed, rec.status, None if rec.value is None else rec.value * scale))
        xs = sorted(set(ok) | set(failed), key=num_key)
        means = [statistics.fmean(v for _, v in ok[v_]) if ok.get(v_) else None for v_ in xs]
        lines.append(PointsLine(task, label, xs, means, dict(ok), dict(failed)))
    return PointsData(x, all_x, log_axis(x, all_x), lines, list(task_metrics(trained)), tied)


def plot_points(records: list[RunRecord], *, x: str = "rank", scale: float = 100.0, title: str | None = None,
                note: str | None = None) -> Drawn:
    data = points_data(records, x=x, scale=scale)
    metrics = task_metrics(records)
    labels = list(dict.fromkeys(line.label for line in data.lines))
    numeric = all(is_number(v) for v in data.xs)
    width = max(2.8 if len(data.tasks) > 1 else 4.2, min(4.2, 1.4 + 0.45 * len(data.xs)))
    plt, fig, axes = panel_grid(1, len(data.tasks), width=width, height=2.6)

    def position(value, index: int):
        """Where a line's points sit: beside the value, each line a little apart, so dots do not hide dots."""
        shift = (index - (len(labels) - 1) / 2) * min(0.08, 0.3 / max(len(labels), 1))
        if data.log:
            return float(value) * (1 + 0.6 * shift)
        if numeric:
            spread = (float(data.xs[-1]) - float(data.xs[0])) or 1.0
            return float(value) + shift * spread / max(len(data.xs), 2)
        return data.xs.index(value) + shift

    any_failed = False
    for j, task in enumerate(data.tasks):
        ax = axes[0][j]
        for line in (ln for ln in data.lines if ln.task == task):
            index = labels.index(line.label)
            look = line_style(index)
            drawn = [(position(v, index), m) for v, m in zip(line.xs, line.means) if m is not None]
            if drawn:
                ax.plot(*zip(*drawn), color=look["color"], ls=look["linestyle"], marker=look["marker"], ms=4,
                        lw=1.3, label=line.label if labels != ["runs"] else None, zorder=3)  # one line: no legend
            for v, runs in line.ok.items():
                ax.scatter([position(v, index)] * len(runs), [value for _, value in runs], s=7, color=look["color"],
                           alpha=0.45, lw=0, zorder=2)
            for v, runs in line.failed.items():
                shown = [value for _, _, value in runs if value is not None]
                if shown:
                    any_failed = True
                    ax.scatter([position(v, index)] * len(shown), shown, marker="x", s=18, color=look["color"],
                               lw=1.0, zorder=4)
        set_ticks(ax, "x", data.xs if numeric else range(len(data.xs)), [fmt_tick(v, x) for v in data.xs],
                  log=data.log)
        if len(data.xs) > 4 and max(len(fmt_tick(v, x)) for v in data.xs) > 4:
            plt.setp(ax.get_xticklabels(), rotation=35, ha="right", rotation_mode="anchor")
        ax.set_xlabel(" = ".join([AXIS_TITLES.get(x, x), *data.tied]))
        ax.set_ylabel(metric_label(metrics[task], scale))
        panel_title(ax, task_title(task), width)
        ax.grid(alpha=0.3, lw=0.5)
    if any_failed:
        axes[0][0].scatter([], [], marker="x", color="black", s=18, lw=1.0, label="run not ok (not in the mean)")
    legend_of(fig, axes[0])
    what = f"line: mean of the runs that ended ok; dots: each run{'; ×: runs not ok' if any_failed else ''}"
    suptitle(fig, title or "; ".join(filter(None, [note, what])))
    return Drawn(fig, data)
