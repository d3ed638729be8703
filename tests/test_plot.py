"""`peftlab plot`: every kind of figure from a small synthetic store (heatmap, KaSA sigma, curves, rank)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from peftlab.cli import main
from peftlab.config import TrainConfig, build_config
from peftlab.errors import PeftlabError
from peftlab.plot import key_value, make_plot, parse_module
from peftlab.store import Store, load_rows

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


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("plot") / "results.sqlite"
    with Store(path) as store:
        for task in ("rte", "mrpc"):
            for method in ("lora", "kasa"):
                for lr in (1e-4, 1e-3):
                    for ratio in (1.0, 4.0):
                        for rank in (4, 8):
                            for seed in range(2):
                                cfg = build_config(TrainConfig, overrides=dict(
                                    model="tiny-bert", task=task, method=method, lr=lr, lr_ratio=ratio, rank=rank,
                                    seed=seed, epochs=2)).to_dict()
                                acc = 0.6 + 0.02 * math.log2(ratio) + rng.gauss(0, 0.01)
                                status = "collapsed" if (lr == 1e-3 and ratio == 4.0 and seed == 0) else "ok"
                                store.add(cfg, result=_result(cfg, acc, status, rng))
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
