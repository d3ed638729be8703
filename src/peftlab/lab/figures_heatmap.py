"""``peftlab plot --kind heatmap``: a metric over two config keys, mean over seeds, one panel per task.

``--x lr --y lr_ratio`` by default; ``--y v_lr`` is lr * lr_ratio, i.e. eta_QK x eta_V as in Yao et al. Figure 1.
One panel per task (and per combination of any other key that varies), one colour scale per task; red box:
the best cell (the lowest for metrics in ``peftlab.tasks.table.LOWER_IS_BETTER``). Cells with
diverged/collapsed/failed runs are marked (``[status]``); a cell with only such runs is grey and names them.
When --x or --y takes one value in every task, the panels fold into one per task with the configs as rows.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.lab.figures import (
    AXIS_TITLES,
    CHAR_EM,
    colorbar,
    config_label,
    fmt_tick,
    key_value,
    metric_label,
    num_key,
    panel_grid,
    panel_title,
    split_by_config,
    status_summary,
    suptitle,
    task_title,
    underlying,
    wrap,
)
from peftlab.lab.records import NON_RESULT_KEYS, RunRecord, task_determined_keys, task_order
from peftlab.lab.store import NOT_OK


@dataclass
class _HeatPanel:
    row: int
    col: int
    task: str
    values: Any  # (len(ys), len(xs)) means; NaN: no run that ended ok
    cells: dict[tuple[int, int], list[float]]
    bad: dict[tuple[int, int], dict[str, int]]
    xticks: list[str]
    yticks: list[str]
    xlabel: str
    ylabel: str
    title: str


def _heat_cells(recs: list[RunRecord], row_of, col_of, rows: list, cols: list, scale: float):
    import numpy as np

    values = np.full((len(rows), len(cols)), np.nan)
    bad: dict[tuple[int, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    cells: dict[tuple[int, int], list[float]] = defaultdict(list)
    for rec in recs:
        cell = (rows.index(row_of(rec)), cols.index(col_of(rec)))
        if rec.status in NOT_OK or rec.value is None:
            bad[cell][rec.status if rec.status in NOT_OK else "missing"] += 1
        else:
            cells[cell].append(rec.value * scale)
    for (yi, xi), vals in cells.items():
        values[yi, xi] = statistics.fmean(vals)
    return values, cells, bad


def _row_labels(configs: dict[tuple, dict], rows: list[tuple], varying: list[str]) -> tuple[list[str], str]:
    """Tick labels for rows that are configs, and the axis label: ``kasa`` + ``method``, or ``k=v ...`` + ''."""
    if len(varying) == 1:
        return [fmt_tick(configs[g].get(varying[0])) for g in rows], varying[0]
    return [config_label(configs[g], varying) for g in rows], ""


def plot_heatmap(records: list[RunRecord], *, x: str = "lr", y: str = "lr_ratio", scale: float = 100.0,
                 digits: int = 1, title: str | None = None):
    """The heatmap figure. All panels of a task share one colour scale (one colour bar per task).

    When ``x`` or ``y`` takes a single value in every task while other keys vary (e.g. the default lr x
    lr_ratio on a sweep over methods only), a grid of 1-cell panels would say nothing: the figure folds into
    one panel per task whose rows are the configs and whose columns are the axis that does vary.
    """
    import numpy as np

    from peftlab.tasks.table import LOWER_IS_BETTER

    trained = [r for r in records if not r.before]
    if not trained:
        raise PeftlabError("no trained runs to plot (only epochs-0 runs)")
    per_task = task_determined_keys(trained)
    drop = set(NON_RESULT_KEYS) | set(per_task) | underlying(x) | underlying(y)
    groups, configs, varying = split_by_config(trained, drop)
    order = sorted(configs, key=lambda g: config_label(configs[g], varying))
    group_of = {id(rec): g for g, recs in groups.items() for rec in recs}
    tasks = task_order(r.task for r in trained)
    metrics = {t: sorted({r.metric for r in trained if r.task == t and r.metric}) for t in tasks}
    lower = {t: bool(m) and all(name in LOWER_IS_BETTER for name in m) for t, m in metrics.items()}

    def values_of(key: str, task: str) -> list:
        return sorted({key_value(r.config, key) for r in trained if r.task == task}, key=num_key)

    x_const = all(len(values_of(x, t)) == 1 for t in tasks)
    y_const = all(len(values_of(y, t)) == 1 for t in tasks)
    fold = len(order) > 1 and (x_const or y_const)
    panels: list[_HeatPanel] = []
    if fold:
        col_key, const_key = (y, x) if x_const and not y_const else (x, y)
        n_rows, n_cols = 1, len(tasks)
        for j, task in enumerate(tasks):
            recs = [r for r in trained if r.task == task]
            rows = [g for g in order if any(group_of[id(r)] == g for r in recs)]
            cols = values_of(col_key, task)
            values, cells, bad = _heat_cells(recs, lambda r: group_of[id(r)], lambda r: key_value(r.config, col_key),
                                             rows, cols, scale)
            yticks, ylabel = _row_labels(configs, rows, varying)
            const = ", ".join(fmt_tick(v) for v in values_of(const_key, task))
            panels.append(_HeatPanel(0, j, task, values, cells, bad, [fmt_tick(v) for v in cols], yticks,
                                     AXIS_TITLES.get(col_key, col_key), ylabel,
                                     f"{task_title(task)}\n{const_key}={const} in all runs"))
        n_cells_x = max(len(p.xticks) for p in panels)
        n_cells_y = max(len(p.yticks) for p in panels)
        longest = max(len(t) for p in panels for t in p.yticks)
        width = max(3.6, 1.9 + 0.8 * n_cells_x + longest * CHAR_EM * 8 / 72)
        height = max(2.6, 1.9 + 0.4 * n_cells_y)
    else:
        n_rows, n_cols = len(order), len(tasks)
        for i, gkey in enumerate(order):
            sub = config_label(configs[gkey], varying) if varying else ""
            for j, task in enumerate(tasks):
                recs = [r for r in groups[gkey] if r.task == task]
                if not recs:
                    continue
                xs = sorted({key_value(r.config, x) for r in recs}, key=num_key)
                ys = sorted({key_value(r.config, y) for r in recs}, key=num_key)
                values, cells, bad = _heat_cells(recs, lambda r: key_value(r.config, y),
                                                 lambda r: key_value(r.config, x), ys, xs, scale)
                panels.append(_HeatPanel(i, j, task, values, cells, bad, [fmt_tick(v) for v in xs],
                                         [fmt_tick(v) for v in ys], AXIS_TITLES.get(x, x), AXIS_TITLES.get(y, y),
                                         task_title(task) + (f"\n{sub}" if sub else "")))
        n_cells_x = max(len(p.xticks) for p in panels)
        n_cells_y = max(len(p.yticks) for p in panels)
        width = max(3.8, 2.0 + 0.8 * n_cells_x)
        height = max(3.0, 1.9 + 0.55 * n_cells_y)
    plt, fig, axes = panel_grid(n_rows, n_cols, width=width, height=height)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d9d9d9")
    limits: dict[str, tuple[float | None, float | None]] = {}
    for task in tasks:
        finite = np.concatenate([p.values[np.isfinite(p.values)] for p in panels if p.task == task] or [[]])
        limits[task] = (float(finite.min()), float(finite.max())) if finite.size else (None, None)
    drawn: dict[str, list] = defaultdict(list)
    used = set()
    for p in panels:
        ax = axes[p.row][p.col]
        used.add((p.row, p.col))
        lo, hi = limits[p.task]
        image = ax.imshow(np.ma.masked_invalid(p.values), origin="upper" if fold else "lower", cmap=cmap,
                          aspect="auto", vmin=lo, vmax=hi)
        drawn[p.task].append((ax, image))
        finite = np.isfinite(p.values)
        best = None
        if finite.any():
            pick = np.nanargmin if lower[p.task] else np.nanargmax
            best = tuple(int(v) for v in np.unravel_index(pick(p.values), p.values.shape))
        for yi in range(p.values.shape[0]):
            for xi in range(p.values.shape[1]):
                lines = []
                if finite[yi, xi]:
                    lines.append(f"{p.values[yi, xi]:.{digits}f}")
                if p.bad.get((yi, xi)):
                    summary = status_summary(p.bad[(yi, xi)])
                    lines.append(f"[{summary}]" if p.cells.get((yi, xi)) else summary)
                    if not p.cells.get((yi, xi)):  # only runs that did not end ok: hatched
                        ax.add_patch(plt.Rectangle((xi - 0.5, yi - 0.5), 1, 1, fill=False, hatch="//",
                                                   edgecolor="#8c2d04", lw=0))
                if not lines:
                    continue
                light = bool(finite[yi, xi]) and p.values[yi, xi] < lo + 0.5 * ((hi - lo) or 1)
                ax.text(xi, yi, "\n".join(lines), ha="center", va="center", fontsize=7,
                        color="white" if light else "black",
                        fontweight="bold" if (yi, xi) == best else "normal",
                        bbox=None if finite[yi, xi] else dict(facecolor="white", alpha=0.8, lw=0, pad=1.5))
        if best is not None:
            ax.add_patch(plt.Rectangle((best[1] - 0.5, best[0] - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.5))
        ax.set_xticks(range(len(p.xticks)), p.xticks, fontsize=8,
                      **(dict(rotation=45, ha="right", rotation_mode="anchor") if len(p.xticks) > 3 else {}))
        ax.set_yticks(range(len(p.yticks)), p.yticks, fontsize=8)
        ax.set_xlabel(p.xlabel)
        ax.set_ylabel(p.ylabel)
        panel_title(ax, p.title, width)
    for i in range(n_rows):
        for j in range(n_cols):
            if (i, j) not in used:
                axes[i][j].set_axis_off()
    for task, pairs in drawn.items():
        label = metric_label(metrics[task], scale) + (" (lower is better)" if lower[task] else "")
        bar = colorbar(fig, pairs[0][1], [ax for ax, _ in pairs], width, height)
        bar.set_label(wrap(label, 0.8 * height * len(pairs), 8), fontsize=8)
    seed_axis = "seed" in (x, y)
    lowest = sorted({m for t in tasks if lower[t] for m in metrics[t]})
    best_text = "red box: best" + ((" (lowest)" if all(lower.values()) else f" (lowest for {', '.join(lowest)})")
                                   if lowest else "")
    what = "one run per cell (seed is an axis)" if seed_axis else "mean over seeds"
    bad_text = "[..]: runs that did not end ok" + ("" if seed_axis else " (not in the mean)")
    names = "/".join(sorted({m for ms in metrics.values() for m in ms}))
    suptitle(fig, title or f"{names}, {what}; {best_text}; {bad_text}")
    return fig

