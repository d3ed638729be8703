"""``peftlab plot STORE --kind heatmap|sigma|curves|rank --out FILE.png``: figures from a results store.

* ``heatmap``: a metric over two config keys (``--x lr --y lr_ratio`` by default; ``--y v_lr`` is
  lr * lr_ratio, i.e. eta_QK x eta_V as in Yao et al. Figure 1), mean over seeds, one panel per task (and
  per combination of any other key that varies), one colour scale per task; red box: the best cell (the lowest
  for metrics in ``peftlab.tasks.metrics.LOWER_IS_BETTER``). Cells with diverged/collapsed/failed runs are marked
  (``[status]``); a cell with only such runs is grey and names them. When --x or --y takes one value in every
  task, the panels fold into one per task with the configs as rows.
* ``sigma``: what training did to KaSA's Delta_sigma per layer and projection (KaSA Figure 4): result.json's
  ``kasa_sigma - kasa_sigma_init`` (learned minus initial values; the random init would otherwise dominate),
  averaged over the selected runs (seeds), one symmetric colour scale for all panels. Runs of an older peftlab
  without ``kasa_sigma_init`` are drawn as Delta_sigma itself, their panel titles saying so.
* ``curves``: the metric per epoch and the train loss of the selected runs (``--where``), mean ± std over
  seeds per config; runs that did not end ok are drawn on their own, dashed.
* ``rank``: the metric against ``--x`` (default rank), one line per other varying config, mean ± std.

Figures are drawn with matplotlib's Agg backend and constrained layout, titles wrapped to the figure's width, and
saved uncropped (:func:`make_figure` returns the Figure, :func:`save_figure` writes it); the file type follows
``--out``'s suffix (png, pdf, svg).
"""

from __future__ import annotations

import math
import re
import statistics
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.lab.report import (
    NON_RESULT_KEYS,
    RunRecord,
    _fmt_value,
    _hashable,
    _task_order,
    _varying_keys,
    auto_scale,
    collect,
    parse_filter,
    task_determined_keys,
)
from peftlab.lab.store import NOT_OK, load_rows

