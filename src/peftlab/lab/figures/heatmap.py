"""``peftlab plot --kind heatmap`` and ``--kind lr-grid`` (eta_QK x eta_V, Yao et al. Figure 1, the lambda = 1
diagonal dashed): a metric over two config keys, one panel per task, one colour scale per task. Each cell
states its mean and ``(n)`` of the runs that ended ok and ``k/N ✗`` for the others (a cell of failures only is
hatched); the best cell is boxed only where :func:`peftlab.lab.figures.cells.best_cell` tells it apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from peftlab.lab.figures.paper import CHAR_EM, Drawn, metric_label, panel_grid, panel_title, set_ticks, suptitle, wrap
from peftlab.lab.figures.cells import HeatmapData, HeatPanel, LineInstead, heatmap_data
from peftlab.lab.records import RunRecord
from peftlab.tasks.table import task_title

ANNOT_PT = 7.0  # cell annotations; smaller only when a panel would otherwise grow past MAX_AXES_IN
MIN_ANNOT_PT = 5.5
MAX_AXES_IN = (4.2, 4.6)  # the largest axes (width, height) of one panel, inches
MIN_AXES_IN = (1.5, 1.3)
TICK_PT = 7.5
TITLE_PT = 8.0
TILT = 40  # degrees, x tick labels that would touch side by side
FAILED = "✗"  # marks a cell's count of runs that did not end ok


def cell_texts(panel: HeatPanel, digits: int) -> dict[tuple[int, int], list[str]]:
    """The lines written in each cell: the mean and ``(n)`` of its ok runs, ``k/N ✗`` when k of its N runs
    failed; cells no run reached: none. Short lines, so that a 5 x 8 grid fits a third of a page."""
    import numpy as np

    out = {}
    for cell, ok in np.ndenumerate(panel.n_ok):
        bad = int(panel.n_failed[cell])
        lines = [f"{panel.mean[cell]:.{digits}f}", f"({ok})"] if ok else []
        lines += [f"{bad}/{ok + bad} {FAILED}"] if bad else []
        if lines:
            out[cell] = lines
    return out


@dataclass(frozen=True)
class Layout:
    axes_w: float  # inches
    axes_h: float
    annot_pt: float
    tilt_x: bool  # x tick labels at an angle (too close side by side)


def _spans(points, log: bool):
    """Distances between neighbouring ``points`` (cell edges or ticks) in the axis' units: log units on a log axis."""
    import numpy as np

    return np.diff(np.log(points) if log else points)


def _layout(data: HeatmapData, digits: int) -> Layout:
    """The panel size at which the narrowest cell holds its text at ANNOT_PT and neighbouring tick labels do
    not touch, within MAX_AXES_IN (the cell text shrinks, down to MIN_ANNOT_PT, when it would not fit)."""
    tick_h = TICK_PT * 1.3 / 72
    cells_w = cells_h = ticks_h = ticks_flat = ticks_tilted = 0.0  # inches per axis unit each needs
    units_w = units_h = 1.0
    for p in data.panels:
        widths, heights = _spans(p.x.edges(), p.x.log), _spans(p.y.edges(), p.y.log)
        units_w, units_h = max(units_w, sum(widths)), max(units_h, sum(heights))
        for (yi, xi), lines in cell_texts(p, digits).items():
            cells_w = max(cells_w, (max(len(line) for line in lines) * CHAR_EM * ANNOT_PT + 6) / 72 / widths[xi])
            cells_h = max(cells_h, (len(lines) * 1.3 * ANNOT_PT + 5) / 72 / heights[yi])
        if len(p.y.values) > 1:
            ticks_h = max(ticks_h, tick_h / min(_spans(p.y.centres(), p.y.log)))
        if len(p.x.values) > 1:
            label_w = max(len(label) for label in p.x.labels) * CHAR_EM * TICK_PT / 72 + 0.05
            gap = min(_spans(p.x.centres(), p.x.log))
            ticks_flat = max(ticks_flat, label_w / gap)
            ticks_tilted = max(ticks_tilted, tick_h / math.sin(math.radians(TILT)) / gap)
    tilt_x = max(cells_w, ticks_flat) * units_w > MAX_AXES_IN[0]
    want_w = max(cells_w, ticks_tilted if tilt_x else ticks_flat) * units_w
    want_h = max(cells_h, ticks_h) * units_h
    axes_w = min(MAX_AXES_IN[0], max(MIN_AXES_IN[0], want_w))
    axes_h = min(MAX_AXES_IN[1], max(MIN_AXES_IN[1], want_h))
    shrink = min(1.0, axes_w / (cells_w * units_w or 1.0), axes_h / (cells_h * units_h or 1.0))
    return Layout(axes_w, axes_h, max(MIN_ANNOT_PT, ANNOT_PT * shrink), tilt_x)


