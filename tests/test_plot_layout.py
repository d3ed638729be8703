"""`peftlab plot` layout: every visible text of every kind of figure lies inside the canvas that is saved.

Figures use constrained layout and are saved uncropped (no ``bbox_inches="tight"``), so the saved PNG is the
figure's own canvas: the test checks each drawn text's window extent against ``fig.bbox`` and the PNG's size
against the figure's.
"""

from __future__ import annotations

import os
import random
import struct
import warnings
from pathlib import Path

import pytest

from peftlab.resolve import build_run_config
from peftlab.lab.plot import draw, save_figure
from peftlab.lab.records import load_rows
from peftlab.lab.store import Store
from _plot_helpers import close_figures  # noqa: F401 - an autouse fixture
from fake_results import checked  # noqa: E402 - tests/ is on sys.path
from test_plot import _result as plot_result, add_grid  # noqa: E402  (tests/ is on sys.path, as for conftest)

OUT = os.environ.get("PEFTLAB_PLOT_OUT")  # a folder: keep every figure drawn here, to look at

LONG_TITLE = ("a deliberately long custom title that would run past both edges of a one-panel figure unless it "
              "is wrapped to the figure's width, as researchers' titles tend to be")


def _result(cfg: dict, accuracy: float, status: str, rng: random.Random) -> dict:
    """test_plot's fake result, with KaSA's sigma (and its init) on 4 layers x {q, k, v}."""
    result = plot_result(cfg, accuracy, status, rng)
    if cfg["method"] == "kasa":
        modules = [f"bert.encoder.layer.{layer}.attention.self.{proj}" for layer in range(4)
                   for proj in ("query", "key", "value")]
        init = {m: [rng.gauss(0, 0.5) for _ in range(cfg["rank"])] for m in modules}
        result["kasa_sigma_init"] = init
        result["kasa_sigma"] = {m: [v + rng.gauss(0, 0.01) for v in vals] for m, vals in init.items()}
    return checked(result)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("layout") / "results.sqlite"
    with Store(path) as store:
        add_grid(store, rng, _result, tasks=("rte", "mrpc", "cola"), lrs=(1e-4, 3e-4, 1e-3), epochs=3,
                 bad_status="diverged")
        for method in ("lora", "dora", "kasa", "pissa"):  # one epoch, one lr: a heatmap only when folded
            for ratio in (1.0, 2.0, 4.0):
                for seed in range(3):
                    cfg = build_run_config(overrides=dict(model="tiny-bert", task="sst2", method=method,
                                                                   lr=5e-4, lr_ratio=ratio, rank=8, seed=seed,
                                                                   epochs=1)).to_dict()
                    store.add(cfg, result=_result(cfg, 0.8 + rng.gauss(0, 0.01), "ok", rng))
    return load_rows([path])


def _drawn_texts(fig, renderer):
    """The Text artists a draw of ``fig`` paints: visible, non-empty, on a shown axis and a tick in view."""
    from matplotlib.text import Text

    skip = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            slack = 1e-9 * max(abs(lo), abs(hi), 1.0)
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                loc = tick.get_loc()
                if not ax.axison or not axis.get_visible() or loc is None or not lo - slack <= loc <= hi + slack:
                    skip.update({id(tick.label1), id(tick.label2)})
            if not ax.axison or not axis.get_visible():
                skip.update({id(axis.label), id(axis.offsetText)})
    texts = []
    for text in fig.findobj(Text):
        if id(text) in skip or not text.get_visible() or not text.get_text().strip():
            continue
        parent = text.axes
        if parent is not None and not parent.get_visible():
            continue
        texts.append((text, text.get_window_extent(renderer)))
    return texts


CASES = {
    "lr-grid": dict(kind="lr-grid", where="rank=8,method=lora"),  # eta_V 1e-4 ... 4e-3: unevenly spaced cells
    "lr-grid-as-lines": dict(kind="lr-grid", where="task=sst2"),  # one eta_QK: lines instead
    "heatmap": dict(kind="heatmap", where="rank=8"),  # dora's single failed run: left out, named
    "heatmap-v_lr": dict(kind="heatmap", x="lr", y="v_lr", where="rank=4,task=rte"),
    "heatmap-folded": dict(kind="heatmap", where="task=sst2"),
    "heatmap-seed": dict(kind="heatmap", y="seed", where="rank=8,method=lora,lr_ratio=4"),
    "heatmap-long-title": dict(kind="heatmap", where="task=rte,method=lora,rank=8", title=LONG_TITLE),
    "sigma": dict(kind="sigma", where="method=kasa,lr=1e-3,lr_ratio=4,rank=8"),
    "curves": dict(kind="curves", where="rank=8,lr=1e-3,lr_ratio=4"),
    "curves-steps-range": dict(kind="curves", where="rank=8,lr=1e-3,lr_ratio=4", curve_x="step", band="range"),
    "curves-loss": dict(kind="curves", where="rank=8,lr=1e-3", loss=True),
    "curves-one-epoch": dict(kind="curves", where="task=sst2"),
    "curves-long-labels": dict(kind="curves", where="task=rte,lr_ratio=4"),
    "rank": dict(kind="rank", where="lr=1e-4,lr_ratio=4"),
    "rank-one-task": dict(kind="rank", where="lr=1e-4,task=rte"),
}


