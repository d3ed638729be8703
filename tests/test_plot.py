"""`peftlab plot`: every kind of figure from a small synthetic store, the CLI, its errors, and the KaSA sigma
figure (what training changed, never the initialisation). Heatmaps: test_plot_heatmap.py; learning curves:
test_plot_curves.py; layout: test_plot_layout.py."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from _plot_helpers import close_figures, make_store  # noqa: F401 - close_figures: an autouse fixture
from peftlab.cli.main import main
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.lab.figures.paper import fmt_tick, key_value, metric_label, metric_range, with_defaults
from peftlab.lab.figures.sigma import SIGMA_DELTA, parse_module
from peftlab.lab.plot import KINDS, draw, make_plot
from peftlab.lab.records import load_rows
from peftlab.lab.store import Store
from fake_results import checked  # noqa: E402 - tests/ is on sys.path

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(cfg: dict, accuracy: float, status: str, rng: random.Random) -> dict:
    epochs = [{"epoch": e, "train_loss": 0.7 - 0.1 * e + rng.random() * 0.01,
               "metrics": {"accuracy": accuracy - 0.03 * (cfg["epochs"] - e)}, "seconds": 1.0}
              for e in range(1, cfg["epochs"] + 1)]
    curve = [{"step": 2 * (i + 1), "epoch": (i + 1) / 2, "epoch_end": i % 2 == 1,
              "metrics": {"accuracy": accuracy - 0.02 * (2 * cfg["epochs"] - i - 1)}}
             for i in range(2 * cfg["epochs"])]
    result = {"schema_version": 1, "status": status, "status_reason": None if status == "ok" else status,
              "task": cfg["task"], "method": cfg["method"], "seed": cfg["seed"], "config": cfg,
              "primary_metric": "accuracy", "majority_baseline": 0.5, "epochs_log": epochs, "curve": curve,
              "best": {"epoch": cfg["epochs"], "metrics": {"accuracy": accuracy}},
              "final": {"metrics": {"accuracy": accuracy}}, "before": None, "epochs_run": cfg["epochs"],
              "trainable_params": {"adapter": 100 * cfg["rank"], "head": 66, "total": 100 * cfg["rank"] + 66}}
    if cfg["method"] == "kasa":  # no kasa_sigma_init: a run of an older peftlab
        result["kasa_sigma"] = {f"bert.encoder.layer.{layer}.attention.self.{proj}":
                                [rng.gauss(0, 0.01) for _ in range(cfg["rank"])]
                                for layer in range(2) for proj in ("query", "value")}
    return checked(result)


def add_grid(store, rng, make_result, *, tasks, lrs, epochs: int, bad_status: str) -> None:
    """A fake sweep in ``store``: tasks x {lora, kasa} x lrs x lambda {1, 4} x rank {4, 8} x 2 seeds; the run at
    the largest lr, lambda 4, seed 0 ends with ``bad_status``."""
    for task in tasks:
        for method in ("lora", "kasa"):
            for lr in lrs:
                for ratio in (1.0, 4.0):
                    for rank in (4, 8):
                        for seed in range(2):
                            cfg = build_run_config(overrides=dict(
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
        failed = build_run_config(overrides=dict(model="tiny-bert", task="rte", lr=1e-3, lr_ratio=4.0,
                                                          rank=8, seed=1, epochs=2, method="dora")).to_dict()
        store.add(failed, status="failed", error="RuntimeError: boom")
    return path


@pytest.mark.parametrize("kind, options", [
    ("lr-grid", dict(where="rank=8,method=lora")),
    ("heatmap", dict(where="rank=8,method=lora")),
    ("heatmap", dict(x="lr", y="v_lr", where="rank=8,method=lora")),
    ("curves", dict(where="rank=8,lr=1e-3,method=lora")),
    ("rank", dict(where="lr=1e-4,lr_ratio=4")),
])
@pytest.mark.parametrize("suffix, magic", [(".png", PNG_MAGIC), (".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_each_kind_writes_png_pdf_and_svg(store_path, tmp_path, kind, options, suffix, magic):
    drawn = make_plot(load_rows([store_path]), kind=kind, out=tmp_path / f"{kind}{suffix}", **options)
    data = drawn.path.read_bytes()
    assert data.startswith(magic) and len(data) > 5000
    if suffix == ".svg":  # text stays text (svg.fonttype none): a paper's editor can restyle it
        assert "<text" in data.decode()


def test_cli_plot_pdf(store_path, tmp_path, capsys):
    out = tmp_path / "figure.pdf"
    assert main(["plot", str(store_path), "--kind", "lr-grid", "--where", "rank=4,method=lora", "--out", str(out)]) == 0
    assert out.read_bytes().startswith(b"%PDF") and f"wrote {out}" in capsys.readouterr().out
    assert set(KINDS) == {"lr-grid", "heatmap", "curves", "sigma", "rank"}


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
    assert main(["plot", str(store_path), "--kind", "sigma", "--where", "method=kasa",
                 "--out", str(tmp_path / "s.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lack kasa_sigma_init" in err and "fix:" in err


def test_helpers():
    assert parse_module("base_model.model.bert.encoder.layer.3.attention.self.value") == (3, "v")
    assert parse_module("model.layers.11.self_attn.q_proj") == (11, "q")
    assert parse_module("roberta.encoder.layer.0.attention.output.dense") == (0, "o")
    assert key_value({"lr": 1e-4, "lr_ratio": 4.0}, "v_lr") == 4e-4
    assert key_value({"lr": 3e-4, "lr_ratio": 1 / 3}, "v_lr") == pytest.approx(1e-4)
    assert [fmt_tick(v, "lr") for v in (5e-4, 1e-3, 1.6e-2, 0.1)] == ["5e-4", "1e-3", "1.6e-2", "1e-1"]
    assert fmt_tick(4.0, "lr_ratio") == "4" and fmt_tick(0.25) == "0.25"
    assert metric_range("accuracy") == (0.0, 1.0) and metric_range("pearson") == (-1.0, 1.0)
    assert metric_range("combined", "stsb") == (-1.0, 1.0) and metric_range("combined", "mrpc") == (0.0, 1.0)
    assert metric_range("eval_loss") is None
    assert metric_label(["accuracy"], 100) == "accuracy (%)" and metric_label(["pearson"], 100) == "pearson ×100"
    assert metric_label(["eval_loss"], 1) == "eval_loss"
    # an option a run predates counts as its default: old and new runs of one config group together
    new = build_run_config(overrides=dict(model="tiny-bert", task="rte")).to_dict()
    old = {k: v for k, v in new.items() if k != "eval_steps"}
    assert "eval_steps" in new and with_defaults(old) == with_defaults(new)


def test_pruned_trials_are_left_out_and_said_so(tmp_path):
    runs = [dict(task="rte", lr=lr, lr_ratio=ratio, seed=s, value=0.6 + 0.01 * s)
            for lr in (1e-3, 2e-3) for ratio in (1.0, 2.0) for s in range(2)]
    runs.append(dict(task="rte", lr=1e-3, lr_ratio=1.0, seed=5, value=0.99, status="pruned",
                     result={"stopped_early": True, "epochs_run": 1}))
    drawn = draw(make_store(tmp_path / "p.sqlite", runs), kind="lr-grid")
    (panel,) = drawn.data.panels
    assert int(panel.n_ok.sum() + panel.n_failed.sum()) == 8  # the trial is in no cell
    assert drawn.notes == ["left out 1 pruned tune trial(s): incomplete runs"]


# --------------------------------------------------------------------------- KaSA sigma


def _sigma_runs(init: dict | None) -> list[dict]:
    sigma = {f"bert.encoder.layer.{layer}.attention.self.{proj}": [0.5, -0.25, 0.125]
             for layer in range(2) for proj in ("query", "value")}
    runs = []
    for task in ("rte", "mrpc"):
        for seed in range(2):
            extra = {"kasa_sigma": sigma}
            if init is not None:
                extra["kasa_sigma_init"] = init[task](sigma)
            runs.append(dict(task=task, method="kasa", rank=3, seed=seed, value=0.6, result=extra))
    return runs


def test_sigma_draws_the_learned_change_on_one_symmetric_scale(tmp_path):
    # Same learned sigma on both tasks (the init dominates it); what training changed differs: +0.01*i vs -0.03.
    init = {"rte": lambda sigma: {m: [v - 0.01 * (i + 1) for i, v in enumerate(vals)] for m, vals in sigma.items()},
            "mrpc": lambda sigma: {m: [v + 0.03 for v in vals] for m, vals in sigma.items()}}
    drawn = draw(make_store(tmp_path / "s.sqlite", _sigma_runs(init)), kind="sigma")
    fig = drawn.figure
    by_task = {}
    for panel in drawn.data.panels:
        by_task.setdefault(panel.task, []).append(panel.matrix)
    for matrix in by_task["rte"]:
        np.testing.assert_allclose(matrix, [[0.01, 0.02, 0.03]] * 2, atol=1e-12)
    for matrix in by_task["mrpc"]:
        np.testing.assert_allclose(matrix, [[-0.03] * 3] * 2, atol=1e-12)
    assert drawn.data.init_size == pytest.approx(np.mean(np.abs(
        [v for t in ("rte", "mrpc") for vals in init[t](_sigma_runs(None)[0]["result"]["kasa_sigma"]).values()
         for v in vals])))
    images = [(ax, image) for ax in fig.axes for image in ax.get_images()]
    assert len(images) == 4  # 2 tasks x {q, v}
    for ax, image in images:  # the drawn pixels are the data's matrices
        task = "rte" if ax.get_title().startswith("RTE") else "mrpc"
        np.testing.assert_allclose(image.get_array(), by_task[task][0], atol=1e-12)
    assert {image.get_cmap().name for _, image in images} == {"RdBu_r"}
    (vmin, vmax), = {image.get_clim() for _, image in images}
    assert vmin == -vmax == pytest.approx(-0.03)
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and SIGMA_DELTA in bars[0].get_ylabel().replace("\n", " ")
    title = " ".join(fig.get_suptitle().split())
    assert title.startswith(f"KaSA: {SIGMA_DELTA}") and "learned change" in title


def test_sigma_refuses_runs_without_their_initial_values(tmp_path, store_path):
    with pytest.raises(PeftlabError, match=r"4 of 4 selected KaSA runs lack kasa_sigma_init .*fix: re-run them"):
        draw(make_store(tmp_path / "n.sqlite", _sigma_runs(None)), kind="sigma")
    # one run without its init among runs with it: refused as well, never drawn as if learned
    runs = _sigma_runs({"rte": lambda s: s, "mrpc": lambda s: s})
    del runs[0]["result"]["kasa_sigma_init"]
    with pytest.raises(PeftlabError, match=r"1 of 4 selected KaSA runs lack kasa_sigma_init \(rte seed 0\)"):
        draw(make_store(tmp_path / "m.sqlite", runs), kind="sigma")
    rows = load_rows([store_path])  # the fixture's KaSA runs come from an older peftlab
    with pytest.raises(PeftlabError, match="lack kasa_sigma_init"):
        draw(rows, kind="sigma", where="method=kasa,rank=4,task=rte,lr=1e-4,lr_ratio=1")


def test_rank_over_a_tied_rate_draws_a_line_per_method_and_names_only_the_options_each_reads(tmp_path):
    """A study's rate search: the head rate tied to the module rate (head_lr = lr in every run) splits no line;
    KaSA's kasa_mode labels KaSA's lines only, and head-only's line names no targets."""
    runs = [dict(method=method, lr=lr, head_lr=lr, seed=seed, value=0.6 + lr * 10 + seed / 100, **extra)
            for method, extra in (("lora", {}), ("kasa", {"kasa_mode": "paper"}), ("kasa", {"kasa_mode": "reference"}),
                                  ("head", {"targets": ""}))
            for lr in (1e-4, 1e-3) for seed in (0, 1)]
    drawn = draw(make_store(tmp_path / "tied.sqlite", runs), kind="rank", x="lr")
    assert drawn.data.tied == ["head_lr"]
    assert sorted(line.label for line in drawn.data.lines) == [
        "method=head", "method=kasa targets=q,v kasa_mode=paper", "method=kasa targets=q,v kasa_mode=reference",
        "method=lora targets=q,v"]
    lora = next(line for line in drawn.data.lines if line.label == "method=lora targets=q,v")
    assert lora.xs == [1e-4, 1e-3] and lora.means == pytest.approx([100 * (0.601 + 0.005), 100 * (0.61 + 0.005)])
    assert drawn.figure.axes[0].get_xlabel().endswith("= head_lr")
    # one run whose head rate differs: head_lr is a config key of its own again
    untied = runs + [dict(method="lora", lr=1e-3, head_lr=5e-4, seed=0, value=0.5)]
    drawn = draw(make_store(tmp_path / "untied.sqlite", untied), kind="rank", x="lr")
    assert drawn.data.tied == [] and any("head_lr=5e-4" in line.label for line in drawn.data.lines)


def test_rank_shows_every_run_and_keeps_failed_runs_out_of_the_mean(store_path):
    from peftlab.lab.records import collect, parse_filter

    rows = load_rows([store_path])
    drawn = draw(rows, kind="rank", where="lr=1e-3,lr_ratio=4,task=rte")
    records, _ = collect(rows, where=parse_filter("lr=1e-3,lr_ratio=4,task=rte"))
    for line in drawn.data.lines:  # one per method; x = rank
        method = line.label.split("=")[1]
        for rank, mean in zip(line.xs, line.means):
            ok = [r.value * 100 for r in records if r.config["method"] == method and r.config["rank"] == rank
                  and r.status == "ok"]
            if not ok:  # dora's one run failed: no mean, no dot
                assert mean is None and rank not in line.ok
                continue
            assert mean == pytest.approx(np.mean(ok))
            assert sorted(v for _, v in line.ok[rank]) == pytest.approx(sorted(ok))
    lora = next(line for line in drawn.data.lines if line.label == "method=lora")
    assert [(seed, status) for seed, status, _ in lora.failed[8]] == [(0, "collapsed")]
    assert "runs not ok" in drawn.figure.get_suptitle()