def _text_colour(cmap, norm, value: float) -> str:
    r, g, b, _ = cmap(norm(value))
    return "white" if 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.45 else "black"


def plot_heatmap(records: list[RunRecord], *, x: str = "lr", y: str = "lr_ratio", scale: float = 100.0,
                 title: str | None = None, fold: bool = True) -> Drawn:
    """The heatmap figure (or, where it would be one row or column, the line figure that replaces it);
    ``fold``: see :func:`peftlab.lab.figures.cells.heatmap_data`."""
    data = heatmap_data(records, x=x, y=y, scale=scale, fold=fold)
    if isinstance(data, LineInstead):
        from peftlab.lab.figures.points import plot_points

        drawn = plot_points(records, x=data.vary, scale=scale, title=title, note=data.note)
        drawn.notes.insert(0, data.note)
        return drawn
    return Drawn(draw_heatmap(data, title=title, scale=scale), data, list(data.notes))


def draw_heatmap(data: HeatmapData, *, title: str | None, scale: float):
    import numpy as np
    from matplotlib.colors import Normalize

    digits = 1 if scale >= 10 else 3
    layout = _layout(data, digits)
    axes_w, axes_h, annot_pt = layout.axes_w, layout.axes_h, layout.annot_pt
    longest_ytick = max(len(label) for p in data.panels for label in p.y.labels)
    extra_w = longest_ytick * CHAR_EM * TICK_PT / 72 + 0.9  # y ticks + label, colour bar + its ticks and label
    width = axes_w + extra_w
    title_lines = max(len(wrap(_panel_text(p), 0.9 * width, TITLE_PT).split("\n")) for p in data.panels)
    tilt = 0.3 if layout.tilt_x else 0.0  # tilted tick labels are taller
    height = axes_h + 1.0 + tilt + title_lines * TITLE_PT * 1.3 / 72
    plt, fig, axes = panel_grid(data.n_rows, data.n_cols, width=width, height=height)
    cmap = plt.get_cmap("viridis").with_extremes(bad=(1, 1, 1, 0))  # empty cells: the white axes behind
    for p in data.panels:
        ax = axes[p.row][p.col]
        lo, hi = data.limits[p.task]
        norm = Normalize(lo, hi)
        x_edges, y_edges = p.x.edges(), p.y.edges()
        mesh = ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(p.mean), cmap=cmap, norm=norm,
                             edgecolors="white", linewidth=0.6)
        _set_axes(ax, p, data, layout)
        _draw_cells(ax, p, cmap, norm, digits, annot_pt)
        ax.set_xlabel(p.x.title)
        if p.col == min(q.col for q in data.panels if q.row == p.row):  # the same key in every panel: once a row
            ax.set_ylabel(p.y.title)
        panel_title(ax, _panel_text(p), width, fontsize=TITLE_PT)
        label = metric_label(data.metrics[p.task], scale) + (" (lower is better)" if data.lower[p.task] else "")
        bar = fig.colorbar(mesh, ax=ax, fraction=0.07, pad=0.03, aspect=max(10.0, axes_h / 0.12))
        bar.ax.tick_params(labelsize=7)
        bar.set_label(wrap(label, 0.9 * axes_h, 8), fontsize=8)
    for ax in set(axes.flat) - {axes[p.row][p.col] for p in data.panels}:
        ax.set_axis_off()
    suptitle(fig, title or _caption(data))
    _fit_axes(fig, [axes[p.row][p.col] for p in data.panels], layout, data.n_rows, data.n_cols)
    return fig


def _set_axes(ax, p: HeatPanel, data: HeatmapData, layout: Layout) -> None:
    """A panel's ticks (log or one per value), limits, tilted labels and the lambda = 1 diagonal."""
    from matplotlib.artist import setp

    x_edges, y_edges = p.x.edges(), p.y.edges()
    for which, grid in (("x", p.x), ("y", p.y)):
        set_ticks(ax, which, grid.centres(), grid.labels, log=grid.log)
    ax.set_xlim(x_edges[0], x_edges[-1])
    # a folded panel's rows are configs: they read top to bottom, as in a table
    ax.set_ylim(*((y_edges[-1], y_edges[0]) if data.folded else (y_edges[0], y_edges[-1])))
    ax.tick_params(length=2)
    if layout.tilt_x:
        setp(ax.get_xticklabels(), rotation=TILT, ha="right", rotation_mode="anchor")
    if data.diagonal:  # lambda = 1: eta_V = eta_QK
        lo_d, hi_d = max(x_edges[0], y_edges[0]), min(x_edges[-1], y_edges[-1])
        if hi_d > lo_d:
            ax.plot([lo_d, hi_d], [lo_d, hi_d], ls="--", lw=0.8, color="#444444", zorder=3)


