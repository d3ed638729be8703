"""``peftlab plot --kind curves`` and ``--kind rank``: lines of mean ± std over seeds.

* ``curves``: the metric per epoch and the train loss of the selected runs (``--where``), per config; runs that
  did not end ok are drawn on their own, dashed.
* ``rank``: the metric against ``--x`` (default rank), one line per other varying config.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.lab.figures import (
    AXIS_TITLES,
    DERIVED,
    config_label,
    fmt_tick,
    key_value,
    legend_of,
    line_colors,
    line_groups,
    metric_label,
    num_key,
    panel_grid,
    panel_title,
    suptitle,
    task_title,
    underlying,
)
from peftlab.lab.records import NON_RESULT_KEYS, RunRecord, task_determined_keys, task_order
from peftlab.lab.store import NOT_OK


# --------------------------------------------------------------------------- (c) learning curves


def plot_curves(records: list[RunRecord], *, scale: float = 100.0, title: str | None = None):
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    runs = [r for r in records if r.result and r.result.get("epochs_log")]
    if not runs:
        raise PeftlabError("no run in the selection has a training log (epochs_log)",
                           fix="select trained runs (epochs > 0) with --where")
    per_task = task_determined_keys(runs)
    drop = set(NON_RESULT_KEYS) | set(per_task)
    groups, configs, varying = line_groups(runs, drop)
    tasks = task_order(r.task for r in runs)
    plt, fig, axes = panel_grid(2, len(tasks), width=4.8, height=3.4)
    colors = line_colors(plt, len(groups))
    for j, task in enumerate(tasks):
        top, bottom = axes[0][j], axes[1][j]
        for c, gkey in enumerate(groups):
            recs = [r for r in groups[gkey] if r.task == task]
            if not recs:
                continue
            color = colors(c % colors.N)
            label = config_label(configs[gkey], varying) if varying else "runs"
            good = [r for r in recs if r.status == "ok"]
            for ax, series in ((top, lambda e, r: e["metrics"].get(r.metric)),
                               (bottom, lambda e, r: e.get("train_loss"))):
                factor = scale if ax is top else 1.0
                if good:
                    by_epoch: dict[int, list[float]] = defaultdict(list)
                    for rec in good:
                        for entry in rec.result["epochs_log"]:
                            value = series(entry, rec)
                            if value is not None and math.isfinite(value):
                                by_epoch[int(entry["epoch"])].append(value * factor)
                    epochs = sorted(by_epoch)
                    mean = np.array([statistics.fmean(by_epoch[e]) for e in epochs])
                    std = np.array([statistics.stdev(by_epoch[e]) if len(by_epoch[e]) > 1 else 0.0 for e in epochs])
                    ax.plot(epochs, mean, marker="o", ms=3, color=color,
                            label=f"{label} (n={len(good)})" if ax is top else None)
                    ax.fill_between(epochs, mean - std, mean + std, color=color, alpha=0.2, lw=0)
                for rec in recs:
                    if rec.status == "ok":
                        continue
                    points = [(e["epoch"], series(e, rec)) for e in rec.result["epochs_log"]]
                    points = [(e, v * factor) for e, v in points if v is not None and math.isfinite(v)]
                    if points:
                        ax.plot(*zip(*points), ls="--", lw=1, color=color, marker="x", ms=4,
                                label=f"{label} seed {rec.seed}: {rec.status}" if ax is top else None)
        metric = sorted({r.metric for r in runs if r.task == task and r.metric})
        panel_title(top, task_title(task), 4.8, fontsize=10)
        top.set_ylabel(metric_label(metric, scale))
        bottom.set_ylabel("train loss")
        bottom.set_xlabel("epoch")
        epochs = sorted({int(e["epoch"]) for r in runs if r.task == task for e in r.result["epochs_log"]})
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            if len(epochs) <= 12:  # an epoch is a whole number: one tick per epoch
                ax.set_xticks(epochs)
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if len(epochs) == 1:
                ax.set_xlim(epochs[0] - 0.5, epochs[0] + 0.5)
    legend_of(fig, axes[0])
    suptitle(fig, title or "learning curves: mean ± std over seeds (dashed: runs that did not end ok)")
    return fig


# --------------------------------------------------------------------------- (d) metric vs rank


def plot_rank(records: list[RunRecord], *, x: str = "rank", scale: float = 100.0, title: str | None = None):
    trained = [r for r in records if not r.before]
    if not trained:
        raise PeftlabError("no trained runs to plot (only epochs-0 runs)")
    per_task = task_determined_keys(trained)
    drop = set(NON_RESULT_KEYS) | set(per_task) | underlying(x)
    groups, configs, varying = line_groups(trained, drop)
    tasks = task_order(r.task for r in trained)
    plt, fig, axes = panel_grid(1, len(tasks), width=4.8, height=3.8)
    colors = line_colors(plt, len(groups))
    all_x = sorted({key_value(r.config, x) for r in trained}, key=num_key)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in all_x)
    for j, task in enumerate(tasks):
        ax = axes[0][j]
        for c, gkey in enumerate(groups):
            recs = [r for r in groups[gkey] if r.task == task]
            if not recs:
                continue
            by_x: dict[Any, list[float]] = defaultdict(list)
            bad: dict[Any, int] = defaultdict(int)
            for rec in recs:
                xv = key_value(rec.config, x)
                if rec.status in NOT_OK or rec.value is None:
                    bad[xv] += 1
                else:
                    by_x[xv].append(rec.value * scale)
            xs = sorted(by_x, key=num_key)
            pos = xs if numeric else [all_x.index(v) for v in xs]
            means = [statistics.fmean(by_x[v]) for v in xs]
            stds = [statistics.stdev(by_x[v]) if len(by_x[v]) > 1 else 0.0 for v in xs]
            color = colors(c % colors.N)
            ax.errorbar(pos, means, yerr=stds, marker="o", ms=4, capsize=3, color=color,
                        label=config_label(configs[gkey], varying) if varying else None)
            for v, n in bad.items():
                if v in by_x:
                    ax.annotate(f"×{n}", (v if numeric else all_x.index(v), statistics.fmean(by_x[v])),
                                textcoords="offset points", xytext=(4, -10), fontsize=7, color=color)
        if numeric:
            positive = all(float(v) > 0 for v in all_x)
            if positive and len(all_x) > 2 and max(all_x) / min(all_x) >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(all_x, [fmt_tick(v) for v in all_x])
            ax.minorticks_off()
        else:
            ax.set_xticks(range(len(all_x)), [fmt_tick(v) for v in all_x])
        ax.set_xlabel(AXIS_TITLES.get(x, x))
        metric = sorted({r.metric for r in trained if r.task == task and r.metric})
        ax.set_ylabel(metric_label(metric, scale))
        panel_title(ax, task_title(task), 4.8, fontsize=10)
        ax.grid(alpha=0.3)
    legend_of(fig, axes[0])
    suptitle(fig, title or f"metric vs {DERIVED.get(x, x)}: mean ± std over seeds (×n: runs excluded, not ok)")
    return fig
