"""benchmarks/against_trainer_decoder.py: the papers' decoder pipeline (LLM-Adapters: Trainer +
DataCollatorForSeq2Seq) against peftlab padded and packed. What the comparison rests on, never its timings: every
side trains the same examples and tokens (the same count of real tokens and model FLOPs), the padding differs as
it should, the losses compare, pairs run side by side on swapped cores, the ratios pair runs made together."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import against_trainer_decoder, decoder_worker
from benchmarks.against_trainer_decoder import parse_pairs, summarize_task
from benchmarks.pairs import pair_schedule
from benchmarks.rerender import rerender
from conftest import needs_data
from peftlab.errors import PeftlabError

SETUPS = ("llm-adapters", "peftlab", "peftlab-packed")


def _only(path: Path, pattern: str) -> Path:
    found = sorted(path.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {path}, found {found}"
    return found[0]


def test_pairs_run_twice_with_the_cores_swapped():
    schedule = pair_schedule([("a", "b"), ("a", "c")], rounds=2, cores=(3, 5))
    assert len(schedule) == 2 * 2 * 2
    first, second = schedule[0], schedule[1]
    assert first["pair"] == second["pair"] == "a:b" and first["cores"] == {"a": 3, "b": 5}
    assert second["cores"] == {"a": 5, "b": 3}  # the same pair, cores swapped
    assert [e["round"] for e in schedule] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_setups_pairs_and_tasks_are_checked():
    assert parse_pairs(None) == [("llm-adapters", "peftlab"), ("llm-adapters", "peftlab-packed"),
                                 ("peftlab", "peftlab-packed")]
    with pytest.raises(PeftlabError, match="unknown setup 'peftlab-fast'"):
        parse_pairs("llm-adapters:peftlab-fast")
    with pytest.raises(PeftlabError, match="two different setups"):
        parse_pairs("peftlab:peftlab")


def test_cli_refuses_glue_tasks_and_threads(capsys, tmp_path):
    assert against_trainer_decoder.cli_main(["--tasks", "math,rte", "--out-dir", str(tmp_path)]) == 2
    assert "unknown decoder task 'rte'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one thread per run, one core each: there is no --threads to give
        against_trainer_decoder.cli_main(["--threads", "2"])
    assert "unrecognized arguments: --threads" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_summary_pairs_only_runs_made_together():
    def run(setup, orientation, tokens_per_s, pair="llm-adapters:peftlab-packed", flops=100):
        return {"task": "math", "setup": setup, "round": 0, "orientation": orientation, "pair": pair,
                "status": "ok", "tokens_per_s": tokens_per_s, "train_s": 1000 / tokens_per_s,
                "train_real_tokens": 1000, "train_token_slots": 1400 if setup == "llm-adapters" else 1000,
                "train_loss": 2.0, "probe_loss": 1.5, "model_flops": {"total": flops}, "model_gflops": 10.0,
                "gemm_peak": {"peak_gflops": 40.0}}

    runs = [run("llm-adapters", 0, 100.0), run("peftlab-packed", 0, 150.0),
            run("llm-adapters", 1, 50.0), run("peftlab-packed", 1, 100.0)]
    summary = summarize_task(runs, "math", ["llm-adapters:peftlab-packed"])
    ratio = summary["pairs"]["llm-adapters:peftlab-packed"]["tokens_per_s_ratio"]
    assert ratio["n"] == 2 and math.isclose(ratio["geomean"], math.sqrt(1.5 * 2.0))  # per orientation, then geomean
    assert summary["pairs"]["llm-adapters:peftlab-packed"]["same_tokens_and_flops"] is True
    assert summary["setups"]["llm-adapters"]["slots_per_real_token"] == 1.4
    assert summary["setups"]["peftlab-packed"]["of_peak"] == 0.25
    runs[1]["model_flops"] = {"total": 99}  # a side that trained other examples is flagged
    assert summarize_task(runs, "math", ["llm-adapters:peftlab-packed"])["pairs"]["llm-adapters:peftlab-packed"][
        "same_tokens_and_flops"] is False


def _spec(tmp_path, setup: str) -> dict:
    from conftest import DATA_DIR

    return {"task": "math", "setup": setup, "model": "tiny-llama", "train_examples": 12, "epochs": 1,
            "max_length": 512, "batch_size": 4, "rank": 4, "alpha": 8, "dropout": 0.0, "lr": 3e-4,
            "warmup_ratio": 0.0, "max_grad_norm": 1.0, "mixed_precision": "no", "data_dir": str(DATA_DIR),
            "probe_examples": 8, "seed": 0, "eval_set": "gsm8k", "run_dir": str(tmp_path / setup), "logging_steps": 1}


@pytest.mark.slow
@needs_data("math", "math_data.json")
def test_every_setup_trains_the_same_examples_and_tokens(tmp_path, monkeypatch, single_thread):
    monkeypatch.setattr(decoder_worker, "PEAK_SIZES", (32, 64))  # the probe's code path, not a measurement
    runs = {setup: decoder_worker.run_spec(_spec(tmp_path, setup)) for setup in SETUPS}
    real = {r["train_real_tokens"] for r in runs.values()}
    assert len(real) == 1 and {r["lengths_real_tokens"] for r in runs.values()} == real  # the same tokens
    flops = {r["model_flops"]["total"] for r in runs.values()}
    assert len(flops) == 1 and all(r["model_flops"]["backward"] > 0 for r in runs.values())  # and the same model work
    for setup, run in runs.items():
        assert run["status"] in ("ok", "no_learning"), setup
        assert run["examples"] == 12 and run["optimizer_steps"] == 3 and run["torch_threads"] == 1
        assert run["tokens_per_s"] == pytest.approx(run["train_real_tokens"] / run["train_s"])
        assert math.isfinite(run["train_loss"]) and math.isfinite(run["probe_loss"])
        assert run["gemm_peak"]["peak_gflops"] > 0
    # Padding: to the longest rounded up to 8 at random (LLM-Adapters), to the longest of similar lengths
    # (peftlab), none (packed).
    slots = {setup: r["train_token_slots"] for setup, r in runs.items()}
    assert slots["llm-adapters"] % 8 == 0 and slots["llm-adapters"] > slots["peftlab-packed"]
    assert slots["peftlab"] >= slots["peftlab-packed"] == runs["peftlab-packed"]["train_real_tokens"]
    assert runs["peftlab-packed"]["packing"] is True and runs["peftlab"]["packing"] is False
    executed = {setup: r["model_flops"]["executed_per_model_flop"] for setup, r in runs.items()}
    assert executed["peftlab-packed"] == 1.0  # no padding, each example attending on its own
    for setup in ("llm-adapters", "peftlab"):  # padding costs FLOPs where it adds slots
        assert (executed[setup] > 1.0) == (slots[setup] > runs[setup]["train_real_tokens"]), setup
    assert runs["llm-adapters"]["lora_b_abs_sum"] > 0  # the Trainer really stepped
    # Losses compare: the same examples, the same loss definition; after 3 tiny steps every side is still near
    # the random model's ln(vocabulary) and within a hair of the others.
    probes = [r["probe_loss"] for r in runs.values()]
    assert max(probes) - min(probes) < 0.01 * min(probes)
    losses = [r["train_loss"] for r in runs.values()]
    assert max(losses) - min(losses) < 0.01 * min(losses)


@pytest.mark.slow
@needs_data("math", "math_data.json")
def test_against_trainer_math_runs_a_pair_side_by_side(tmp_path):
    status = against_trainer_decoder.cli_main(["--tasks", "math", "--model", "tiny-llama", "--train-examples", "8",
                                               "--batch-size", "4", "--max-length", "512", "--rank", "4",
                                               "--pairs", "llm-adapters:peftlab-packed", "--out-dir", str(tmp_path),
                                               "--quiet"])
    assert status == 0
    result = json.loads(_only(tmp_path, "against-trainer-math-*.json").read_text())
    assert result["kind"] == "against_trainer_decoder" and len(result["runs"]) == 4
    by_orientation = {}
    for run in result["runs"]:
        assert run["status"] in ("ok", "no_learning"), run.get("error")
        assert run["affinity"] == [run["core"]] and run["torch_threads"] == 1  # pinned, one thread
        by_orientation.setdefault(run["orientation"], {})[run["setup"]] = run["core"]
    assert by_orientation[0]["llm-adapters"] == by_orientation[1]["peftlab-packed"]  # cores swapped
    assert by_orientation[0]["llm-adapters"] != by_orientation[0]["peftlab-packed"]  # side by side, one core each
    (summary,) = result["summary"]
    pair = summary["pairs"]["llm-adapters:peftlab-packed"]
    assert pair["tokens_per_s_ratio"]["n"] == 2 and pair["same_tokens_and_flops"] is True
    markdown = _only(tmp_path, "against-trainer-math-*.md").read_text()
    assert "| math | llm-adapters | 2 |" in markdown and "| math | llm-adapters:peftlab-packed |" in markdown
    assert rerender(_only(tmp_path, "against-trainer-math-*.json")) == markdown
