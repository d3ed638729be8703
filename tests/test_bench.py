"""benchmarks/micro.py and benchmarks/e2e.py: the structure of what they write (never their timings), the
statistics, the batched KaSA regulariser the micro benchmark led to, scripts/gpu_bench.sh's refusal to run without
CUDA, and `peftlab bench` pointing to benchmarks/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import e2e, micro, timing
from benchmarks.rerender import rerender
from peftlab.cli.main import main
from peftlab.methods import kasa
from peftlab.config import KasaOptions
from peftlab.methods.table import MethodConfig, apply_method

ROOT = Path(__file__).resolve().parents[1]
RATIO_KEYS = {"train_vs_lora", "train_vs_base", "infer_unmerged_vs_base", "infer_merged_vs_base",
              "infer_unmerged_vs_lora", "peak_memory_vs_lora", "peak_memory_vs_base"}


def _only(path: Path, pattern: str) -> Path:
    found = sorted(path.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {path}, found {found}"
    return found[0]


@pytest.mark.slow
def test_micro_bench_writes_every_row_with_ratios(tmp_path, capsys):
    threads_before = torch.get_num_threads()
    status = micro.cli_main(["--model", "tiny-bert", "--methods", "lora,kasa", "--targets", "q,v",
                             "--targets", "q,k,v", "--seq-len", "16", "--batch-size", "2", "--warmup", "1",
                             "--repeats", "2", "--init-repeats", "1", "--threads", "1", "--out-dir", str(tmp_path),
                             "--quiet"])
    assert status == 0
    result = json.loads(_only(tmp_path, "micro-*.json").read_text())
    markdown = _only(tmp_path, "micro-*.md").read_text()
    assert result["kind"] == "micro" and result["partial"] is False
    assert result["settings"]["methods"] == ["lora", "kasa"]
    assert result["settings"]["targets"] == ["q,v", "q,k,v"]
    assert result["settings"]["rounds_timed"] == {"train": 2, "infer": 2, "infer_merged": 2}
    for key in ("torch", "transformers", "peft", "cpu_model", "device", "loadavg_start", "loadavg_end"):
        assert key in result["environment"]
    assert "profiler" in result["memory_method"]

    labels = [row["label"] for row in result["rows"]]
    assert labels == ["base", "lora[q,v]", "kasa[q,v]", "lora[q,k,v]", "kasa[q,k,v]"]
    for row in result["rows"]:
        assert row["error"] is None, row["error"]
        assert row["train_step_s"]["n"] == 2 and len(row["train_step_s"]["samples"]) == 2
        for key in ("infer_unmerged_s", "infer_merged_s"):
            assert row[key]["n"] == 2 and row[key]["median"] > 0 and row[key]["iqr"] >= 0
        assert row["examples_per_s"] > 0
        assert set(row["ratios"]) == RATIO_KEYS
        for key in ("train_vs_base", "infer_unmerged_vs_base", "infer_merged_vs_base"):
            assert row["ratios"][key]["median"] > 0 and row["ratios"][key]["n"] == 2
        assert row["memory"]["peak_mb"] >= row["memory"]["weights_mb"] > 0
        assert row["trainable_params"]["total"] > 0
        # model FLOP utilisation: FlopCounterMode's FLOPs of the step, over the median step, against the probe
        assert row["model_flops_unavailable"] is None and row["model_flops"]["tokens"] == 2 * 16
        assert row["model_flops"]["total"] == row["model_flops"]["forward"] + row["model_flops"]["backward"] > 0
        rate = row["model_flops"]["total"] / row["train_step_s"]["median"] / 1e9
        assert row["utilisation"]["model_gflops"] == pytest.approx(rate)
        assert row["utilisation"]["of_peak"] == pytest.approx(rate / result["gemm_peak"]["peak_gflops"])
        assert f"| {row['label']} |" in markdown
        if row["method"] == "base":
            assert row["init_s"] is None
            assert row["ratios"]["train_vs_lora"] is None
            assert row["ratios"]["train_vs_base"]["median"] == pytest.approx(1.0)
        else:
            assert row["init_s"]["n"] == 1 and row["merge_s"] is not None
            assert row["merge_max_abs_logit_diff"] < 1e-4  # merging changes no prediction
            assert row["ratios"]["train_vs_lora"]["median"] > 0
            assert row["ratios"]["peak_memory_vs_lora"] > 0
    lora = {row["targets"]: row for row in result["rows"] if row["method"] == "lora"}
    assert all(row["ratios"]["train_vs_lora"]["median"] == pytest.approx(1.0) for row in lora.values())
    # KaSA learns one singular value per rank on each adapted matrix on top of LoRA's A and B
    kasa_rows = {row["targets"]: row for row in result["rows"] if row["method"] == "kasa"}
    assert kasa_rows["q,v"]["trainable_params"]["adapter"] == lora["q,v"]["trainable_params"]["adapter"] + 2 * 2 * 8
    assert "× LoRA" in markdown and "merged × base" in markdown and "of GEMM peak" in markdown
    peak = result["gemm_peak"]
    assert peak["dtype"] == "float32" and peak["threads"] == 1 and [s["n"] for s in peak["sizes"]] == [512, 1024, 2048]
    assert f"GEMM peak: {peak['peak_gflops']:.1f} GFLOP/s" in markdown
    # LoRA does less backward work than full fine-tuning would, more than the frozen base with its head
    flops = {row["label"]: row["model_flops"] for row in result["rows"]}
    assert flops["base"]["backward"] < flops["lora[q,v]"]["backward"] < flops["lora[q,k,v]"]["backward"]
    assert flops["base"]["forward"] < flops["lora[q,v]"]["forward"] and flops["base"]["adapter"] == 0
    assert "wrote" in capsys.readouterr().out
    assert torch.get_num_threads() == threads_before  # --threads is restored afterwards


def test_e2e_bench_runs_both_data_paths(tmp_path):
    status = e2e.cli_main(["--tasks", "cola", "--model", "tiny-bert", "--max-train-samples", "16",
                           "--max-eval-samples", "16", "--batch-size", "8", "--max-length", "32", "--rank", "4",
                           "--threads", "1", "--out-dir", str(tmp_path), "--quiet"])
    assert status == 0
    result = json.loads(_only(tmp_path, "e2e-*.json").read_text())
    markdown = _only(tmp_path, "e2e-*.md").read_text()
    assert result["kind"] == "e2e"
    assert result["settings"]["max_train_samples"] == 16
    runs = {run["setup"]: run for run in result["runs"]}
    assert set(runs) == {"dynamic", "pad_to_max"}
    assert runs["pad_to_max"]["pad_to_max"] is True and runs["dynamic"]["pad_to_max"] is False
    for run in runs.values():
        assert run["status"] in ("ok", "no_learning") and run["task"] == "cola" and run["method"] == "lora"
        assert run["primary_metric"] == "matthews_correlation"
        assert run["final_metric"] is not None
        assert run["train_seconds_per_epoch"] > 0 and run["train_examples"] == 16
    (summary,) = result["summary"]
    assert summary["speedup_train"] > 0 and summary["metric_difference"] is not None
    padding = result["padding"]["cola"]
    assert padding["pad_to_max_token_slots"] == 16 * 32
    assert padding["real_tokens"] <= padding["dynamic_token_slots"] <= padding["pad_to_max_token_slots"]
    assert "| cola | lora | matthews_correlation |" in markdown
    assert rerender(_only(tmp_path, "e2e-*.json")) == markdown  # benchmarks/rerender.py rebuilds the same table
    assert result["settings"]["batch_size"] == 8 and result["settings"]["rank"] == 4  # peftlab train's own flags


def test_statistics():
    summary = timing.summarize([3.0, 1.0, 2.0, 10.0])
    assert summary["median"] == 2.5 and summary["n"] == 4 and summary["min"] == 1.0
    assert summary["q25"] == pytest.approx(1.75) and summary["q75"] == pytest.approx(4.75)
    assert summary["iqr"] == pytest.approx(3.0) and summary["mad"] == pytest.approx(1.0)
    assert summary["samples"] == [3.0, 1.0, 2.0, 10.0]  # in measurement order
    ratio = timing.paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 2.0])
    assert ratio["median"] == 2.0 and ratio["n"] == 3
    assert timing.paired_ratio([1.0], [1.0, 2.0]) is None
    assert timing.rotated([1, 2, 3], 4) == [2, 3, 1]


def test_unknown_method_is_one_line(capsys, tmp_path):
    assert micro.cli_main(["--methods", "lora,lorra", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown method 'lorra'" in err and err.startswith("benchmarks/micro.py: error:")
    assert e2e.cli_main(["--tasks", "cola,gsm8k", "--out-dir", str(tmp_path)]) == 2
    assert "unknown GLUE task 'gsm8k'" in capsys.readouterr().err


def test_each_benchmark_has_only_its_own_flags(capsys):
    with pytest.raises(SystemExit):  # the micro benchmark trains nothing end to end
        micro.cli_main(["--max-train-samples", "16"])
    assert "unrecognized arguments: --max-train-samples" in capsys.readouterr().err
    flags = {flag for action in e2e.make_parser()._actions for flag in action.option_strings}
    assert {"--lr-ratio", "--max-length", "--kasa-beta"} <= flags and "--seq-len" not in flags  # peftlab train's own
    assert {"--tasks", "--methods", "--seeds"} <= flags and not {"--task", "--method", "--seed"} & flags  # the cells


@pytest.mark.parametrize("argv, benchmark", [([], "micro.py"), (["--e2e", "--task", "cola"], "e2e.py"),
                                             (["--decode"], "decode.py"), (["--render=x.json"], "rerender.py")])
def test_peftlab_bench_points_to_the_benchmarks(argv, benchmark, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"python benchmarks/{benchmark} --help" in err


@pytest.mark.parametrize("model_type,targets", [("bert", ("q", "k", "v")), ("llama", ("q", "k", "v"))])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_batched_kasa_regulariser_matches_peft(model_type, targets, reduction, tiny_model):
    """kasa.regulariser (batched over same-shaped modules, module list cached) equals peft's per-module
    LoraModel._get_kasa_loss in value and gradient; Llama's GQA gives q and k/v different shapes (two groups)."""
    applied = apply_method(tiny_model(model_type), MethodConfig(method="kasa", targets=targets, rank=4,
                                                                kasa=KasaOptions(beta=0.3, gamma=0.7,
                                                                                 reduction=reduction)))
    model = applied.model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.1 * torch.randn_like(param))
    count = len(kasa.kasa_modules(model))
    assert count == 2 * len(targets)
    trainable = [p for p in model.parameters() if p.requires_grad]

    reference = model.base_model._get_kasa_loss() / (count if reduction == "mean" else 1)
    expected_grads = torch.autograd.grad(reference, trainable, allow_unused=True)
    for _ in range(2):  # the second call uses the cached plan
        value = kasa.regulariser(model, applied.method)
        torch.testing.assert_close(value, reference, rtol=1e-6, atol=1e-7)
        grads = torch.autograd.grad(value, trainable, allow_unused=True)
        for got, want in zip(grads, expected_grads):
            assert (got is None) == (want is None)
            if got is not None:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    groups = {tuple(m.lora_A["default"].weight.shape + m.lora_B["default"].weight.shape) for m in kasa.kasa_modules(model)}
    assert len(kasa.shape_groups(model)[0]) == len(groups)
    assert kasa.shape_groups(model)[0] is kasa.shape_groups(model)[0]  # cached while the adapters stay


def test_kasa_cache_follows_the_active_adapter(tiny_model):
    applied = apply_method(tiny_model("bert"), MethodConfig(method="kasa", targets=("q", "v"), rank=4))
    model = applied.model
    kasa.regulariser(model, applied.method)
    from peft import KasaConfig, LoraConfig

    model.add_adapter("second", LoraConfig(r=2, target_modules=["query"], kasa_config=KasaConfig(beta=1.0, gamma=0.0)))
    model.set_adapter("second")
    value = kasa.regulariser(model, MethodConfig(method="kasa", kasa=KasaOptions(reduction="sum")))
    torch.testing.assert_close(value, model.base_model._get_kasa_loss())


def test_gpu_script_refuses_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = tmp_path / "gpu"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), str(out)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], proc.stderr
    assert proc.stdout == "" and not out.exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_script_runs_random_models_only():
    text = (ROOT / "scripts" / "gpu_bench.sh").read_text()
    assert "pip install" not in text.replace("# Installs nothing", "")
    assert "--model roberta-base-random --seq-len 128 --batch-size 32" in text
    assert "--model llama3-8b-2l-random --seq-len 512 --batch-size 8" in text
    assert '"$py" benchmarks/micro.py --device cuda' in text and "peftlab.bench" not in text
