"""End-to-end tests of `peftlab train`: tiny random models for the method x task matrix, MiniLM-L6 on real
data for one schema-validated run, the CLI and config precedence."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml

from peftlab.cli.main import main
from peftlab.config import TrainConfig, build_config
from peftlab.errors import PeftlabError
from peftlab.methods.table import METHODS
from peftlab.tasks.table import GLUE_TASKS
from peftlab.training.loop import train

LOCAL_TASKS = ("cola", "sst2", "mrpc", "rte", "stsb", "wnli")  # QNLI has no local train split
SCHEMA = json.loads(resources.files("peftlab").joinpath("schemas/result.schema.json").read_text())


def tiny_cfg(tmp_path: Path, **overrides) -> TrainConfig:
    values = dict(task="rte", model="tiny-bert", method="lora", targets="q,v", rank=4, epochs=1, batch_size=8,
                  max_length=32, max_train_samples=16, max_eval_samples=16, output_dir=str(tmp_path / "run"),
                  log_every=1)
    values.update(overrides)
    return build_config(TrainConfig, overrides=values)


def validate(result: dict) -> None:
    jsonschema.validate(result, SCHEMA)


def expected_status(result: dict) -> str:
    """The status a finished run's result.json must carry, recomputed from its own numbers by the rule of the
    contract (not by peftlab's code): diverged/collapsed stay; a run stopped early is pruned; a GLUE run that
    trained and whose best primary metric is <= majority + 0.05 (or <= its before-fine-tuning metric) is
    no_learning; else ok."""
    if result["status"] in ("diverged", "collapsed"):
        return result["status"]
    if result.get("stopped_early"):
        return "pruned"
    metric = result["primary_metric"]
    best = result["best"]["metrics"].get(metric)
    if result["task"] in GLUE_TASKS and result["epochs_run"] > 0 and best is not None:
        before = ((result.get("before") or {}).get("metrics") or {}).get(metric)
        if best <= result["majority_baseline"] + 0.05 or (before is not None and best <= before):
            return "no_learning"
    return "ok"


def assert_trained(result: dict) -> None:
    """The run trained to its end: ok or no_learning (tiny random models on 16 RTE examples usually learn
    nothing), and exactly the one its numbers call for."""
    assert result["status"] in ("ok", "no_learning"), (result["status"], result["status_reason"])
    assert result["status"] == expected_status(result), (result["status"], result["best"], result["majority_baseline"])
    assert (result["status_reason"] is None) == (result["status"] == "ok")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_on_rte(tmp_path, method):
    result = train(tiny_cfg(tmp_path, method=method, lr_ratio=2))
    validate(result)
    assert_trained(result)
    if METHODS[method].adapts_projections:
        assert result["group_lrs"]["v"] == pytest.approx(2 * result["group_lrs"]["q"])
    else:  # head-only: nothing but the head trains (lr_ratio from a sweep cell has nothing to act on)
        assert set(result["group_lrs"]) == {"head"} and result["targets"] == ""
    assert (tmp_path / "run" / "adapter").is_dir()
    on_disk = json.loads((tmp_path / "run" / "result.json").read_text())
    assert on_disk["final"] == json.loads(json.dumps(result["final"]))


@pytest.mark.parametrize("task", LOCAL_TASKS)
@pytest.mark.parametrize("method", ["lora", "kasa", "full"])
def test_core_methods_on_each_local_task(tmp_path, task, method):
    result = train(tiny_cfg(tmp_path, task=task, method=method))
    validate(result)
    metrics = result["final"]["metrics"]
    assert result["primary_metric"] in metrics
    if task == "stsb":
        assert {"pearson", "spearman"} <= set(metrics)


def test_epochs_zero_is_the_before_fine_tuning_row(tmp_path):
    result = train(tiny_cfg(tmp_path, epochs=0))
    validate(result)
    assert result["before"] is not None and "accuracy" in result["before"]["metrics"]
    assert result["epochs_log"] == [] and result["train_seconds"] == 0


def test_kasa_result_records_learned_singular_values(tmp_path):
    result = train(tiny_cfg(tmp_path, method="kasa", rank=3))
    assert result["kasa_sigma"] and all(len(v) == 3 for v in result["kasa_sigma"].values())
    assert len(result["kasa_sigma"]) == 4  # 2 layers x {q, v}
    # ... and their values at initialisation, so a figure can show what training changed
    init = result["kasa_sigma_init"]
    assert set(init) == set(result["kasa_sigma"]) and all(len(v) == 3 for v in init.values())
    assert any(init[m] != result["kasa_sigma"][m] for m in init)
    validate(result)
    # the regulariser is logged beside the task loss (it is part of what was optimised)
    assert all(e["train_regulariser"] > 0 for e in result["epochs_log"])
    lora = train(tiny_cfg(tmp_path / "lora", method="lora"))
    assert all("train_regulariser" not in e for e in lora["epochs_log"])


def _eval_texts(cfg):
    from peftlab.models.registry import load_tokenizer
    from peftlab.tasks.prepare import build_pipeline

    pipeline = build_pipeline(cfg, load_tokenizer(cfg.model), None)
    return pipeline, list(pipeline.eval_sets["validation"]["text_a"]), list(pipeline.train_dataset["input_ids"])


def test_max_eval_samples_scores_the_same_dev_examples_for_every_seed(tmp_path):
    a, a_eval, a_train = _eval_texts(tiny_cfg(tmp_path, seed=0, max_eval_samples=20, max_train_samples=20))
    b, b_eval, b_train = _eval_texts(tiny_cfg(tmp_path, seed=1, max_eval_samples=20, max_train_samples=20))
    assert len(a_eval) == 20 and a_eval == b_eval  # the training seed does not move the dev subset
    assert a_train != b_train  # ... it changes only training (here: which 20 training examples)
    _, other_eval, _ = _eval_texts(tiny_cfg(tmp_path, seed=0, eval_seed=1, max_eval_samples=20))
    assert other_eval != a_eval  # --eval-seed draws another subset
    assert a.extras["eval_examples_digest"] == b.extras["eval_examples_digest"]
    # end to end: two seeds record the same evaluation seed and the same evaluated examples
    first = train(tiny_cfg(tmp_path / "s0", seed=0, max_eval_samples=20))
    second = train(tiny_cfg(tmp_path / "s1", seed=1, max_eval_samples=20))
    validate(first)
    assert first["eval_seed"] == second["eval_seed"] == 0
    assert first["eval_examples_digest"] == second["eval_examples_digest"] == a.extras["eval_examples_digest"]
    assert first["num_eval_examples"] == 20


def test_bad_eval_seed_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "peftlab.cli.main", "train", "--eval-seed", "-1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--eval-seed must be an integer >= 0" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_qqp_trains_on_the_glue_subset_and_says_so(tmp_path):
    result = train(tiny_cfg(tmp_path, task="qqp"))
    validate(result)
    assert result["dataset"] == "glue_subsets"
    assert result["data_files"]["train"].endswith(str(Path("glue_subsets") / "QQP" / "train.json"))
    qnli = train(tiny_cfg(tmp_path / "qnli", task="qnli"))
    assert qnli["dataset"] == "glue_subsets"  # trained on the subset ...
    assert qnli["data_files"]["validation"].endswith(str(Path("glue") / "QNLI" / "dev.tsv"))  # ... real dev set
    sst2 = train(tiny_cfg(tmp_path / "sst2", task="sst2"))
    assert sst2["dataset"] == "glue"


def test_same_seed_same_metrics_on_cpu(tmp_path):
    first = train(tiny_cfg(tmp_path / "a", method="kasa", epochs=2))
    second = train(tiny_cfg(tmp_path / "b", method="kasa", epochs=2))
    assert first["epochs_log"][-1]["train_loss"] == second["epochs_log"][-1]["train_loss"]
    assert first["final"] == second["final"]


def test_config_yaml_then_flags_override(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"task": "mrpc", "model": "tiny-bert", "rank": 2, "lr-ratio": 8,
                                      "epochs": 1, "max_train_samples": 8, "max_eval_samples": 8,
                                      "max_length": 16, "output_dir": str(tmp_path / "out")}))
    assert main(["train", "--config", str(config), "--rank", "3", "--method", "dora"]) == 0
    saved = yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())
    assert saved["rank"] == 3 and saved["method"] == "dora" and saved["lr_ratio"] == 8 and saved["task"] == "mrpc"


def test_finished_run_is_not_overwritten_without_flag(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path)
    train(cfg)
    before = (tmp_path / "run" / "result.json").read_text()
    capsys.readouterr()  # drop the first run's progress output
    code = main(["train", "--model", "tiny-bert", "--max-train-samples", "8", "--max-eval-samples", "8",
                 "--output-dir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a finished run" in err[0] and "--overwrite" in err[0]
    assert (tmp_path / "run" / "result.json").read_text() == before


def test_cli_bad_input_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "peftlab.cli.main", "train", "--lr-ratio", "-1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--lr-ratio" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_minilm_real_data_end_to_end(tmp_path):
    """MiniLM-L6 on 400 real SST-2 sentences: a schema-valid result that beats the majority class."""
    result = train(build_config(TrainConfig, overrides=dict(
        task="sst2", model="minilm-l6", method="lora", targets="q,v", lr_ratio=4, epochs=2, batch_size=16,
        max_length=64, max_train_samples=400, max_eval_samples=200, output_dir=str(tmp_path / "run"))))
    validate(result)
    assert result["status"] == "ok"
    assert result["trainable_params"]["head"] == (384 * 384 + 384) + (384 * 2 + 2)  # pooler + classifier
    assert result["best"]["metrics"]["accuracy"] > result["majority_baseline"] + 0.1
    # the adapter names its base by the public Hub id (portable), the local path is kept beside it
    adapter = tmp_path / "run" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "sentence-transformers/all-MiniLM-L6-v2"
    local = json.loads((adapter / "peftlab_base.json").read_text())["local_path"]
    assert local and Path(local).is_dir() and "site-packages" in local
    from peftlab.training.evaluation import evaluate_run

    assert evaluate_run(tmp_path / "run") == pytest.approx(result["best"]["metrics"])  # still loads here


def test_glue_task_table_is_complete():
    assert set(GLUE_TASKS) == {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}


@pytest.mark.parametrize("eval_every, evaluated", [(1, [1, 2, 3]), (2, [2, 3]), (0, [3])])
def test_eval_every_skips_epochs_but_always_evaluates_the_last(tmp_path, eval_every, evaluated):
    result = train(tiny_cfg(tmp_path, epochs=3, eval_every=eval_every))
    validate(result)
    assert [e["epoch"] for e in result["epochs_log"] if e["metrics"]] == evaluated
    assert result["best"]["epoch"] in evaluated
    assert result["final"]["metrics"] == result["epochs_log"][-1]["metrics"] != {}


def test_an_fp16_overflow_step_is_skipped_not_a_divergence(tmp_path, monkeypatch):
    """With a GradScaler (fp16) an infinite gradient norm is an overflow the scaler skips, not a divergence."""
    import accelerate

    calls = {"n": 0}
    real = accelerate.Accelerator.clip_grad_norm_

    def overflow_once(self, parameters, max_norm, norm_type=2):
        norm = real(self, parameters, max_norm, norm_type)
        calls["n"] += 1
        return torch.tensor(float("inf")) if calls["n"] == 1 else norm

    monkeypatch.setattr(accelerate.Accelerator, "clip_grad_norm_", overflow_once)
    import peftlab.training.step as step_mod  # where the loop's steps call it

    monkeypatch.setattr(step_mod, "uses_grad_scaler", lambda accelerator: True)
    monkeypatch.setattr(accelerate.Accelerator, "optimizer_step_was_skipped",
                        property(lambda self: calls["n"] == 1), raising=False)
    result = train(tiny_cfg(tmp_path, epochs=1, max_train_samples=24))
    assert_trained(result)  # not diverged
    assert result["skipped_steps"] == 1
    # without a scaler (fp32/bf16) the same infinite norm is a divergence
    calls["n"] = 0
    monkeypatch.setattr(step_mod, "uses_grad_scaler", lambda accelerator: False)
    diverged = train(tiny_cfg(tmp_path / "fp32", epochs=1, max_train_samples=24))
    assert diverged["status"] == "diverged" and "gradient norm" in diverged["status_reason"]


def test_runs_of_different_precision_in_one_process(tmp_path):
    """A sweep worker trains many runs in one process: Accelerate's global state must follow each run's
    --mixed-precision (it used to raise 'AcceleratorState has already been initialized')."""
    first = train(tiny_cfg(tmp_path / "bf16", mixed_precision="bf16"))
    second = train(tiny_cfg(tmp_path / "fp32", mixed_precision="no"))
    third = train(tiny_cfg(tmp_path / "again", mixed_precision="bf16"))
    for result in (first, second, third):
        assert_trained(result)
    assert first["config"]["mixed_precision"] == "bf16" and second["config"]["mixed_precision"] == "no"
    assert first["final"] == third["final"]  # the same run again after a reset: identical


@pytest.mark.parametrize("requested, n_params, native, cuda, expected", [
    ("auto", 109_486_464, True, False, "bf16"),   # MPNet-base on this CPU: bf16 autocast
    ("auto", 22_713_216, True, False, "no"),      # MiniLM-L6: too small to gain
    ("auto", 109_486_464, False, False, "no"),    # no AMX/avx512_bf16: bf16 would be emulated
    ("auto", 1_000, False, True, "bf16"),         # CUDA
    ("no", 109_486_464, True, False, "no"),       # explicit settings are kept
    ("bf16", 1_000, False, False, "bf16"),
])
def test_auto_mixed_precision_by_device_and_model_size(monkeypatch, requested, n_params, native, cuda, expected):
    import peftlab.training.devices as devices

    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    precision, why = devices.resolve_precision(requested, n_params, cuda=cuda)
    assert precision == expected and why


def test_resolved_precision_is_printed_and_recorded(tmp_path, capsys):
    result = train(tiny_cfg(tmp_path))  # tiny-bert: far below the bf16 threshold
    assert result["mixed_precision"] == "no"
    assert "mixed precision: no (auto: CPU" in capsys.readouterr().out


REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted(p for p in (REPO / "configs").glob("*/*.yaml") if p.parent.name not in ("sweeps", "tune")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_train_config_loads_and_validates(path):
    """Each shipped `peftlab train --config` file: known keys, valid values, no option its method ignores."""
    from peftlab.resolve import build_run_config

    cfg = build_run_config(yaml_path=str(path), check_explicit=True)
    assert cfg.method in METHODS and cfg.targets


@pytest.mark.parametrize("method", sorted(METHODS))
def test_head_lr_is_what_peftlab_methods_shows_whatever_lr_is(tmp_path, method, capsys):
    """One rule for every method: the head trains at --head-lr if given, else the method's default head lr
    (printed by `peftlab methods`), never silently at --lr."""
    assert main(["methods"]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:1] == [method])
    shown = float(row[2])
    other_lr = METHODS[method].default_lr * 3
    result = train(tiny_cfg(tmp_path / "default", method=method, lr=other_lr))
    assert result["group_lrs"]["head"] == pytest.approx(shown) == pytest.approx(METHODS[method].default_head_lr)
    assert result["head_lr"] == pytest.approx(shown)
    given = train(tiny_cfg(tmp_path / "given", method=method, lr=other_lr, head_lr=3e-3))
    assert given["group_lrs"]["head"] == pytest.approx(3e-3)


def pyproject_version() -> str:
    """The version the package is built with, read from pyproject.toml (not through the code under test)."""
    import tomllib

    return tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["version"]


def test_version_flag(capsys):
    import peftlab

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"peftlab {pyproject_version()}"
    assert peftlab.__version__ == pyproject_version()  # the string result.json's "code" records


def test_max_length_beyond_the_positions_is_capped_without_pad_to_max(tmp_path, capsys):
    result = train(tiny_cfg(tmp_path, max_length=1024))
    assert_trained(result)
    assert result["config"]["max_length"] == 1024  # the user's value is kept
    assert "--max-length 1024 is capped at 512" in capsys.readouterr().out


def test_a_run_not_above_the_dev_majority_is_flagged(tmp_path, capsys, monkeypatch):
    from types import SimpleNamespace

    import peftlab.training.guards as guards
    import peftlab.training.loop as train_mod
    from peftlab.training.state import LoopState

    pipeline = SimpleNamespace(primary_metric="accuracy", chance=0.6)
    assert guards.above_majority(LoopState(best={"metrics": {"accuracy": 0.6}}), None, pipeline) is False
    assert guards.above_majority(LoopState(best={"metrics": {"accuracy": 0.61}}), None, pipeline) is True
    assert guards.above_majority(LoopState(), {"accuracy": 0.7}, pipeline) is True  # epochs 0: before
    assert guards.above_majority(LoopState(), None, SimpleNamespace(primary_metric="eval_loss",
                                                                     chance=0.0)) is None
    result = train(tiny_cfg(tmp_path / "real", max_eval_samples=64))
    validate(result)
    assert result["above_majority"] == (result["best"]["metrics"]["accuracy"] > result["majority_baseline"])
    # the CLI says so in a line of its own
    flat = {**result, "above_majority": False}
    monkeypatch.setattr(train_mod, "train", lambda cfg: flat)
    assert main(["train", "--model", "tiny-bert", "--output-dir", str(tmp_path / "cli")]) == 0
    assert "is not above the majority class" in capsys.readouterr().out


def test_gradient_checkpointing_gives_the_same_run(tmp_path):
    """Activations recomputed in the backward pass: same losses and metrics (dropout replayed), less memory."""
    plain = train(tiny_cfg(tmp_path / "plain", dropout=0.1, epochs=2))
    checkpointed = train(tiny_cfg(tmp_path / "gc", dropout=0.1, epochs=2, gradient_checkpointing=True))
    assert checkpointed["config"]["gradient_checkpointing"] is True
    for a, b in zip(plain["epochs_log"], checkpointed["epochs_log"]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    assert checkpointed["final"]["metrics"] == pytest.approx(plain["final"]["metrics"])


def test_threads_flag_sets_torch_threads(tmp_path):
    before = torch.get_num_threads()
    try:
        train(tiny_cfg(tmp_path, threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(PeftlabError, match="--threads must be a positive integer"):
        tiny_cfg(tmp_path, threads=0)


def test_save_best_makes_evaluate_reproduce_the_best_metric(tmp_path):
    """adapter/ holds the best epoch's weights (default --save best), so `peftlab evaluate` gives result.json's
    best metrics even when a later epoch was worse; --save last keeps the final epoch's."""
    from peftlab.training.evaluation import evaluate_run

    # STS-B's Pearson moves every epoch; at this lr tiny-bert peaks at epoch 2 of 4 (deterministic on CPU)
    common = dict(task="stsb", epochs=4, lr=3e-2, max_train_samples=32, max_eval_samples=64, seed=1)
    result = train(tiny_cfg(tmp_path / "best", **common))
    pearsons = [e["metrics"]["pearson"] for e in result["epochs_log"]]
    assert result["best"]["epoch"] != len(pearsons) and max(pearsons) > pearsons[-1], pearsons
    assert result["saved_epoch"] == result["best"]["epoch"]
    assert evaluate_run(tmp_path / "best" / "run") == pytest.approx(result["best"]["metrics"])
    last = train(tiny_cfg(tmp_path / "last", save="last", **common))
    assert last["saved_epoch"] == 4
    assert evaluate_run(tmp_path / "last" / "run") == pytest.approx(last["final"]["metrics"])


def test_grad_accum_is_a_bigger_batch(tmp_path):
    """--grad-accum 2 x --batch-size 8 takes the optimizer steps of batch 16 (half as many as batch 8)."""
    big = train(tiny_cfg(tmp_path / "b16", batch_size=16, max_train_samples=64, dropout=0.0))
    accumulated = train(tiny_cfg(tmp_path / "acc", batch_size=8, grad_accum=2, max_train_samples=64, dropout=0.0))
    small = train(tiny_cfg(tmp_path / "b8", batch_size=8, max_train_samples=64, dropout=0.0))
    for result in (big, accumulated, small):
        assert_trained(result)
    assert accumulated["optimizer_steps"] == big["optimizer_steps"] == 4 and small["optimizer_steps"] == 8
    assert accumulated["train_examples"] == 64


@pytest.mark.parametrize("scheduler", ["linear", "cosine", "constant"])
def test_scheduler_choice(tmp_path, scheduler):
    result = train(tiny_cfg(tmp_path, scheduler=scheduler, epochs=2, warmup_ratio=0.0, log_every=1))
    assert_trained(result)
    assert result["config"]["scheduler"] == scheduler
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    lrs = [e.value for e in events.Scalars("lr/q")]
    if scheduler == "constant":
        assert max(lrs) == pytest.approx(min(lrs))
    else:
        assert lrs[-1] < lrs[0]  # decays (cosine and linear both end near 0)


def test_max_steps_stops_mid_epoch_and_evaluates(tmp_path):
    result = train(tiny_cfg(tmp_path, epochs=5, batch_size=4, max_train_samples=32, max_steps=10))
    assert_trained(result)
    assert result["optimizer_steps"] == 10 and result["epochs_run"] == 2  # the partial last epoch counts
    assert len(result["epochs_log"]) == 2 and result["train_examples"] == 40  # 8 steps, then 2 of epoch 2
    assert result["epochs_log"][-1]["metrics"]  # the partial last epoch is evaluated


@pytest.mark.parametrize("flag, value, message", [("grad_accum", 0, "--grad-accum must be a positive integer"),
                                                  ("max_steps", -1, "--max-steps must be a positive integer"),
                                                  ("scheduler", "cosin", "did you mean 'cosine'")])
def test_loop_option_errors(tmp_path, flag, value, message):
    with pytest.raises(PeftlabError, match=message):
        tiny_cfg(tmp_path, **{flag: value})


def test_long_epochs_checkpoint_by_default(tmp_path):
    from types import SimpleNamespace

    from peftlab.training.schedule import DEFAULT_CHECKPOINT_EVERY, checkpoint_interval

    cfg = SimpleNamespace(checkpoint_every=None, grad_accum=1)
    assert checkpoint_interval(cfg, 1000) == DEFAULT_CHECKPOINT_EVERY == 200  # a kill loses <= 200 steps
    assert checkpoint_interval(cfg, 150) == 0  # short epochs: the end-of-epoch checkpoint suffices
    assert checkpoint_interval(SimpleNamespace(checkpoint_every=0, grad_accum=1), 1000) == 0
    assert checkpoint_interval(SimpleNamespace(checkpoint_every=7, grad_accum=1), 10) == 7
    assert checkpoint_interval(SimpleNamespace(checkpoint_every=None, grad_accum=4), 1000) == 200  # 250 steps


def test_report_to_none_writes_no_tracker_files_and_missing_trackers_are_one_line(tmp_path, capsys):
    result = train(tiny_cfg(tmp_path / "none", report_to="none"))
    assert_trained(result)
    assert not (tmp_path / "none" / "run" / "tb").exists()
    assert (tmp_path / "none" / "run" / "result.json").is_file()
    import importlib.util

    missing = next((t for t in ("wandb", "mlflow") if importlib.util.find_spec(t) is None), None)
    assert missing, "this test needs one of wandb/mlflow to be absent"
    out = tmp_path / "missing"
    capsys.readouterr()
    code = main(["train", "--model", "tiny-bert", "--report-to", missing, "--max-train-samples", "8",
                 "--max-eval-samples", "8", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"--report-to {missing} needs the '{missing}' package" in err[0]
    assert not out.exists()
