"""The lab around decoder runs: a sweep of GSM8K and Alpaca runs on a tiny Llama, its report, the divergence
guard on a causal-LM loss, and the micro bench on a decoder."""

from __future__ import annotations

import csv
import io
import json

import yaml

from peftlab.cli.main import main

from conftest import needs_data as _needs_data  # noqa: E402
from faults import inject_nan_at_step  # noqa: E402  (test-only fault injection)
needs_data = _needs_data("gsm8k", "test.jsonl")

TINY_DECODER = {"model": "tiny-llama", "method": "lora", "targets": "q,v", "rank": 4, "epochs": 1, "batch_size": 8,
                "max_length": 64, "max_train_samples": 8, "max_eval_samples": 4, "max_new_tokens": 8,
                "eval_batch_size": 4}


@needs_data
def test_decoder_sweep_and_report(tmp_path, capsys):
    root = tmp_path / "runs"
    spec = tmp_path / "decoders.yaml"
    spec.write_text(yaml.safe_dump({"output_dir": str(root), "base": TINY_DECODER,
                                    "grid": {"task": ["gsm8k", "alpaca"], "lr_ratio": [1, 2]}}))
    assert main(["sweep", str(spec)]) == 0
    results = [json.loads(p.read_text()) for p in root.rglob("result.json")]
    assert len(results) == 4 and {r["status"] for r in results} == {"ok"}
    assert {r["primary_metric"] for r in results if r["task"] == "alpaca"} == {"eval_loss"}
    assert all("generations" in r for r in results if r["task"] == "gsm8k")

    out = tmp_path / "report.csv"
    capsys.readouterr()
    assert main(["report", str(root / "results.sqlite"), "--format", "csv", "--out", str(out),
                 "--baseline", "lr_ratio=1"]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == 2  # lambda 1 and 2, one column per task
    header = rows[0].keys()
    assert any("gsm8k" in h for h in header) and any("alpaca" in h for h in header)
    for row in rows:
        assert row["gsm8k_n"] == row["alpaca_n"] == "1"
        assert float(row["alpaca_mean"]) > 0  # held-out loss of a random tiny model
        assert row["avg"] == ""  # no Avg of accuracy with eval_loss


@needs_data
def test_non_finite_causal_lm_loss_is_diverged(tmp_path, monkeypatch, capsys):
    inject_nan_at_step(monkeypatch, 0)
    out = tmp_path / "run"
    argv = ["train", "--task", "alpaca", "--output-dir", str(out)]
    for key, value in TINY_DECODER.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    assert main(argv) == 1
    result = json.loads((out / "result.json").read_text())
    assert result["status"] == "diverged" and "non-finite loss at step 0" in result["status_reason"]


def test_micro_bench_on_a_decoder(tmp_path):
    from benchmarks import micro

    assert micro.cli_main(["--model", "tiny-llama", "--methods", "lora,kasa", "--targets", "q,v", "--seq-len", "16",
                           "--batch-size", "2", "--warmup", "1", "--repeats", "2", "--init-repeats", "1",
                           "--threads", "1", "--out-dir", str(tmp_path), "--quiet"]) == 0
    result = json.loads(next(tmp_path.glob("micro-*.json")).read_text())
    assert [row["label"] for row in result["rows"]] == ["base", "lora[q,v]", "kasa[q,v]"]
    for row in result["rows"]:
        assert row["error"] is None, row["error"]
        assert row["train_step_s"]["median"] > 0


@needs_data
def test_gsm8k_generates_only_before_and_after_by_default(tmp_path):
    from peftlab.config import TrainConfig
    from peftlab.resolve import build_run_config
    from peftlab.training.loop import train

    cfg = build_run_config(overrides={**TINY_DECODER, "task": "gsm8k", "epochs": 2,
                                               "output_dir": str(tmp_path / "run")})
    assert cfg.eval_every == 0
    result = train(cfg)
    assert result["status"] == "ok"
    assert [e["metrics"] for e in result["epochs_log"]][0] == {}
    assert set(result["epochs_log"][1]["metrics"]) >= {"accuracy", "answered"}
    assert result["best"]["epoch"] == 2 and result["best"]["metrics"] == result["final"]["metrics"]
    assert result["generations"] == {"before": "generations_before.jsonl", "epoch2": "generations_epoch2.jsonl"}
    assert sorted(p.name for p in (tmp_path / "run").glob("generations_*.jsonl")) == [
        "generations_before.jsonl", "generations_epoch2.jsonl"]