def _draw_cells(ax, p: HeatPanel, cmap, norm, digits: int, annot_pt: float) -> None:
    """Each cell's text on a patch of its own colour, cells without a mean hatched, the best cell outlined."""
    from matplotlib.patches import Rectangle

    x_edges, y_edges = p.x.edges(), p.y.edges()
    xc, yc = p.x.cell_centres(), p.y.cell_centres()

    def outline(yi: int, xi: int, **style) -> None:
        ax.add_patch(Rectangle((x_edges[xi], y_edges[yi]), x_edges[xi + 1] - x_edges[xi],
                               y_edges[yi + 1] - y_edges[yi], fill=False, **style))

    for (yi, xi), lines in cell_texts(p, digits).items():
        has_mean = bool(p.n_ok[yi, xi])
        if not has_mean:  # only runs that did not end ok: hatched, the count on white
            outline(yi, xi, hatch="////", edgecolor="#8c8c8c", lw=0, zorder=2)
        colour = _text_colour(cmap, norm, p.mean[yi, xi]) if has_mean else "black"
        # the text sits on a patch of its cell's own colour: the lambda = 1 line passes behind it
        face = cmap(norm(p.mean[yi, xi])) if has_mean else "white"
        ax.text(xc[xi], yc[yi], "\n".join(lines), ha="center", va="center", fontsize=annot_pt, color=colour,
                zorder=5, fontweight="bold" if p.best.marked and (yi, xi) == p.best.cell else "normal",
                bbox=dict(facecolor=face, alpha=1.0 if has_mean else 0.85, lw=0, pad=0.8))
    if p.best.marked:
        for colour, lw in (("white", 3.2), ("black", 1.6)):  # visible on every colour of the map
            outline(*p.best.cell, edgecolor=colour, lw=lw, zorder=4)


def _fit_axes(fig, panels: list, layout: Layout, n_rows: int, n_cols: int) -> None:
    """Resize the figure until constrained layout gives the panels the axes size the cells need (the space
    its titles, ticks and colour bars take is measured, not guessed)."""
    for _ in range(2):
        fig.canvas.draw()  # runs the layout
        width = min(ax.get_position().width for ax in panels) * fig.get_figwidth()
        height = min(ax.get_position().height for ax in panels) * fig.get_figheight()
        if abs(width - layout.axes_w) < 0.02 and abs(height - layout.axes_h) < 0.02:
            return
        new_w = fig.get_figwidth() + n_cols * (layout.axes_w - width)
        new_h = fig.get_figheight() + n_rows * (layout.axes_h - height)
        fig.set_size_inches(round(new_w * fig.dpi) / fig.dpi, round(new_h * fig.dpi) / fig.dpi)


def _panel_text(p: HeatPanel) -> str:
    return "\n".join(filter(None, [task_title(p.task), p.subtitle, p.best.note]))


def _caption(data: HeatmapData) -> str:
    names = "/".join(sorted({m for ms in data.metrics.values() for m in ms}))
    what = ("one run per cell (seed is an axis)" if data.seed_axis
            else "cells: mean over the runs that ended ok and (n) their number")
    statuses = sorted({s for p in data.panels for counts in p.failed.values() for s in counts})
    failed = (f"k/N {FAILED}: k of the cell's N runs ended {', '.join(statuses)} (not in the mean)"
              if statuses else "")
    marked = any(p.best.marked for p in data.panels)
    unmarked = [task_title(p.task) for p in data.panels if not p.best.marked]
    best = ("box: the best cell, where a paired 95\u00a0% t CI against the runner-up excludes 0" if marked else "")
    if unmarked and not data.seed_axis:
        best = "; ".join(filter(None, [best, f"best not distinguishable in {', '.join(dict.fromkeys(unmarked))}"]))
    diagonal = r"dashed: $\lambda{=}1$ ($\eta_V{=}\eta_{QK}$)" if data.diagonal else ""
    return f"{names}; " + "; ".join(filter(None, [what, failed, "blank: not run", best, diagonal, *data.notes]))