def layout_problems(fig, png: Path) -> list[str]:
    """What is wrong with the saved ``png`` of ``fig``: texts off the canvas, decorations or tick labels that
    overprint each other, a PNG cropped to something other than the figure's canvas."""
    problems = []
    width, height = struct.unpack(">II", Path(png).read_bytes()[16:24])
    fig.canvas.draw()  # as saved: same dpi, same layout
    canvas = fig.bbox
    if abs(width - canvas.width) > 1 or abs(height - canvas.height) > 1:  # (a pixel: rounding)
        problems.append(f"the PNG is {width}x{height}, the figure {canvas.width:.0f}x{canvas.height:.0f}")
    texts = _drawn_texts(fig, fig.canvas.get_renderer())
    if not any(t.axes is None and t.get_text() == fig.get_suptitle() for t, _ in texts):
        problems.append("no title")
    problems += [f"outside the canvas: {t.get_text()!r} at x {box.x0:.0f}..{box.x1:.0f}, y {box.y0:.0f}..{box.y1:.0f}"
                 for t, box in texts
                 if box.x0 < canvas.x0 - 0.5 or box.x1 > canvas.x1 + 0.5
                 or box.y0 < canvas.y0 - 0.5 or box.y1 > canvas.y1 + 0.5]
    # the decorations (titles, axis and colour-bar labels, legend entries) do not overprint each other
    decorations = [(t, box) for t, box in texts if t in _decorations(fig)]
    problems += [f"overlap: {a.get_text()!r} and {b.get_text()!r}" for i, (a, box_a) in enumerate(decorations)
                 for b, box_b in decorations[i + 1:] if _overlap(box_a, box_b)]
    # a heatmap cell's annotation lies inside its cell
    problems += _cell_texts_outside(fig, texts)
    # every tick label is readable: the labels of one axis do not overprint each other
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels = [(t, box) for t, box in texts if t in axis.get_ticklabels()]
            problems += [f"tick labels overlap: {a.get_text()!r} and {b.get_text()!r}"
                         for i, (a, box_a) in enumerate(labels) for b, box_b in labels[i + 1:]
                         if _overlap(box_a, box_b)]
    return problems


@pytest.mark.parametrize("case", list(CASES))
def test_every_text_lies_inside_the_saved_canvas(rows, tmp_path, case):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. "constrained_layout not applied": text would clip
        fig = draw(rows, **CASES[case]).figure
        out = save_figure(fig, Path(OUT or tmp_path) / f"{case}.png")
    assert layout_problems(fig, out) == []


def _cell_texts_outside(fig, texts) -> list[str]:
    """Heatmap annotations (texts at a cell's centre) whose drawn extent leaves the cell's rectangle."""
    import numpy as np
    from matplotlib.collections import QuadMesh

    extent = {id(t): box for t, box in texts}
    problems = []
    for ax in fig.axes:
        meshes = [c for c in ax.collections if isinstance(c, QuadMesh)] if ax.get_label() != "<colorbar>" else []
        if not meshes:
            continue
        corners = meshes[0].get_coordinates()  # (rows + 1, cols + 1, 2) in data units
        xs, ys = corners[0, :, 0], corners[:, 0, 1]
        for text in ax.texts:
            if id(text) not in extent:
                continue
            tx, ty = text.get_position()
            i = int(np.searchsorted(np.sort(xs), tx)) - 1
            j = int(np.searchsorted(np.sort(ys), ty)) - 1
            x0, x1 = np.sort(xs)[i], np.sort(xs)[i + 1]
            y0, y1 = np.sort(ys)[j], np.sort(ys)[j + 1]
            (px0, py0), (px1, py1) = ax.transData.transform([(x0, y0), (x1, y1)])
            cell = sorted((px0, px1)), sorted((py0, py1))
            box = extent[id(text)]
            if box.x0 < cell[0][0] - 0.5 or box.x1 > cell[0][1] + 0.5 or box.y0 < cell[1][0] - 0.5 \
                    or box.y1 > cell[1][1] + 0.5:
                problems.append(f"cell text {text.get_text()!r} leaves its cell ({box.width:.0f}x{box.height:.0f} px "
                                f"in {cell[0][1] - cell[0][0]:.0f}x{cell[1][1] - cell[1][0]:.0f})")
    return problems


def _decorations(fig) -> set:
    from matplotlib.text import Text

    out = {t for t in fig.findobj(Text) if t.axes is None and t.get_text() == fig.get_suptitle()}
    for ax in fig.axes:
        out.update({ax.title, ax.xaxis.label, ax.yaxis.label})
        if ax.get_legend() is not None:
            out.update(ax.get_legend().get_texts())
    for legend in fig.legends:
        out.update(legend.get_texts())
    return out


def _overlap(a, b, slack: float = 0.5) -> bool:
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > slack) and (min(a.y1, b.y1) - max(a.y0, b.y0) > slack)