KINDS = ("heatmap", "sigma", "curves", "rank")
DERIVED = {"v_lr": "lr * lr_ratio (eta_V)", "qk_lr": "lr (eta_QK)"}
# Axis titles for config keys whose name alone does not say what they are (the papers' symbols).
AXIS_TITLES = {"lr_ratio": "lambda = eta_V / eta_QK (lr_ratio)", "lr": "eta_QK (lr)", **DERIVED}
SUFFIXES = (".png", ".pdf", ".svg")
MAX_PANELS = 36
MAX_LINES = 12
DPI = 150  # figures are laid out at the resolution they are saved with (a PNG is the figure's own canvas)
_CHAR_EM = 0.6  # average glyph width in em (DejaVu Sans), a little generous, for wrapping titles to a width
_PROJ_NAMES = {"query": "q", "q_proj": "q", "q_lin": "q", "q": "q", "key": "k", "k_proj": "k", "k_lin": "k",
               "k": "k", "value": "v", "v_proj": "v", "v_lin": "v", "v": "v", "o_proj": "o", "out_proj": "o",
               "out_lin": "o", "o": "o", "c_attn": "qkv", "c_proj": "o"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def key_value(config: dict, key: str):
    """A config value, or a derived one (v_lr = lr * lr_ratio, qk_lr = lr); floats rounded for grouping."""
    if key == "v_lr":
        value = float(config["lr"]) * float(config["lr_ratio"])
    elif key == "qk_lr":
        value = float(config["lr"])
    else:
        value = config.get(key)
    if isinstance(value, float):
        value = float(f"{value:.10g}")
    return _hashable(value)


def _check_key(key: str, flag: str) -> None:
    from dataclasses import fields

    from peftlab.config import TrainConfig
    from peftlab.errors import closest

    names = [f.name for f in fields(TrainConfig)] + list(DERIVED)
    if key not in names:
        raise PeftlabError(f"unknown key '{key}' for {flag}{closest(key, names)}",
                           fix="use a config key (lr, lr_ratio, rank, ...) or v_lr (= lr * lr_ratio)")


def _underlying(key: str) -> set[str]:
    return {"v_lr": {"lr", "lr_ratio"}, "qk_lr": {"lr"}}.get(key, {key})


def _label(config: dict, keys: list[str]) -> str:
    return " ".join(f"{k}={_fmt_value(config.get(k))}" for k in keys) or "all runs"


def _split(records: list[RunRecord], drop: set[str]
           ) -> tuple[dict[tuple, list[RunRecord]], dict[tuple, dict], list[str]]:
    """Group records by their config minus ``drop``; returns groups, each group's config, varying keys."""
    groups: dict[tuple, list[RunRecord]] = defaultdict(list)
    configs: dict[tuple, dict] = {}
    for rec in records:
        config = {k: v for k, v in rec.config.items() if k not in drop}
        key = tuple(sorted((k, _hashable(v)) for k, v in config.items()))
        groups[key].append(rec)
        configs[key] = config
    return groups, configs, _varying_keys(list(configs.values()))


def _task_title(task: str) -> str:
    from peftlab.tasks.table import TASKS

    return (TASKS[task].glue_dir or task.upper()) if task in TASKS else task


def _fmt_tick(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return _fmt_value(value)


def _status_summary(counts: dict[str, int]) -> str:
    return ", ".join(f"{s} ×{n}" if n > 1 else s for s, n in sorted(counts.items()))


def _wrap(text: str, width_in: float, fontsize: float) -> str:
    """``text`` with each of its lines wrapped to fit ``width_in`` inches at ``fontsize`` points."""
    chars = max(16, int(width_in * 72 / (_CHAR_EM * fontsize)))
    return "\n".join(textwrap.fill(line, chars, break_on_hyphens=False) if line else line
                     for line in text.split("\n"))


def _suptitle(fig, text: str, fontsize: float = 10) -> None:
    fig.suptitle(_wrap(text, 0.96 * fig.get_figwidth(), fontsize), fontsize=fontsize)


def _title(ax, text: str, width_in: float, fontsize: float = 9) -> None:
    ax.set_title(_wrap(text, 0.9 * width_in, fontsize), fontsize=fontsize)


def _legend_below(fig, handles, labels, fontsize: float = 8) -> None:
    """One legend for the figure, below the panels (constrained layout makes room for it)."""
    room = 0.95 * fig.get_figwidth()
    per_entry = (max(len(label) for label in labels) * _CHAR_EM * fontsize + 48) / 72  # marker + padding
    ncol = max(1, min(3, len(labels), int(room / per_entry)))
    labels = [_wrap(label, room / ncol - 48 / 72, fontsize) for label in labels]
    lines = sum(max(label.count("\n") + 1 for label in labels[k:k + ncol]) for k in range(0, len(labels), ncol))
    height = fig.get_figheight() + lines * 1.4 * fontsize / 72  # room for the legend, the panels keep theirs
    fig.set_figheight(round(height * fig.dpi) / fig.dpi)
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=fontsize, frameon=False)


def _panel_grid(n_rows: int, n_cols: int, *, width: float = 4.4, height: float = 3.6):
    if n_rows * n_cols > MAX_PANELS:
        raise PeftlabError(f"the figure would have {n_rows * n_cols} panels (at most {MAX_PANELS})",
                           fix='select fewer runs with --where, e.g. --where "method=lora,targets=q,v"')
    plt = _pyplot()
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols, height * n_rows), squeeze=False,
                             layout="constrained", dpi=DPI)
    return plt, fig, axes


def _colorbar(fig, image, axes: list, width: float, height: float):
    """One colour bar for ``axes`` (panels of ``width`` x ``height`` inches that share the colour scale), about
    as long as the rows they span (its aspect ratio sets its length under constrained layout)."""
    rows = {ax.get_subplotspec().rowspan.start for ax in axes}
    # the bar is ~fraction x the parents' width thick (their width less the tick labels); length = aspect x that
    aspect = max(10.0, 0.85 * (height * len(rows) - 0.6) / (0.05 * max(width - 0.9, 1.0)))
    bar = fig.colorbar(image, ax=axes, fraction=0.05, pad=0.02, shrink=0.9, aspect=aspect)
    bar.ax.tick_params(labelsize=7)
    return bar


