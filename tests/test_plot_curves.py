"""`peftlab plot --kind curves`: learning curves from step-level evaluations, median and quantile band over the
seeds that ended ok (never mean ± std, never outside the metric's range), failed-to-learn seeds drawn thin,
and runs without a curve drawn from their epoch ends, labelled so."""

from __future__ import annotations

import numpy as np
import pytest

from _plot_helpers import close_figures, make_store  # noqa: F401 - close_figures: an autouse fixture
from peftlab.errors import PeftlabError
from peftlab.lab.figures.curves import run_points
from peftlab.lab.plot import draw
from peftlab.lab.records import collect
from peftlab.tasks.table import SELECTION_PREFIX

# 5 seeds of one config, evaluated at epochs 0.5, 1, 1.5, 2 (a bimodal task: two seeds never leave ~0)
CURVES = {0: [0.30, 0.55, 0.70, 0.80], 1: [0.20, 0.50, 0.72, 0.81], 2: [0.35, 0.60, 0.75, 0.79],
          3: [0.01, 0.02, 0.025, 0.025], 4: [0.02, 0.03, 0.04, 0.05]}


def _stsb_runs(statuses=None) -> list[dict]:
    statuses = statuses or {}
    return [dict(task="stsb", seed=s, value=max(points), metric="pearson", curve=points,
                 status=statuses.get(s, "ok")) for s, points in CURVES.items()]


def test_band_is_the_quantiles_of_the_seeds_and_the_line_their_median(tmp_path):
    rows = make_store(tmp_path / "c.sqlite", _stsb_runs())
    for band, (q_low, q_high) in (("quartiles", (0.25, 0.75)), ("range", (0.0, 1.0))):
        drawn = draw(rows, kind="curves", band=band)
        (line,) = drawn.data.bands
        assert line.x == [0.5, 1.0, 1.5, 2.0]  # fractional epochs of the step-level curve
        values = np.array([CURVES[s] for s in sorted(CURVES)]) * 100  # seeds x points
        assert line.median == pytest.approx(list(np.median(values, axis=0)))
        assert line.low == pytest.approx(list(np.quantile(values, q_low, axis=0)))
        assert line.high == pytest.approx(list(np.quantile(values, q_high, axis=0)))
        assert line.n == [5] * 4 and line.epoch_ends_only == 0
        # the band never claims more than a seed reached (mean + std would: 62.6 + 42.1 at epoch 2)
        assert max(line.high) <= values.max() + 1e-9 <= 100
        ax = drawn.figure.axes[0]
        (poly,) = ax.collections
        band_y = np.concatenate([p.vertices[:, 1] for p in poly.get_paths()])
        assert band_y.min() >= min(line.low) - 1e-9 and band_y.max() <= max(line.high) + 1e-9


def test_failed_to_learn_seeds_are_thin_lines_outside_the_band(tmp_path):
    rows = make_store(tmp_path / "c.sqlite", _stsb_runs({3: "no_learning", 4: "collapsed"}))
    drawn = draw(rows, kind="curves")
    (line,) = drawn.data.bands
    ok = np.array([CURVES[s] for s in (0, 1, 2)]) * 100
    assert line.n == [3] * 4 and line.runs == 3
    assert line.median == pytest.approx(list(np.median(ok, axis=0)))
    assert line.low == pytest.approx(list(np.quantile(ok, 0.25, axis=0)))
    thin = {(t.seed, t.status): t.y for t in drawn.data.thin}
    assert set(thin) == {(3, "no_learning"), (4, "collapsed")}
    assert thin[(3, "no_learning")] == pytest.approx([v * 100 for v in CURVES[3]])
    ax = drawn.figure.axes[0]
    widths = sorted(round(ln.get_linewidth(), 2) for ln in ax.get_lines())
    assert widths == [0.8, 0.8, 1.4]  # the two failed seeds, then the median
    legend = [t.get_text().replace("\n", " ") for t in drawn.figure.legends[0].get_texts()]
    assert "1 run(s) collapsed: thin, not in the band" in legend
    assert "1 run(s) no_learning: thin, not in the band" in legend


def test_bands_stay_within_the_metric_range(tmp_path):
    # float noise above 1 (an accuracy of 1.0000001) and a correlation below -1 are clipped, not drawn
    runs = [dict(task="sst2", seed=s, value=1.0, curve=[0.9, 1.0000001 + 0.0000001 * s, 1.0, 1.0]) for s in range(3)]
    runs += [dict(task="stsb", seed=s, value=0.1, metric="pearson", curve=[-1.0000002, -0.5, 0.0, 0.1])
             for s in range(3)]
    drawn = draw(make_store(tmp_path / "r.sqlite", runs), kind="curves", band="range")
    assert drawn.data.ranges == {"sst2": (0.0, 100.0), "stsb": (-100.0, 100.0)}
    for line in drawn.data.bands:
        lo, hi = drawn.data.ranges[line.task]
        assert all(lo <= v <= hi for v in line.low + line.high + line.median)
    sst2 = next(b for b in drawn.data.bands if b.task == "sst2")
    assert sst2.high[1] == 100.0
    stsb = next(b for b in drawn.data.bands if b.task == "stsb")
    assert stsb.low[0] == -100.0


