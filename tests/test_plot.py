"""`peftlab plot`: every kind of figure from a small synthetic store (heatmap, KaSA sigma, curves, rank)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from peftlab.cli.main import main
from peftlab.config import TrainConfig, build_config
from peftlab.errors import PeftlabError
from peftlab.lab.figures import key_value
from peftlab.lab.figures_sigma import parse_module
from peftlab.lab.plot import make_plot
from peftlab.lab.records import load_rows
from peftlab.lab.store import Store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(cfg: dict, accuracy: float, status: str, rng: random.Random) -> dict:
    epochs = [{"epoch": e, "train_loss": 0.7 - 0.1 * e + rng.random() * 0.01,
               "metrics": {"accuracy": accuracy - 0.03 * (cfg["epochs"] - e)}, "seconds": 1.0}
              for e in range(1, cfg["epochs"] + 1)]
    result = {"schema_version": 1, "status": status, "status_reason": None if status == "ok" else status,
              "task": cfg["task"], "method": cfg["method"], "seed": cfg["seed"], "config": cfg,
              "primary_metric": "accuracy", "epochs_log": epochs, "best": {"epoch": cfg["epochs"],
                                                                          "metrics": {"accuracy": accuracy}},
              "final": {"metrics": {"accuracy": accuracy}}, "before": None,
              "trainable_params": {"adapter": 100 * cfg["rank"], "head": 66, "total": 100 * cfg["rank"] + 66}}
    if cfg["method"] == "kasa":
        result["kasa_sigma"] = {f"bert.encoder.layer.{layer}.attention.self.{proj}":
                                [rng.gauss(0, 0.01) for _ in range(cfg["rank"])]
                                for layer in range(2) for proj in ("query", "value")}
    return result


def add_grid(store, rng, make_result, *, tasks, lrs, epochs: int, bad_status: str) -> None:
    """A fake sweep in ``store``: tasks x {lora, kasa} x lrs x lambda {1, 4} x rank {4, 8} x 2 seeds; the run at
    the largest lr, lambda 4, seed 0 ends with ``bad_status``."""
    for task in tasks:
        for method in ("lora", "kasa"):
            for lr in lrs:
                for ratio in (1.0, 4.0):
                    for rank in (4, 8):
                        for seed in range(2):
                            cfg = build_config(TrainConfig, overrides=dict(
                                model="tiny-bert", task=task, method=method, lr=lr, lr_ratio=ratio, rank=rank,
                                seed=seed, epochs=epochs)).to_dict()
                            acc = 0.6 + 0.02 * math.log2(ratio) + rng.gauss(0, 0.01)
                            status = bad_status if (lr == max(lrs) and ratio == 4.0 and seed == 0) else "ok"
                            store.add(cfg, result=make_result(cfg, acc, status, rng))


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("plot") / "results.sqlite"
    with Store(path) as store:
        add_grid(store, rng, _result, tasks=("rte", "mrpc"), lrs=(1e-4, 1e-3), epochs=2, bad_status="collapsed")
        failed = build_config(TrainConfig, overrides=dict(model="tiny-bert", task="rte", lr=1e-3, lr_ratio=4.0,
                                                          rank=8, seed=1, epochs=2, method="dora")).to_dict()
        store.add(failed, status="failed", error="RuntimeError: boom")
    return path


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


@pytest.mark.parametrize("kind, options", [
    ("heatmap", dict(where="rank=8,method=lora")),
    ("heatmap", dict(x="lr", y="v_lr", where="rank=8")),
    ("sigma", dict(where="method=kasa,lr=1e-3,lr_ratio=4")),
    ("curves", dict(where="rank=8,lr=1e-3,method=lora")),
    ("rank", dict(where="lr=1e-4,lr_ratio=4")),
])
def test_each_kind_makes_a_png(store_path, tmp_path, kind, options):
    out = make_plot(load_rows([store_path]), kind=kind, out=tmp_path / f"{kind}.png", **options)
    assert_png(out)


def test_cli_plot_pdf(store_path, tmp_path, capsys):
    out = tmp_path / "figure.pdf"
    assert main(["plot", str(store_path), "--kind", "heatmap", "--x", "lr", "--y", "lr_ratio",
                 "--where", "rank=4", "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"%PDF") and f"wrote {out}" in capsys.readouterr().out


def test_plot_errors(store_path, tmp_path, capsys):
    rows = load_rows([store_path])
    with pytest.raises(PeftlabError, match="no run in the selection has kasa_sigma"):
        make_plot(rows, kind="sigma", out=tmp_path / "s.png", where="method=lora")
    with pytest.raises(PeftlabError, match="--out must end in .png, .pdf, .svg"):
        make_plot(rows, kind="rank", out=tmp_path / "s.jpg")
    with pytest.raises(PeftlabError, match="unknown key 'lr_rato' for --y.*did you mean 'lr_ratio'"):
        make_plot(rows, kind="heatmap", out=tmp_path / "h.png", y="lr_rato")
    with pytest.raises(PeftlabError, match="configs"):
        make_plot(rows, kind="curves", out=tmp_path / "c.png")  # 16 configs: asks for --where
    assert main(["plot", str(tmp_path / "none.sqlite"), "--kind", "rank", "--out", str(tmp_path / "r.png")]) == 2
    assert "results store not found" in capsys.readouterr().err


def test_helpers():
    assert parse_module("base_model.model.bert.encoder.layer.3.attention.self.value") == (3, "v")
    assert parse_module("model.layers.11.self_attn.q_proj") == (11, "q")
    assert parse_module("roberta.encoder.layer.0.attention.output.dense") == (0, "o")
    assert key_value({"lr": 1e-4, "lr_ratio": 4.0}, "v_lr") == 4e-4
    assert key_value({"lr": 3e-4, "lr_ratio": 1 / 3}, "v_lr") == pytest.approx(1e-4)


# --------------------------------------------------------------------------- what the figures show


def _fig_store(path: Path, specs: list[dict], *, metric: str = "accuracy", epochs: int = 2,
               extra=None) -> list[dict]:
    """A store of ok runs; each spec: config overrides + ``value`` (+ ``result`` keys to add); returns its rows."""
    rng = random.Random(1)
    with Store(path) as store:
        for spec in specs:
            spec = dict(spec)
            value, more = spec.pop("value"), spec.pop("result", {})
            cfg = build_config(TrainConfig, overrides=dict(model="tiny-bert", epochs=epochs, **spec)).to_dict()
            result = _result(cfg, value, "ok", rng)
            if metric != "accuracy":
                result["primary_metric"] = metric
                for section in (result["best"], result["final"], *result["epochs_log"]):
                    section["metrics"] = {metric: section["metrics"]["accuracy"]}
            result.pop("kasa_sigma", None)
            result.update(more)
            store.add(cfg, result=result)
    return load_rows([path])


def _images(fig):
    return [(ax, image) for ax in fig.axes for image in ax.get_images()]


def _red_box(ax) -> tuple[int, int]:
    """(row, col) of the heatmap's red 'best' box."""
    import matplotlib.colors as mcolors

    boxes = [p for p in ax.patches if mcolors.to_hex(p.get_edgecolor()) == "#ff0000"]
    assert len(boxes) == 1
    x0, y0 = boxes[0].get_xy()
    return round(y0 + 0.5), round(x0 + 0.5)