def _metric_label(names, scale: float) -> str:
    return "/".join(names) + (" ×100" if scale == 100 else "")


# --------------------------------------------------------------------------- (a) heatmap


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
        return [_fmt_tick(configs[g].get(varying[0])) for g in rows], varying[0]
    return [_label(configs[g], varying) for g in rows], ""


def plot_heatmap(records: list[RunRecord], *, x: str = "lr", y: str = "lr_ratio", scale: float = 100.0,
                 digits: int = 1, title: str | None = None):
    """The heatmap figure. All panels of a task share one colour scale (one colour bar per task).

    When ``x`` or ``y`` takes a single value in every task while other keys vary (e.g. the default lr x
    lr_ratio on a sweep over methods only), a grid of 1-cell panels would say nothing: the figure folds into
    one panel per task whose rows are the configs and whose columns are the axis that does vary.
    """
    import numpy as np

    from peftlab.tasks.metrics import LOWER_IS_BETTER

    trained = [r for r in records if not r.before]
    if not trained:
        raise PeftlabError("no trained runs to plot (only epochs-0 runs)")
    per_task = task_determined_keys(trained)
    drop = set(NON_RESULT_KEYS) | set(per_task) | _underlying(x) | _underlying(y)
    groups, configs, varying = _split(trained, drop)
    order = sorted(configs, key=lambda g: _label(configs[g], varying))
    group_of = {id(rec): g for g, recs in groups.items() for rec in recs}
    tasks = _task_order(r.task for r in trained)
    metrics = {t: sorted({r.metric for r in trained if r.task == t and r.metric}) for t in tasks}
    lower = {t: bool(m) and all(name in LOWER_IS_BETTER for name in m) for t, m in metrics.items()}

    def values_of(key: str, task: str) -> list:
        return sorted({key_value(r.config, key) for r in trained if r.task == task}, key=_num_key)

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
            const = ", ".join(_fmt_tick(v) for v in values_of(const_key, task))
            panels.append(_HeatPanel(0, j, task, values, cells, bad, [_fmt_tick(v) for v in cols], yticks,
                                     AXIS_TITLES.get(col_key, col_key), ylabel,
                                     f"{_task_title(task)}\n{const_key}={const} in all runs"))
        n_cells_x = max(len(p.xticks) for p in panels)
        n_cells_y = max(len(p.yticks) for p in panels)
        longest = max(len(t) for p in panels for t in p.yticks)
        width = max(3.6, 1.9 + 0.8 * n_cells_x + longest * _CHAR_EM * 8 / 72)
        height = max(2.6, 1.9 + 0.4 * n_cells_y)
    else:
        n_rows, n_cols = len(order), len(tasks)
        for i, gkey in enumerate(order):
            sub = _label(configs[gkey], varying) if varying else ""
            for j, task in enumerate(tasks):
                recs = [r for r in groups[gkey] if r.task == task]
                if not recs:
                    continue
                xs = sorted({key_value(r.config, x) for r in recs}, key=_num_key)
                ys = sorted({key_value(r.config, y) for r in recs}, key=_num_key)
                values, cells, bad = _heat_cells(recs, lambda r: key_value(r.config, y),
                                                 lambda r: key_value(r.config, x), ys, xs, scale)
                panels.append(_HeatPanel(i, j, task, values, cells, bad, [_fmt_tick(v) for v in xs],
                                         [_fmt_tick(v) for v in ys], AXIS_TITLES.get(x, x), AXIS_TITLES.get(y, y),
                                         _task_title(task) + (f"\n{sub}" if sub else "")))
        n_cells_x = max(len(p.xticks) for p in panels)
        n_cells_y = max(len(p.yticks) for p in panels)
        width = max(3.8, 2.0 + 0.8 * n_cells_x)
        height = max(3.0, 1.9 + 0.55 * n_cells_y)
    plt, fig, axes = _panel_grid(n_rows, n_cols, width=width, height=height)
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
                    summary = _status_summary(p.bad[(yi, xi)])
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
        _title(ax, p.title, width)
    for i in range(n_rows):
        for j in range(n_cols):
            if (i, j) not in used:
                axes[i][j].set_axis_off()
    for task, pairs in drawn.items():
        label = _metric_label(metrics[task], scale) + (" (lower is better)" if lower[task] else "")
        bar = _colorbar(fig, pairs[0][1], [ax for ax, _ in pairs], width, height)
        bar.set_label(_wrap(label, 0.8 * height * len(pairs), 8), fontsize=8)
    seed_axis = "seed" in (x, y)
    lowest = sorted({m for t in tasks if lower[t] for m in metrics[t]})
    best_text = "red box: best" + ((" (lowest)" if all(lower.values()) else f" (lowest for {', '.join(lowest)})")
                                   if lowest else "")
    what = "one run per cell (seed is an axis)" if seed_axis else "mean over seeds"
    bad_text = "[..]: runs that did not end ok" + ("" if seed_axis else " (not in the mean)")
    names = "/".join(sorted({m for ms in metrics.values() for m in ms}))
    _suptitle(fig, title or f"{names}, {what}; {best_text}; {bad_text}")
    return fig


