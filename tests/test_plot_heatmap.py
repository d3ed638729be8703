"""`peftlab plot --kind lr-grid` / `--kind heatmap`: the data each panel shows (means, counts, NaN where nothing
ran, failures apart), one colour scale per task, the best cell marked only where a paired CI says it is best,
and no one-row / one-column heatmap."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from _plot_helpers import close_figures, make_store  # noqa: F401 - close_figures: an autouse fixture
from peftlab.errors import PeftlabError
from peftlab.lab.figures.cells import HeatmapData
from peftlab.lab.figures.points import PointsData
from peftlab.lab.plot import draw

LRS = (5e-4, 1e-3, 2e-3)
RATIOS = (1.0, 2.0, 4.0)
SEEDS = (0, 1, 2)


def _value(lr: float, ratio: float, seed: int) -> float:
    """A smooth surface with seed offsets shared by every cell (rows are paired, as in a real sweep)."""
    return 0.6 + 0.02 * math.log2(lr / 5e-4) + 0.01 * math.log2(ratio) + 0.03 * seed


def _grid_runs(task: str = "rte", **extra) -> list[dict]:
    runs = [dict(task=task, lr=lr, lr_ratio=ratio, seed=seed, value=_value(lr, ratio, seed), **extra)
            for lr in LRS for ratio in RATIOS for seed in SEEDS]
    # the diagonal control beyond the grid: lambda = 1 at eta = 4e-3
    runs += [dict(task=task, lr=4e-3, lr_ratio=1.0, seed=seed, value=0.5 + 0.03 * seed, **extra) for seed in SEEDS]
    return runs


def _meshes(fig):
    from matplotlib.collections import QuadMesh

    return [(ax, c) for ax in fig.axes if ax.get_label() != "<colorbar>" for c in ax.collections
            if isinstance(c, QuadMesh)]


def _boxes(ax):
    """The (x0, y0) corners of the best-cell boxes drawn in ``ax`` (black outline, no fill)."""
    import matplotlib.colors as mcolors
    from matplotlib.patches import Rectangle

    return [p.get_xy() for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()
            and mcolors.to_hex(p.get_edgecolor()) == "#000000" and p.get_linewidth() > 1]


def test_lr_grid_cells_are_the_means_over_seeds_with_nan_where_nothing_ran(tmp_path):
    runs = _grid_runs()
    runs += [dict(task="rte", lr=2e-3, lr_ratio=8.0, seed=seed, value=0.5, status=status)  # eta_V 1.6e-2
             for seed, status in zip(SEEDS, ("collapsed", "no_learning", "ok"))]
    runs += [dict(task="rte", lr=1e-3, lr_ratio=16.0, seed=seed, value=0.5, status="diverged") for seed in SEEDS]
    drawn = draw(make_store(tmp_path / "s.sqlite", runs), kind="lr-grid")
    data = drawn.data
    assert isinstance(data, HeatmapData) and data.diagonal and len(data.panels) == 1
    (panel,) = data.panels
    xs, ys = list(panel.x.values), list(panel.y.values)
    assert xs == [5e-4, 1e-3, 2e-3, 4e-3]
    assert ys == pytest.approx([5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2])
    assert panel.x.log and panel.y.log
    expected = np.full((len(ys), len(xs)), np.nan)
    for lr in LRS:
        for ratio in RATIOS:
            expected[ys.index(pytest.approx(lr * ratio)), xs.index(lr)] = \
                np.mean([_value(lr, ratio, s) * 100 for s in SEEDS])
    expected[ys.index(pytest.approx(4e-3)), xs.index(4e-3)] = np.mean([50 + 3 * s for s in SEEDS])
    expected[ys.index(pytest.approx(1.6e-2)), xs.index(2e-3)] = 50.0  # the one seed that ended ok
    np.testing.assert_allclose(panel.mean, expected, equal_nan=True)  # NaN: never run, or nothing ended ok
    cell = (ys.index(pytest.approx(1.6e-2)), xs.index(2e-3))
    assert (panel.n_ok[cell], panel.n_failed[cell]) == (1, 2)
    assert panel.failed[cell] == {"collapsed": 1, "no_learning": 1}
    every_failed = (ys.index(pytest.approx(1.6e-2)), xs.index(1e-3))  # 1e-3 x 16
    assert math.isnan(panel.mean[every_failed]) and panel.n_failed[every_failed] == 3

    fig = drawn.figure
    (ax, mesh), = _meshes(fig)
    drawn_values = mesh.get_array()
    np.testing.assert_allclose(np.ma.filled(drawn_values, np.nan), expected, equal_nan=True)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["5e-4", "1e-3", "2e-3", "4e-3"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["5e-4", "1e-3", "2e-3", "4e-3", "8e-3", "1.6e-2"]
    texts = [t.get_text() for t in ax.texts]
    assert "50.0\n(1)\n2/3 ✗" in texts and "3/3 ✗" in texts  # mean, (n ok), k/N failed
    assert sum(1 for t in texts if t) == int(np.isfinite(expected).sum()) + 1  # blank cells: no text
    # the lambda = 1 diagonal: a dashed line on y = x
    (line,) = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert np.allclose(line.get_xdata(), line.get_ydata())


def test_one_colour_scale_per_task_and_a_colour_bar_per_panel(tmp_path):
    runs = [dict(r, rank=rank, value=r["value"] + (0.2 if r["task"] == "mrpc" else 0.0) + 0.01 * rank)
            for task in ("rte", "mrpc") for r in _grid_runs(task) for rank in (4, 8)]
    drawn = draw(make_store(tmp_path / "s.sqlite", runs), kind="lr-grid")
    data = drawn.data
    assert len(data.panels) == 4 and [p.task for p in data.panels if p.row == 0] == ["mrpc", "rte"]
    for task in ("rte", "mrpc"):  # the limits are the task's extremes over all its panels
        values = np.concatenate([p.mean[np.isfinite(p.mean)] for p in data.panels if p.task == task])
        assert data.limits[task] == pytest.approx((values.min(), values.max()))
    meshes = _meshes(drawn.figure)
    by_task = {}
    for ax, mesh in meshes:
        by_task.setdefault(ax.get_title().split("\n")[0], set()).add(mesh.get_clim())
    assert sorted(by_task) == ["MRPC", "RTE"] and all(len(c) == 1 for c in by_task.values())
    assert by_task["MRPC"] != by_task["RTE"]
    bars = [ax for ax in drawn.figure.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == len(meshes) == 4
    assert {ax.get_ylabel() for ax in bars} == {"accuracy (%)"}


def _two_cells(tmp_path, best: list[float], runner_up: list[float], *, metric="accuracy", failed_third=None):
    """A 2 x 2 lr x lr_ratio grid where cell (lr 1e-3, lambda 4) holds ``best`` and (1e-3, 2) ``runner_up``;
    the two other cells are far worse (or, with ``metric=eval_loss``, far higher)."""
    far = 0.1 if metric != "eval_loss" else 5.0
    values = {(1e-3, 4.0): best, (1e-3, 2.0): runner_up, (5e-4, 4.0): [far] * len(best),
              (5e-4, 2.0): [far] * len(best)}
    runs = [dict(task="rte", lr=lr, lr_ratio=ratio, seed=s, value=v, metric=metric)
            for (lr, ratio), vals in values.items() for s, v in enumerate(vals)]
    if failed_third:  # a third cell whose ok runs have the highest mean, but a seed collapsed
        runs += [dict(task="rte", lr=2e-3, lr_ratio=2.0, seed=s, value=v, metric=metric,
                      status="collapsed" if s == 0 else "ok") for s, v in enumerate(failed_third)]
    return draw(make_store(tmp_path / "b.sqlite", runs), kind="heatmap", scale=100 if metric != "eval_loss" else 1)


def _paired_ci(a, b):
    """95 % t interval of mean(a - b), written out with numpy (not the code path under test)."""
    d = np.asarray(a) - np.asarray(b)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d))
    return d.mean() - half, d.mean() + half


def test_best_cell_is_marked_when_the_paired_ci_excludes_zero(tmp_path):
    # seeds differ a lot (0.50 ... 0.90) but the best beats the runner-up by ~1 point at every seed:
    # unpaired, the cells overlap; paired, the CI is well above 0
    runner = [0.50, 0.60, 0.70, 0.80, 0.90]
    best = [v + d for v, d in zip(runner, (0.010, 0.012, 0.008, 0.011, 0.009))]
    drawn = _two_cells(tmp_path, best, runner)
    (panel,) = drawn.data.panels
    assert panel.best.marked
    ys, xs = list(panel.y.values), list(panel.x.values)
    assert panel.best.cell == (ys.index(4.0), xs.index(1e-3))
    assert panel.best.runner_up == (ys.index(2.0), xs.index(1e-3))
    low, high = _paired_ci([v * 100 for v in best], [v * 100 for v in runner])
    assert panel.best.ci == pytest.approx((low, high)) and low > 0 and panel.best.pairs == 5
    (ax, _), = _meshes(drawn.figure)
    (corner,) = _boxes(ax)
    edges_x, edges_y = panel.x.edges(), panel.y.edges()
    assert corner == pytest.approx((edges_x[xs.index(1e-3)], edges_y[ys.index(4.0)]))
    assert ax.get_title().split("\n", 1)[1].replace("\n", " ").startswith(
        "best, distinguishable from runner-up: +1.00 pt, 95\u00a0% CI")
    assert "best not distinguishable" not in drawn.figure.get_suptitle()


def test_best_cell_is_not_marked_when_the_ci_includes_zero(tmp_path):
    runner = [0.80, 0.81, 0.79, 0.80, 0.82]
    best = [0.83, 0.79, 0.82, 0.78, 0.835]  # mean higher by 0.3 points, differences of both signs
    drawn = _two_cells(tmp_path, best, runner)
    (panel,) = drawn.data.panels
    low, high = _paired_ci([v * 100 for v in best], [v * 100 for v in runner])
    assert low < 0 < high and panel.best.ci == pytest.approx((low, high))
    assert not panel.best.marked
    (ax, _), = _meshes(drawn.figure)
    assert _boxes(ax) == []
    assert not any(t.get_fontweight() == "bold" for t in ax.texts)
    assert "best not distinguishable" in ax.get_title().replace("\n", " ")
    assert "best not distinguishable in RTE" in " ".join(drawn.figure.get_suptitle().split())


def test_a_cell_with_a_failed_seed_is_never_the_best(tmp_path):
    runner = [0.50, 0.60, 0.70, 0.80, 0.90]
    best = [v + 0.01 for v in runner]
    drawn = _two_cells(tmp_path, best, runner, failed_third=[0.1, 0.95, 0.95, 0.95, 0.95])
    (panel,) = drawn.data.panels
    ys, xs = list(panel.y.values), list(panel.x.values)
    third = (ys.index(2.0), xs.index(2e-3))
    assert panel.mean[third] == pytest.approx(95.0)  # the highest mean of ok runs ...
    assert panel.best.cell == (ys.index(4.0), xs.index(1e-3))  # ... but not a candidate


def test_best_cell_of_a_lower_is_better_metric_is_the_lowest(tmp_path):
    runner = [2.0, 2.5, 3.0, 3.5]
    best = [v - 0.2 for v in runner]
    drawn = _two_cells(tmp_path, best, runner, metric="eval_loss")
    (panel,) = drawn.data.panels
    ys, xs = list(panel.y.values), list(panel.x.values)
    assert panel.best.marked and panel.best.cell == (ys.index(4.0), xs.index(1e-3))
    assert panel.best.difference == pytest.approx(0.2)
    bars = [ax for ax in drawn.figure.axes if ax.get_label() == "<colorbar>"]
    assert bars[0].get_ylabel().replace("\n", " ") == "eval_loss (lower is better)"


def test_a_single_eta_qk_is_drawn_as_lines_and_says_so(tmp_path, capsys):
    from peftlab.cli.main import main

    runs = [dict(task=task, lr=2e-3, lr_ratio=ratio, seed=s, value=_value(2e-3, ratio, s))
            for task in ("rte", "mrpc") for ratio in RATIOS for s in SEEDS]
    rows = make_store(tmp_path / "one.sqlite", runs)
    drawn = draw(rows, kind="lr-grid")
    assert isinstance(drawn.data, PointsData) and drawn.data.x == "v_lr"
    assert drawn.data.xs == pytest.approx([2e-3, 4e-3, 8e-3])
    assert _meshes(drawn.figure) == []  # no heatmap at all
    assert drawn.notes == ["one lr per panel (2e-3): drawn as lines over v_lr, not as a one-column heatmap"]
    assert drawn.notes[0] in " ".join(drawn.figure.get_suptitle().split())
    line = next(ln for ln in drawn.data.lines if ln.task == "rte")
    assert line.means == pytest.approx([np.mean([_value(2e-3, r, s) * 100 for s in SEEDS]) for r in RATIOS])
    assert [s for s, _ in sorted(line.ok[4e-3])] == list(SEEDS)
    assert [v for _, v in sorted(line.ok[4e-3])] == pytest.approx([_value(2e-3, 2.0, s) * 100 for s in SEEDS])
    ax = drawn.figure.axes[0]
    assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == ["2e-3", "4e-3", "8e-3"]
    assert main(["plot", str(tmp_path / "one.sqlite"), "--kind", "lr-grid", "--out", str(tmp_path / "g.png")]) == 0
    assert "note: one lr per panel (2e-3)" in capsys.readouterr().out


def test_configs_that_form_no_grid_are_left_out_beside_those_that_do_and_named(tmp_path):
    runs = _grid_runs() + [dict(task="rte", method="kasa", lr=2e-3, lr_ratio=1.0, seed=s, value=0.6) for s in SEEDS]
    rows = make_store(tmp_path / "m.sqlite", runs)
    drawn = draw(rows, kind="lr-grid")
    (panel,) = drawn.data.panels  # lora's grid; kasa's single cell is no heatmap
    assert (panel.row, panel.col) == (0, 0) and panel.subtitle == "method=lora"
    assert drawn.notes == ["left out, one lr or v_lr (no grid): method=kasa; draw them with --kind rank --x v_lr"]
    assert drawn.notes[0] in " ".join(drawn.figure.get_suptitle().split())
    assert len(_meshes(drawn.figure)) == 1
    only_cells = make_store(tmp_path / "c.sqlite", [dict(task="rte", method=m, lr=2e-3, seed=s, value=0.6)
                                                    for m in ("lora", "dora") for s in SEEDS])
    with pytest.raises(PeftlabError, match="every panel would be a single cell.*--kind rank --x method"):
        draw(only_cells, kind="lr-grid")
    with pytest.raises(PeftlabError, match="no grid to draw.*--kind rank --x method"):
        draw(only_cells, kind="heatmap")  # (folded: the methods as rows, one column)
    with pytest.raises(PeftlabError, match="lr-grid draws eta_QK.*takes no --x/--y"):
        draw(only_cells, kind="lr-grid", x="rank")


def test_a_folded_heatmap_has_the_configs_as_rows(tmp_path):
    runs = [dict(task="rte", method=method, lr=1e-3, lr_ratio=ratio, seed=s, value=v + 0.01 * ratio + 0.02 * s)
            for method, v in (("lora", 0.6), ("dora", 0.65), ("kasa", 0.7)) for ratio in (1.0, 4.0) for s in SEEDS]
    drawn = draw(make_store(tmp_path / "f.sqlite", runs), kind="heatmap")
    (panel,) = drawn.data.panels
    assert drawn.data.folded and panel.y.key == "config" and panel.y.labels == ("dora", "kasa", "lora")
    assert panel.x.values == (1.0, 4.0) and panel.mean.shape == (3, 2)
    assert panel.mean[1, 1] == pytest.approx(np.mean([(0.7 + 0.04 + 0.02 * s) * 100 for s in SEEDS]))
    assert panel.best.cell == (1, 1) and panel.best.marked  # kasa, lambda 4: +3 points at every seed