def test_sigma_draws_the_learned_change_on_one_symmetric_scale(tmp_path):
    from peftlab.lab.figures_sigma import SIGMA_DELTA
    from peftlab.lab.plot import make_figure

    sigma = {f"bert.encoder.layer.{layer}.attention.self.{proj}": [0.5, -0.25, 0.125]
             for layer in range(2) for proj in ("query", "value")}
    # Same learned sigma on both tasks (the init dominates it); what training changed differs: +0.01*i vs -0.03.
    init = {"rte": {m: [v - 0.01 * (i + 1) for i, v in enumerate(vals)] for m, vals in sigma.items()},
            "mrpc": {m: [v + 0.03 for v in vals] for m, vals in sigma.items()}}
    specs = [dict(task=task, method="kasa", rank=3, seed=seed, value=0.6,
                  result={"kasa_sigma": sigma, "kasa_sigma_init": init[task]})
             for task in ("rte", "mrpc") for seed in range(2)]
    fig = make_figure(_fig_store(tmp_path / "s.sqlite", specs), kind="sigma")
    try:
        images = _images(fig)
        assert len(images) == 4  # 2 tasks x {q, v}
        by_task = {}
        for ax, image in images:
            task = "RTE" if ax.get_title().startswith("RTE") else "MRPC"
            by_task.setdefault(task, []).append(image.get_array().filled(float("nan")))
        import numpy as np

        for matrix in by_task["RTE"]:
            np.testing.assert_allclose(matrix, [[0.01, 0.02, 0.03]] * 2, atol=1e-12)
        for matrix in by_task["MRPC"]:
            np.testing.assert_allclose(matrix, [[-0.03] * 3] * 2, atol=1e-12)
        # diverging map centred at 0, limits symmetric and shared by every panel
        assert {image.get_cmap().name for _, image in images} == {"RdBu_r"}
        (vmin, vmax), = {image.get_clim() for _, image in images}
        assert vmin == -vmax == pytest.approx(-0.03)
        labels = [ax.get_ylabel() for ax in fig.axes if not ax.get_images() and ax.get_ylabel()]
        assert any(SIGMA_DELTA in label.replace("\n", " ") for label in labels)  # the colour bar
        assert SIGMA_DELTA in fig.get_suptitle().replace("\n", " ")
        assert "init not recorded" not in fig.get_suptitle()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_sigma_without_init_draws_sigma_and_says_so(store_path):
    import numpy as np

    from peftlab.lab.figures_sigma import SIGMA_NO_INIT
    from peftlab.lab.plot import make_figure

    rows = load_rows([store_path])  # the fixture's kasa runs have no kasa_sigma_init (an older peftlab)
    fig = make_figure(rows, kind="sigma", where="method=kasa,lr=1e-4,lr_ratio=1,rank=4,task=rte")
    try:
        images = _images(fig)
        assert len(images) == 2
        expected = np.mean([[row["result"]["kasa_sigma"][f"bert.encoder.layer.{layer}.attention.self.query"]
                             for layer in range(2)] for row in rows
                            if row["config"]["method"] == "kasa" and row["config"]["lr"] == 1e-4
                            and row["config"]["lr_ratio"] == 1 and row["config"]["rank"] == 4
                            and row["config"]["task"] == "rte"], axis=0)
        q = next(image for ax, image in images if " q " in ax.get_title())
        np.testing.assert_allclose(q.get_array(), expected)
        for ax, _ in images:
            assert SIGMA_NO_INIT in " ".join(ax.get_title().split())
        assert "init not recorded" in fig.get_suptitle()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