def test_step_axis_and_the_epoch_end_fallback(tmp_path):
    runs = [dict(task="rte", method="lora", seed=s, value=0.7, curve=[0.5, 0.6, 0.65, 0.7]) for s in range(3)]
    runs += [dict(task="rte", method="dora", seed=s, value=0.72, epoch_values=[0.6, 0.72]) for s in range(3)]
    rows = make_store(tmp_path / "s.sqlite", runs)
    drawn = draw(rows, kind="curves")
    lines = {b.label: b for b in drawn.data.bands}
    assert lines["method=lora"].x == [0.5, 1.0, 1.5, 2.0]
    assert lines["method=dora"].x == [1.0, 2.0] and lines["method=dora"].epoch_ends_only == 3
    assert lines["method=dora"].median == pytest.approx([60.0, 72.0])
    legend = [t.get_text().replace("\n", " ") for t in drawn.figure.legends[0].get_texts()]
    assert "method=dora (n=3; epoch ends only)" in legend and "method=lora (n=3)" in legend
    ax = drawn.figure.axes[0]
    assert ax.get_xlabel().startswith("epoch (fractional")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2"]
    with pytest.raises(PeftlabError, match="has no step-level curve.*--eval-steps"):
        draw(rows, kind="curves", curve_x="step")
    drawn = draw(rows, kind="curves", curve_x="step", where="method=lora")
    (line,) = drawn.data.bands
    assert line.x == [2.0, 4.0, 6.0, 8.0]  # optimizer steps
    assert drawn.figure.axes[0].get_xlabel() == "optimizer step"


def test_run_points_read_the_curve_else_the_epoch_log(tmp_path):
    rows = make_store(tmp_path / "p.sqlite", [dict(task="rte", seed=0, value=0.7, curve=[0.5, 0.6, 0.65, 0.7]),
                                              dict(task="rte", seed=1, value=0.7, epoch_values=[0.61, 0.7])])
    records, _ = collect(rows)
    by_seed = {r.seed: r for r in records}
    def flat(points):
        return [v for point in points for v in point]

    points, from_curve = run_points(by_seed[0], x="epoch", series="metric", scale=100)
    assert flat(points) == pytest.approx(flat([(0.5, 50.0), (1.0, 60.0), (1.5, 65.0), (2.0, 70.0)])) and from_curve
    points, from_curve = run_points(by_seed[1], x="epoch", series="metric", scale=100)
    assert flat(points) == pytest.approx(flat([(1.0, 61.0), (2.0, 70.0)])) and not from_curve
    points, _ = run_points(by_seed[0], x="epoch", series="train_loss", scale=100)
    assert flat(points) == pytest.approx(flat([(1.0, 0.6), (2.0, 0.5)]))  # train loss: epoch ends, unscaled


def test_loss_row_and_its_limits(tmp_path):
    rows = make_store(tmp_path / "l.sqlite", _stsb_runs())
    drawn = draw(rows, kind="curves", loss=True)
    assert {b.series for b in drawn.data.bands} == {"metric", "train_loss"}
    loss = next(b for b in drawn.data.bands if b.series == "train_loss")
    assert loss.x == [1.0, 2.0] and loss.median == pytest.approx([0.6, 0.5])
    assert drawn.figure.axes[1].get_ylabel() == "train loss (epoch end)"
    with pytest.raises(PeftlabError, match="--loss.*no step axis"):
        draw(rows, kind="curves", loss=True, curve_x="step")
    with pytest.raises(PeftlabError, match="takes no --x"):
        draw(rows, kind="curves", x="lr")


@pytest.mark.parametrize("epochs", [1, 3])
def test_curves_have_whole_epoch_ticks(tmp_path, epochs):
    runs = [dict(task="rte", method=method, seed=seed, value=0.7, epochs=epochs)
            for method in ("lora", "kasa") for seed in range(2)]
    drawn = draw(make_store(tmp_path / "c.sqlite", runs), kind="curves")
    fig = drawn.figure
    fig.canvas.draw()
    for ax in fig.axes:
        lo, hi = sorted(ax.get_xlim())
        shown = [t.get_text() for t, loc in zip(ax.get_xticklabels(), ax.get_xticks()) if lo <= loc <= hi]
        assert shown == [str(e) for e in range(1, epochs + 1)]


def test_a_run_with_a_selection_split_draws_that_splits_curve(tmp_path):
    """With --selection-samples the evaluations during training score the selection split alone (the test split
    is read once, after): the curve is drawn from those, and the title says which split it is."""
    rows = make_store(tmp_path / "sel.sqlite", _stsb_runs())
    for row in rows:
        row["result"]["selection"] = {"examples": 500, "stratified": True}
        for point in row["result"]["curve"] + row["result"]["epochs_log"]:
            point["metrics"] = {SELECTION_PREFIX + k: v for k, v in point.get("metrics", {}).items()}
    drawn = draw(rows, kind="curves")
    (line,) = drawn.data.bands
    values = np.array([CURVES[s] for s in sorted(CURVES)]) * 100
    assert line.median == pytest.approx(list(np.median(values, axis=0)))
    assert "selection-split evaluations during training" in drawn.figure._suptitle.get_text().replace("\n", " ")
    for row in rows:  # no point of the reported metric anywhere: one line, not a crash while drawing the legend
        for point in row["result"]["curve"] + row["result"]["epochs_log"]:
            point["metrics"] = {}
    with pytest.raises(PeftlabError, match=r"no run in the selection has a point of its metric \(pearson\)"):
        draw(rows, kind="curves")
