"""benchmarks/against_trainer.py, sweep_overhead.py and decode.py: the structure of what they write
and the properties the comparisons rest on (never their timings): both Trainer setups train with the right
per-projection learning rates, their padding differs, decoding paths give the same texts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import against_trainer, decode, sweep_overhead, timing
from benchmarks.rerender import rerender
from conftest import needs_data

TIMING_KEYS = {"setup_s", "model_load_s", "data_s", "init_s", "train_s", "eval_s", "checkpoint_s", "result_s",
               "save_s", "started_unix", "finished_unix"}


def _only(path: Path, pattern: str) -> Path:
    found = sorted(path.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {path}, found {found}"
    return found[0]


# --------------------------------------------------------------------------- helpers (no model runs)


def test_paired_geomean_is_symmetric_and_needs_complete_pairs():
    ratio = timing.paired_geomean([2.0, 8.0], [1.0, 1.0])
    assert ratio["n"] == 2 and math.isclose(ratio["geomean"], 4.0) and ratio["min"] == 2.0 and ratio["max"] == 8.0
    inverse = timing.paired_geomean([1.0, 1.0], [2.0, 8.0])
    assert math.isclose(inverse["geomean"], 1 / 4.0)
    assert timing.paired_geomean([1.0], [1.0, 2.0]) is None
    assert timing.paired_geomean([1.0, None], [1.0, 2.0]) is None
    assert timing.geometric_mean([]) is None


def test_per_projection_groups_put_q_v_and_head_at_their_rates(tiny_model):
    from peft import LoraConfig, get_peft_model

    from benchmarks.trainer_worker import per_projection_groups

    model = get_peft_model(tiny_model("bert"), LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"],
                                                          modules_to_save=["classifier", "pooler.dense"]))
    groups = {g["name"]: g for g in per_projection_groups(model, 1e-3, 4.0, 5e-3)}
    assert {k: g["lr"] for k, g in groups.items()} == {"q": 1e-3, "v": 4e-3, "head": 5e-3}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(len(g["params"]) for g in groups.values()) == len(trainable)  # every trainable tensor, once
    assert len(groups["q"]["params"]) == len(groups["v"]["params"]) == 2 * 2  # lora_A, lora_B per layer


def test_pad_counter_counts_pad_slots():
    from benchmarks.worker import PadCounter

    counter = PadCounter(lambda features: {"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})
    counter([{}, {}])
    assert (counter.slots, counter.pads, counter.batches) == (6, 3, 1)


def test_summary_ratios_pair_runs_made_together():
    from benchmarks.against_trainer import summarize_task

    def run(pair, setup, round_, orientation, train_s, metric, digest="d"):
        return {"task": "rte", "pair": pair, "setup": setup, "round": round_, "orientation": orientation,
                "status": "ok", "train_s": train_s, "epochs": 1, "examples": 100, "examples_per_s": 100 / train_s,
                "optimizer_steps": 25, "train_examples_digest": digest, "dev_metrics": {"accuracy": metric}}

    runs = [run("pad128:peftlab", "pad128", 0, 0, 30.0, 0.6), run("pad128:peftlab", "peftlab", 0, 0, 10.0, 0.62),
            run("pad128:peftlab", "pad128", 0, 1, 40.0, 0.6), run("pad128:peftlab", "peftlab", 0, 1, 10.0, 0.58),
            run("longest:peftlab", "longest", 0, 0, 20.0, 0.6),  # its partner never finished: no ratio from it
            run("longest:peftlab", "peftlab", 1, 0, 10.0, 0.6, digest="other")]
    summary = summarize_task(runs, "rte", ["pad128:peftlab", "longest:peftlab"])
    pad = summary["pairs"]["pad128:peftlab"]
    assert pad["runs"] == 2 and pad["examples_per_s_ratio"]["n"] == 2
    assert math.isclose(pad["examples_per_s_ratio"]["geomean"], math.sqrt(3.0 * 4.0))  # 30/10 and 40/10, paired
    assert pad["same_examples_and_steps"] is True
    assert math.isclose(pad["sides"]["peftlab"]["dev_metric"], 0.60) and pad["sides"]["pad128"]["train_s"] == 35.0
    longest = summary["pairs"]["longest:peftlab"]
    assert longest["runs"] == 0 and longest["examples_per_s_ratio"] is None  # runs of different rounds never pair
    assert longest["same_examples_and_steps"] is None


def test_sweep_overhead_breakdown_adds_up():
    from benchmarks.sweep_overhead import breakdown, sweep_cells

    assert sweep_cells(10) == [(lam, seed) for lam in (1.0, 2.0, 4.0, 8.0, 16.0) for seed in (0, 1)]
    results = [{"timings": {"setup_s": 3.0, "model_load_s": 1.0, "data_s": 0.5, "init_s": 0.1, "train_s": 4.0,
                            "eval_s": 1.0, "checkpoint_s": 0.1, "result_s": 0.2, "save_s": 0.1,
                            "started_unix": 100.0 + 10 * i, "finished_unix": 109.0 + 10 * i}} for i in range(2)]
    out = breakdown(results, wall_s=25.0, sweep_start_unix=95.0)
    phases = {p["phase"]: p["seconds"] for p in out["phases"]}
    assert out["train_s"] == 8.0 and out["in_runs_s"] == 18.0 and math.isclose(out["overhead_share"], 1 - 8 / 25)
    assert math.isclose(phases["setup, other"], 2 * 1.4)
    assert math.isclose(phases["before the first run (process start, imports, spec, store)"], 5.0)
    assert math.isclose(phases["after the last run (tracker close, store, process exit)"], 95 + 25 - 119)
    assert math.isclose(phases["between runs (tracker close, store, log switch, the next run's config and imports)"],
                        110 - 109)
    assert math.isclose(sum(phases.values()), 25.0)  # every second of the wall time is in one phase


def test_pairs_and_tasks_are_checked_before_anything_runs(capsys, tmp_path):
    out = ["--out-dir", str(tmp_path)]
    assert against_trainer.cli_main(["--pairs", "pad128:fast", *out]) == 2
    assert "unknown setup 'fast'" in capsys.readouterr().err
    assert against_trainer.cli_main(["--pairs", "pad128", *out]) == 2  # a pair needs two sides
    assert "not two different setups" in capsys.readouterr().err
    assert against_trainer.cli_main(["--pairs", "llm-adapters:peftlab", *out]) == 2
    assert "decoder tasks" in capsys.readouterr().err
    assert against_trainer.cli_main(["--tasks", "rte,math", *out]) == 2
    assert "unknown GLUE task 'math'" in capsys.readouterr().err
    assert sweep_overhead.cli_main(["--runs", "99", *out]) == 2
    assert "--runs 99 is more than" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing was written


# --------------------------------------------------------------------------- end to end (subprocesses)


@pytest.mark.slow
@needs_data("glue", "RTE", "train.tsv")
def test_against_trainer_runs_every_pair_both_ways(tmp_path):
    status = against_trainer.cli_main(["--model", "tiny-bert", "--tasks", "rte", "--train-examples", "48",
                                       "--batch-size", "4", "--max-length", "64", "--rank", "4", "--repeats", "1",
                                       "--lr", "1e-3", "--lr-ratio", "4", "--out-dir", str(tmp_path), "--quiet"])
    assert status == 0
    result = json.loads(_only(tmp_path, "against-trainer-*.json").read_text())
    markdown = _only(tmp_path, "against-trainer-*.md").read_text()
    assert result["kind"] == "against_trainer"
    runs = result["runs"]
    # the default pairs, each run side by side on one core each and then with the cores swapped
    assert sorted((r["pair"], r["orientation"], r["setup"]) for r in runs) == sorted(
        (pair, orientation, setup) for pair in ("pad128:peftlab", "longest:peftlab")
        for orientation in (0, 1) for setup in pair.split(":"))
    for run in runs:
        assert run["status"] in ("ok", "no_learning"), run.get("error")
        assert run["examples"] == 48 and run["train_s"] > 0 and run["peak_rss_mb"] > 0
        assert run["torch_threads"] == 1 and run["optimizer_steps"] == 12
        assert run["dev_metrics"]["accuracy"] is not None
        lrs = {g["name"]: g["initial_lr"] for g in run["optimizer_groups"]}
        assert math.isclose(lrs["q"], 1e-3) and math.isclose(lrs["v"], 4e-3), (run["setup"], lrs)
        assert math.isclose(lrs["head"], 5e-4), (run["setup"], lrs)  # LoRA's default head lr on both sides
    for first, second in [(a, b) for a in runs for b in runs if a is not b and a["pair"] == b["pair"]
                          and a["orientation"] == b["orientation"]]:
        assert first["core"] != second["core"]  # the two sides of a pair never share a core
    trainer = [r for r in runs if r["setup"] in ("pad128", "longest")]
    for run in trainer:  # the Trainer really trained: the loss moved, LoRA's B left zero
        assert len(run["logged_losses"]) >= 2 and run["logged_losses"][0] != run["logged_losses"][-1]
        assert run["lora_b_abs_sum"] > 0
    pad128 = next(r for r in runs if r["setup"] == "pad128")
    longest = next(r for r in runs if r["setup"] == "longest")
    peftlab_run = next(r for r in runs if r["setup"] == "peftlab")
    assert pad128["train_token_slots"] == 48 * 64  # every example padded to T
    assert longest["train_pad_tokens"] < pad128["train_pad_tokens"]
    assert pad128["train_real_tokens"] == longest["train_real_tokens"] == peftlab_run["train_real_tokens"]
    assert set(peftlab_run["timings"]) >= TIMING_KEYS
    (summary,) = result["summary"]
    for pair in ("pad128:peftlab", "longest:peftlab"):
        entry = summary["pairs"][pair]
        assert entry["runs"] == 2 and entry["examples_per_s_ratio"]["n"] == 2
        assert entry["same_examples_and_steps"] is True
    assert "| rte | pad128:peftlab | 2 |" in markdown and "| rte | longest:peftlab | 2 |" in markdown
    assert rerender(_only(tmp_path, "against-trainer-*.json")) == markdown


@needs_data("glue", "RTE", "train.tsv")
def test_sweep_overhead_runs_a_real_sweep(tmp_path):
    status = sweep_overhead.cli_main(["--model", "tiny-bert", "--runs", "2", "--train-examples", "8",
                                      "--batch-size", "4", "--rank", "4", "--threads", "1", "--out-dir", str(tmp_path),
                                      "--quiet"])
    assert status == 0
    result = json.loads(_only(tmp_path, "sweep-overhead-*.json").read_text())
    assert result["kind"] == "sweep_overhead" and result["command"].startswith("sweep ")
    assert [(r["lr_ratio"], r["seed"]) for r in sorted(result["per_run"], key=lambda r: r["seed"])] == \
        [(1.0, 0), (1.0, 1)]
    for run in result["per_run"]:
        assert run["status"] in ("ok", "collapsed", "no_learning") and set(run["timings"]) >= TIMING_KEYS
        assert run["timings"]["setup_s"] >= run["timings"]["model_load_s"] + run["timings"]["data_s"]
    b = result["breakdown"]
    assert b["runs"] == 2 and 0 < b["train_s"] < b["in_runs_s"] < b["wall_s"] and 0 < b["overhead_share"] < 1
    assert math.isclose(sum(p["seconds"] for p in b["phases"]), b["wall_s"], rel_tol=1e-6)
    markdown = _only(tmp_path, "sweep-overhead-*.md").read_text()
    assert "overhead share" in markdown and "| training (train_s) |" in markdown
    assert rerender(_only(tmp_path, "sweep-overhead-*.json")) == markdown


# --------------------------------------------------------------------------- decoding


def test_decoding_paths_give_identical_texts(chatty_llama):
    from peftlab.tasks.instructions import encode_prompt

    model, tokenizer = chatty_llama
    questions = ["Hi", "What is 2+2? Think.", "A much longer question about cats and dogs, is it not?", "Why?",
                 "Tom has 3 apples and eats one. How many are left?"]
    prompts = [encode_prompt(tokenizer, q) for q in questions]
    texts = {(path, order): decode.decode(path, model, tokenizer, prompts, max_new_tokens=10, batch_size=2, order=order)
             for path in ("peftlab_loop", "generate_stop", "generate_plain") for order in ("by_length", "as_given")}
    reference = texts[("peftlab_loop", "by_length")]
    assert len(set(reference)) == len(prompts) and all(reference)  # varied, non-empty generations
    for key, got in texts.items():  # no answer becomes final here, so even the plain path stops alike
        assert got == reference, key


@needs_data("gsm8k", "test.jsonl")
def test_decode_bench_writes_every_configuration(tmp_path):
    status = decode.cli_main(["--model", "tiny-llama", "--problems", "3", "--batch-size", "2",
                              "--max-new-tokens", "4", "--repeats", "1", "--precision", "fp32", "--threads", "1",
                              "--out-dir", str(tmp_path), "--quiet"])
    assert status == 0
    result = json.loads(_only(tmp_path, "decode-*.json").read_text())
    assert result["kind"] == "decode" and result["settings"]["problems"] == 3
    labels = {r["label"] for r in result["rows"]}
    assert labels == {f"{p}/fp32/{o}" for p in ("peftlab_loop", "generate_stop", "generate_plain")
                      for o in ("by_length", "as_given")}
    for row in result["rows"]:
        assert row["error"] is None and row["seconds"]["n"] == 1 and len(row["texts"]) == 3
        assert row["same_texts_as_loop"] is not None and row["time_vs_generate_stop"]["n"] == 1
    markdown = _only(tmp_path, "decode-*.md").read_text()
    assert "| peftlab_loop | fp32 | by_length |" in markdown
    assert rerender(_only(tmp_path, "decode-*.json")) == markdown


# --------------------------------------------------------------------------- found while reading the sweep's path


@needs_data("glue", "RTE", "dev.tsv")
def test_glue_evaluation_leaves_the_accelerator_tracking_the_optimizer():
    """GLUE's evaluate once called accelerator.free_memory(loader), which also forgets the prepared model,
    optimizer and scheduler (fp16: clip_grad_norm_ would then clip still-scaled gradients) and runs gc."""
    from peftlab.config import TrainConfig
    from peftlab.resolve import build_run_config
    from peftlab.models.registry import load_model
    from peftlab.tasks.prepare import build_pipeline
    from peftlab.training.devices import make_accelerator

    cfg = build_run_config(overrides=dict(task="rte", model="tiny-bert", max_train_samples=8,
                                                   max_eval_samples=8, max_length=32, report_to="none"))
    model, tokenizer = load_model("tiny-bert", num_labels=2)
    pipeline = build_pipeline(cfg, tokenizer, model)
    accelerator = make_accelerator("no")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    metrics = pipeline.evaluate(model, accelerator, "epoch1").metrics
    assert "accuracy" in metrics
    assert accelerator._optimizers == [optimizer] and len(accelerator._models) == 1
    assert accelerator._dataloaders == []  # the eval loader itself is forgotten