def _num_key(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


# --------------------------------------------------------------------------- (b) KaSA sigma


def parse_module(name: str) -> tuple[int | None, str]:
    """``bert.encoder.layer.3.attention.self.value`` -> ``(3, "v")``."""
    layer = None
    found = re.search(r"(?:^|\.)(?:layer|layers|h|block|blocks)\.(\d+)(?:\.|$)", name) or re.search(r"\.(\d+)\.", name)
    if found:
        layer = int(found.group(1))
    last = name.rsplit(".", 1)[-1]
    if last == "dense" and ".attention.output" in f".{name}":
        return layer, "o"
    return layer, _PROJ_NAMES.get(last, last)


SIGMA_DELTA = "learned change Δσ − Δσ_init"
SIGMA_NO_INIT = "(init not recorded: values include the random initialisation)"


def _module_name(name: str) -> str:
    return name.removeprefix("base_model.model.")


def sigma_change(result: dict) -> dict[str, list[float]] | None:
    """``kasa_sigma - kasa_sigma_init`` per module (what training changed), or None when the run did not record
    the values at initialisation (result.json of an older peftlab) or they do not match module for module."""
    sigma = result.get("kasa_sigma") or {}
    init = {_module_name(k): v for k, v in (result.get("kasa_sigma_init") or {}).items()}
    out = {}
    for module, values in sigma.items():
        start = init.get(_module_name(module))
        if start is None or len(start) != len(values):
            return None
        out[module] = [float(v) - float(s) for v, s in zip(values, start)]
    return out or None


def _proj_order(proj: str):
    known = ("q", "k", "v", "o", "qkv")
    return (known.index(proj), "") if proj in known else (len(known), proj)


def plot_sigma(records: list[RunRecord], *, title: str | None = None):
    """KaSA Figure 4: what training did to Δσ, per layer (rows) and singular value (columns), mean over seeds.

    Each run contributes ``kasa_sigma - kasa_sigma_init``; Δσ's random initialisation would otherwise dominate the
    picture (two tasks would look alike). A panel whose runs did not record ``kasa_sigma_init`` (an older store)
    shows Δσ itself and says so in its title; the colour limits are symmetric about 0 and shared by all panels of
    the same quantity, so panels compare.
    """
    import numpy as np
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    runs = [r for r in records if r.result and r.result.get("kasa_sigma")]
    if not runs:
        methods = sorted({str(r.config.get("method")) for r in records})
        raise PeftlabError("no run in the selection has kasa_sigma (KaSA's learned singular values)",
                           fix=f"select KaSA runs (--where method=kasa); the selection has {', '.join(methods)}")
    drop = set(NON_RESULT_KEYS) - {"task"}
    groups, configs, varying = _split(runs, drop)
    varying = [k for k in varying if k != "task"]
    panels = sorted(configs, key=lambda g: (_task_order([configs[g]["task"]])[0], _label(configs[g], varying)))
    projections = sorted({parse_module(m)[1] for r in runs for m in r.result["kasa_sigma"]}, key=_proj_order)
    changes = {id(r): sigma_change(r.result) for r in runs}
    width, height = 4.2, 3.4
    _, fig, axes = _panel_grid(len(panels), len(projections), width=width, height=height)
    matrices: dict[tuple[int, int], tuple[Any, list[int]]] = {}
    delta_panel: dict[int, bool] = {}
    notes: dict[int, str] = {}
    for i, gkey in enumerate(panels):
        recs = groups[gkey]
        with_init = [r for r in recs if changes[id(r)] is not None]
        delta_panel[i] = bool(with_init)
        if with_init:
            used = [(r, changes[id(r)]) for r in with_init]
            left_out = len(recs) - len(with_init)
            notes[i] = f"mean of {len(used)} run(s)" + (f"; {left_out} without init left out" if left_out else "")
        else:
            used = [(r, {m: [float(v) for v in vals] for m, vals in r.result["kasa_sigma"].items()}) for r in recs]
            notes[i] = f"mean of {len(used)} run(s) {SIGMA_NO_INIT}"
        for j, proj in enumerate(projections):
            per_layer: dict[int, list[list[float]]] = defaultdict(list)
            for _, per_module in used:
                for module, values in per_module.items():
                    layer, p = parse_module(module)
                    if p == proj:
                        per_layer[layer if layer is not None else 0].append(values)
            if not per_layer:
                continue
            layers = sorted(per_layer)
            n = max(len(v) for vals in per_layer.values() for v in vals)
            matrix = np.full((len(layers), n), np.nan)
            for li, layer in enumerate(layers):
                vals = [v + [math.nan] * (n - len(v)) for v in per_layer[layer]]
                matrix[li] = np.nanmean(np.array(vals, dtype=float), axis=0)
            matrices[(i, j)] = (matrix, layers)

    def limit(delta: bool) -> float:
        peaks = [float(np.nanmax(np.abs(m))) for (i, _), (m, _) in matrices.items()
                 if delta_panel[i] == delta and np.isfinite(m).any()]
        return max(peaks, default=0.0) or 1.0

    limits = {True: limit(True), False: limit(False)}
    images: dict[bool, list] = defaultdict(list)
    for i, gkey in enumerate(panels):
        sub = _label(configs[gkey], varying) if varying else ""
        for j, proj in enumerate(projections):
            ax = axes[i][j]
            if (i, j) not in matrices:
                ax.set_axis_off()
                continue
            matrix, layers = matrices[(i, j)]
            lim = limits[delta_panel[i]]
            image = ax.imshow(matrix, origin="lower", cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto",
                              interpolation="nearest")
            images[delta_panel[i]].append((ax, image))
            step = max(1, math.ceil(len(layers) / 12))
            ax.set_yticks(range(0, len(layers), step), [str(layers[k]) for k in range(0, len(layers), step)],
                          fontsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(round(v)) + 1}"))
            ax.tick_params(axis="x", labelsize=7)
            ax.set_xlabel("singular value index i")
            ax.set_ylabel("layer")
            _title(ax, f"{_task_title(configs[gkey]['task'])} · {proj} · {notes[i]}" + (f"\n{sub}" if sub else ""),
                   width)
    for delta, pairs in images.items():
        label = SIGMA_DELTA if delta else f"Δσ {SIGMA_NO_INIT}"
        bar = _colorbar(fig, pairs[0][1], [ax for ax, _ in pairs], width, height)
        n_rows = sum(1 for i in delta_panel if delta_panel[i] == delta)
        bar.set_label(_wrap(label, 0.8 * height * n_rows, 8), fontsize=8)
    if title is None:
        title = f"KaSA: {SIGMA_DELTA} per layer and projection, mean over seeds"
        if not images.get(True):
            title = f"KaSA: Δσ per layer and projection, mean over seeds {SIGMA_NO_INIT}"
        elif images.get(False):
            title += "; panels marked 'init not recorded' show Δσ itself"
    _suptitle(fig, title)
    return fig


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
    groups, configs, varying = _split(runs, drop)
    if len(groups) > MAX_LINES:
        raise PeftlabError(f"the selection has {len(groups)} configs (at most {MAX_LINES} lines)",
                           fix=f'narrow it with --where (they vary in {", ".join(varying)})')
    tasks = _task_order(r.task for r in runs)
    plt, fig, axes = _panel_grid(2, len(tasks), width=4.8, height=3.4)
    colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    order = sorted(groups, key=lambda g: _label(configs[g], varying))
    for j, task in enumerate(tasks):
        top, bottom = axes[0][j], axes[1][j]
        for c, gkey in enumerate(order):
            recs = [r for r in groups[gkey] if r.task == task]
            if not recs:
                continue
            color = colors(c % colors.N)
            label = _label(configs[gkey], varying) if varying else "runs"
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
        _title(top, _task_title(task), 4.8, fontsize=10)
        top.set_ylabel(_metric_label(metric, scale))
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
    handles, labels = axes[0][0].get_legend_handles_labels()
    for j in range(1, len(tasks)):
        h, l = axes[0][j].get_legend_handles_labels()
        for hh, ll in zip(h, l):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        _legend_below(fig, handles, labels)
    _suptitle(fig, title or "learning curves: mean ± std over seeds (dashed: runs that did not end ok)")
    return fig


# --------------------------------------------------------------------------- (d) metric vs rank


def plot_rank(records: list[RunRecord], *, x: str = "rank", scale: float = 100.0, title: str | None = None):
    trained = [r for r in records if not r.before]
    if not trained:
        raise PeftlabError("no trained runs to plot (only epochs-0 runs)")
    per_task = task_determined_keys(trained)
    drop = set(NON_RESULT_KEYS) | set(per_task) | _underlying(x)
    groups, configs, varying = _split(trained, drop)
    if len(groups) > MAX_LINES:
        raise PeftlabError(f"the selection has {len(groups)} lines (at most {MAX_LINES})",
                           fix=f'narrow it with --where (they vary in {", ".join(varying)})')
    tasks = _task_order(r.task for r in trained)
    plt, fig, axes = _panel_grid(1, len(tasks), width=4.8, height=3.8)
    colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    all_x = sorted({key_value(r.config, x) for r in trained}, key=_num_key)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in all_x)
    for j, task in enumerate(tasks):
        ax = axes[0][j]
        for c, gkey in enumerate(sorted(groups, key=lambda g: _label(configs[g], varying))):
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
            xs = sorted(by_x, key=_num_key)
            pos = xs if numeric else [all_x.index(v) for v in xs]
            means = [statistics.fmean(by_x[v]) for v in xs]
            stds = [statistics.stdev(by_x[v]) if len(by_x[v]) > 1 else 0.0 for v in xs]
            color = colors(c % colors.N)
            ax.errorbar(pos, means, yerr=stds, marker="o", ms=4, capsize=3, color=color,
                        label=_label(configs[gkey], varying) if varying else None)
            for v, n in bad.items():
                if v in by_x:
                    ax.annotate(f"×{n}", (v if numeric else all_x.index(v), statistics.fmean(by_x[v])),
                                textcoords="offset points", xytext=(4, -10), fontsize=7, color=color)
        if numeric:
            positive = all(float(v) > 0 for v in all_x)
            if positive and len(all_x) > 2 and max(all_x) / min(all_x) >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(all_x, [_fmt_tick(v) for v in all_x])
            ax.minorticks_off()
        else:
            ax.set_xticks(range(len(all_x)), [_fmt_tick(v) for v in all_x])
        ax.set_xlabel(AXIS_TITLES.get(x, x))
        metric = sorted({r.metric for r in trained if r.task == task and r.metric})
        ax.set_ylabel(_metric_label(metric, scale))
        _title(ax, _task_title(task), 4.8, fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = [], []
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    if handles:
        _legend_below(fig, handles, labels)
    _suptitle(fig, title or f"metric vs {DERIVED.get(x, x)}: mean ± std over seeds (×n: runs excluded, not ok)")
    return fig


# --------------------------------------------------------------------------- output + CLI


def save_figure(fig, out: str | Path, *, close: bool = True) -> Path:
    """Write ``fig`` to ``out`` (type from the suffix) as laid out: its whole canvas, no cropping, at ``DPI``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=fig.dpi)
    if close:
        _pyplot().close(fig)
    return out


def make_figure(rows: list[dict], *, kind: str, x: str | None = None, y: str | None = None, where: str | None = None,
                which: str = "best", metric: str | None = None, scale: float | None = None,
                title: str | None = None):
    """The matplotlib Figure of one ``peftlab plot`` (constrained layout; :func:`save_figure` writes it)."""
    if kind not in KINDS:
        raise PeftlabError(f"unknown --kind '{kind}'", fix=f"use one of {', '.join(KINDS)}")
    filters = parse_filter(where)
    records, _ = collect(rows, which=which, metric=metric, where=filters)
    if not records:
        raise PeftlabError("no finished runs in the store" + (" match --where" if filters else ""),
                           fix="run the sweep first, or loosen --where")
    if scale is None:
        scale = auto_scale(r.metric for r in records)
    if kind == "heatmap":
        x, y = x or "lr", y or "lr_ratio"
        _check_key(x, "--x")
        _check_key(y, "--y")
        if x == y:
            raise PeftlabError("--x and --y must differ")
        return plot_heatmap(records, x=x, y=y, scale=scale, title=title)
    if kind == "sigma":
        return plot_sigma(records, title=title)
    if kind == "curves":
        return plot_curves(records, scale=scale, title=title)
    x = x or "rank"
    _check_key(x, "--x")
    return plot_rank(records, x=x, scale=scale, title=title)


def make_plot(rows: list[dict], *, kind: str, out: str | Path, x: str | None = None, y: str | None = None,
              where: str | None = None, which: str = "best", metric: str | None = None, scale: float | None = None,
              title: str | None = None) -> Path:
    """:func:`make_figure` written to ``out`` (.png, .pdf or .svg)."""
    if kind not in KINDS:
        raise PeftlabError(f"unknown --kind '{kind}'", fix=f"use one of {', '.join(KINDS)}")
    out = Path(out)
    if out.suffix.lower() not in SUFFIXES:
        raise PeftlabError(f"--out must end in {', '.join(SUFFIXES)}, got '{out.name}'")
    fig = make_figure(rows, kind=kind, x=x, y=y, where=where, which=which, metric=metric, scale=scale, title=title)
    return save_figure(fig, out)


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "plot", help="figures from a results store: heatmap, KaSA sigma, learning curves, metric vs rank",
        description="heatmap: metric over --x/--y (default lr x lr_ratio; v_lr = lr*lr_ratio) per task; "
                    "sigma: what training changed in KaSA's Delta_sigma (learned - init) per layer/projection; "
                    "curves: metric and loss per epoch; rank: metric vs --x (default rank).")
    parser.add_argument("stores", nargs="+", metavar="STORE", help="results.sqlite of a sweep (or its folder)")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--out", required=True, help="output file: .png, .pdf or .svg")
    parser.add_argument("--x", default=None, help="heatmap/rank x key (default lr / rank)")
    parser.add_argument("--y", default=None, help="heatmap y key (default lr_ratio; v_lr = lr * lr_ratio)")
    parser.add_argument("--where", default=None, metavar="K=V,...", help='only runs matching, e.g. "method=kasa"')
    parser.add_argument("--which", choices=("best", "final"), default="best", help="best (default) or final epoch")
    parser.add_argument("--metric", default=None, help="plot this metric instead of each task's primary metric")
    parser.add_argument("--scale", type=float, default=None, help="multiply metrics (default 100 for accuracy-like)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.set_defaults(func=run_cli)


def run_cli(args) -> int:
    path = make_plot(load_rows(args.stores), kind=args.kind, out=args.out, x=args.x, y=args.y, where=args.where,
                     which=args.which, metric=args.metric, scale=args.scale, title=args.title)
    print(f"wrote {path}")
    return 0