@pytest.mark.parametrize("metric, best", [("eval_loss", (0, 0)), ("accuracy", (1, 1))])
def test_heatmap_best_box_follows_the_metric_direction(tmp_path, metric, best):
    from peftlab.tasks.metrics import LOWER_IS_BETTER
    from peftlab.lab.plot import make_figure

    assert (metric in LOWER_IS_BETTER) == (metric == "eval_loss")
    values = {(1e-4, 1.0): 0.2, (1e-3, 1.0): 0.4, (1e-4, 4.0): 0.5, (1e-3, 4.0): 0.9}
    specs = [dict(task="rte", method="lora", lr=lr, lr_ratio=ratio, seed=seed, value=v)
             for (lr, ratio), v in values.items() for seed in range(2)]
    rows = _fig_store(tmp_path / "h.sqlite", specs, metric=metric)
    fig = make_figure(rows, kind="heatmap")
    try:
        (ax, image), = _images(fig)
        assert _red_box(ax) == best  # rows: lr_ratio 1, 4; columns: lr 1e-4, 1e-3
        bold = [t.get_text() for t in ax.texts if t.get_fontweight() == "bold"]
        assert bold == ([f"{0.2:.1f}"] if metric == "eval_loss" else [f"{90.0:.1f}"])
        assert ("lowest" in fig.get_suptitle()) == (metric == "eval_loss")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_heatmap_shares_one_colour_scale_per_task(store_path):
    from peftlab.lab.plot import make_figure

    fig = make_figure(load_rows([store_path]), kind="heatmap", where="rank=8")
    try:
        images = _images(fig)
        assert len(images) == 5  # {lora, kasa} x {rte, mrpc} + rte's failed dora run
        by_task = {}
        for ax, image in images:
            by_task.setdefault(ax.get_title().split("\n")[0], set()).add(image.get_clim())
        assert sorted(by_task) == ["MRPC", "RTE"] and all(len(c) == 1 for c in by_task.values())
        bars = [ax for ax in fig.axes if not ax.get_images() and ax.get_ylabel()]
        assert len(bars) == 2  # one colour bar per task
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_heatmap_folds_when_neither_axis_varies(tmp_path):
    from peftlab.lab.plot import make_figure

    values = {"lora": 0.70, "dora": 0.72, "kasa": 0.75}
    specs = [dict(task=task, method=method, lr=5e-4, lr_ratio=1.0, seed=seed, value=v + 0.1 * (task == "mrpc"))
             for task in ("rte", "mrpc") for method, v in values.items() for seed in range(2)]
    fig = make_figure(_fig_store(tmp_path / "f.sqlite", specs), kind="heatmap")
    try:
        images = _images(fig)
        assert len(images) == 2  # one panel per task, not one 1x1 heatmap per method and task
        for ax, image in images:
            assert image.get_array().shape == (3, 1)
            assert [t.get_text() for t in ax.get_yticklabels()] == ["dora", "kasa", "lora"]
            assert ax.get_ylabel() == "method"
            assert "lr_ratio=1" in ax.get_title()
            assert _red_box(ax) == (1, 0)  # kasa
        assert len({image.get_clim() for _, image in images}) == 2  # each task its own (shared by its methods)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_heatmap_with_seed_axis_says_one_run_per_cell(store_path):
    from peftlab.lab.plot import make_figure

    fig = make_figure(load_rows([store_path]), kind="heatmap", y="seed", where="rank=8,method=lora,lr_ratio=4")
    try:
        title = " ".join(fig.get_suptitle().split())
        assert "one run per cell" in title and "mean over seeds" not in title and "not in the mean" not in title
        fig_mean = make_figure(load_rows([store_path]), kind="heatmap", where="rank=8,method=lora")
        assert "mean over seeds" in fig_mean.get_suptitle()
    finally:
        import matplotlib.pyplot as plt

        plt.close("all")


@pytest.mark.parametrize("epochs", [1, 3])
def test_curves_have_whole_epoch_ticks(tmp_path, epochs):
    from peftlab.lab.plot import make_figure

    specs = [dict(task="rte", method=method, seed=seed, value=0.7) for method in ("lora", "kasa") for seed in range(2)]
    fig = make_figure(_fig_store(tmp_path / "c.sqlite", specs, epochs=epochs), kind="curves")
    try:
        fig.canvas.draw()
        for ax in fig.axes:
            lo, hi = sorted(ax.get_xlim())
            shown = [t.get_text() for t, loc in zip(ax.get_xticklabels(), ax.get_xticks()) if lo <= loc <= hi]
            assert shown == [str(e) for e in range(1, epochs + 1)]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
