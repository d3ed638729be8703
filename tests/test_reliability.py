"""Reliability: kill and resume, divergence and collapse labels, bad input refused in one line (exit 2),
nothing half-written. Every case runs on tiny random models and small real-data subsets."""

from __future__ import annotations

import json
import shutil
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from peftlab.cli.main import main
from peftlab.config import TrainConfig, build_config
from peftlab.training.loop import train

from faults import inject_nan_at_step  # noqa: E402  (tests/ is on sys.path)

TINY = ["--model", "tiny-bert", "--task", "rte", "--max-train-samples", "64", "--max-eval-samples", "32",
        "--max-length", "32", "--batch-size", "8", "--epochs", "2", "--rank", "4"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "peftlab.cli.main", "train", *args]


def tiny_cfg(out: Path, **overrides) -> TrainConfig:
    values = dict(task="rte", model="tiny-bert", max_train_samples=64, max_eval_samples=32, max_length=32,
                  batch_size=8, epochs=2, rank=4, output_dir=str(out))
    values.update(overrides)
    return build_config(TrainConfig, overrides=values)


# --------------------------------------------------------------------------- kill and resume


@pytest.mark.slow
@pytest.mark.parametrize("method", ["kasa", "lora"])
def test_sigkill_at_random_step_then_resume_equals_uninterrupted(tmp_path, method):
    reference = train(tiny_cfg(tmp_path / "reference", method=method))
    total_steps = reference["train_examples"] // 8
    kill_after = random.Random(method).randint(2, total_steps - 3)  # 16 steps in all
    out = tmp_path / "killed"
    args = [*TINY, "--method", method, "--checkpoint-every", "1", "--output-dir", str(out)]
    proc = subprocess.Popen(cli(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state_file = out / "checkpoint" / "state.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if json.loads(state_file.read_text())["global_step"] >= kill_after:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "result.json").exists(), "killed too late: the run had already finished"
    done = subprocess.run(cli(*args, "--resume"), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = json.loads((out / "result.json").read_text())
    assert resumed["final"] == reference["final"]
    assert [e["train_loss"] for e in resumed["epochs_log"]] == [e["train_loss"] for e in reference["epochs_log"]]
    assert len((out / "epochs.jsonl").read_text().splitlines()) == 2
    from safetensors.torch import load_file

    trained = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    expected = load_file(str(tmp_path / "reference" / "adapter" / "adapter_model.safetensors"))
    assert trained.keys() == expected.keys()
    assert all(torch.equal(trained[k], expected[k]) for k in trained), "resumed weights differ bit-for-bit"
    assert not (out / "checkpoint").exists()  # a finished run keeps its adapter and result, not the checkpoint


def test_resume_of_a_finished_run_returns_it(tmp_path):
    first = train(tiny_cfg(tmp_path / "run", epochs=1))
    again = train(tiny_cfg(tmp_path / "run", epochs=1, resume=True))
    assert again == json.loads(json.dumps(first))


def test_resume_without_checkpoint_starts_over(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("partial: true\n")
    result = train(tiny_cfg(tmp_path / "run", epochs=1, resume=True))
    assert result["status"] in ("ok", "no_learning")  # trained to its end (a tiny model need not learn)


# --------------------------------------------------------------------------- checkpoints (Accelerate's save_state)


class Killed(BaseException):  # not an Exception: the loop writes no failed result.json, as after SIGKILL
    pass


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    return out, train(tiny_cfg(out))


def assert_same_run(out: Path, resumed: dict, reference_dir: Path, reference: dict) -> None:
    from safetensors.torch import load_file

    assert resumed["final"] == json.loads(json.dumps(reference["final"]))
    assert [e["train_loss"] for e in resumed["epochs_log"]] == [e["train_loss"] for e in reference["epochs_log"]]
    assert resumed["optimizer_steps"] == reference["optimizer_steps"] == 16
    assert resumed["train_examples"] == reference["train_examples"]
    trained = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    expected = load_file(str(reference_dir / "adapter" / "adapter_model.safetensors"))
    assert trained.keys() == expected.keys()
    assert all(torch.equal(trained[k], expected[k]) for k in trained), "resumed weights differ bit-for-bit"


def kill_after_checkpoint(monkeypatch, at_step: int) -> None:
    """The run dies right after its checkpoint at optimizer step ``at_step`` is complete."""
    import peftlab.training.fit as fit_mod

    real = fit_mod.checkpoint

    def checkpoint(run):
        real(run)
        if run.state.optimizer_steps == at_step:
            raise Killed

    monkeypatch.setattr(fit_mod, "checkpoint", checkpoint)


def test_a_checkpoint_holds_accelerates_state_and_the_loop_state(tmp_path, monkeypatch, uninterrupted):
    out = tmp_path / "run"
    kill_after_checkpoint(monkeypatch, 3)
    with pytest.raises(Killed):
        train(tiny_cfg(out, checkpoint_every=1))
    ckpt = out / "checkpoint"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "optimizer.bin", "random_states_0.pkl", "scheduler.bin", "state.json", "trainable.safetensors"]
    from safetensors.torch import load_file

    tensors = load_file(str(ckpt / "trainable.safetensors"))  # the trainable tensors only, not the frozen base
    assert tensors and all("lora_" in name or "classifier" in name or "pooler" in name for name in tensors)
    state = json.loads((ckpt / "state.json").read_text())
    assert (state["epoch"], state["step_in_epoch"], state["global_step"], state["optimizer_steps"]) == (0, 3, 3, 3)
    assert not (out / ".checkpoint-new").exists() and not (out / ".checkpoint-old").exists()
    monkeypatch.undo()
    resumed = train(tiny_cfg(out, checkpoint_every=1, resume=True))
    assert_same_run(out, resumed, *uninterrupted)
    assert not ckpt.exists()


@pytest.mark.parametrize("moment", ["inside save_state", "between the two renames"])
def test_a_kill_while_a_checkpoint_is_written_leaves_the_previous_one(tmp_path, monkeypatch, uninterrupted, moment):
    """No moment of a save leaves a checkpoint that loads half: the half-written one is never read, the
    previous one is complete and the resumed run is the uninterrupted one."""
    import os as real_os
    from types import SimpleNamespace

    import peftlab.training.checkpoint as checkpoint_mod
    from peftlab.training.run_folder import checkpoint_dir
    from peftlab.training.state import LoopState

    out = tmp_path / "run"
    if moment == "inside save_state":  # Accelerate's files are written, the loop state is not
        real_to_dict = LoopState.to_dict

        def to_dict(state):
            if state.optimizer_steps == 3:
                raise Killed
            return real_to_dict(state)

        monkeypatch.setattr(LoopState, "to_dict", to_dict)
    else:  # checkpoint/ moved aside to .checkpoint-old, .checkpoint-new not yet in its place
        def replace(src, dst):
            if Path(src).name == ".checkpoint-new" and json.loads((Path(src) / "state.json").read_text())[
                    "optimizer_steps"] == 3:
                raise Killed
            real_os.replace(src, dst)

        monkeypatch.setattr(checkpoint_mod, "os", SimpleNamespace(replace=replace))
    with pytest.raises(Killed):
        train(tiny_cfg(out, checkpoint_every=1))
    monkeypatch.undo()
    assert (out / ".checkpoint-new").is_dir()  # the save that was cut short
    found = checkpoint_dir(out)
    assert found.name == ("checkpoint" if moment == "inside save_state" else ".checkpoint-old")
    assert json.loads((found / "state.json").read_text())["optimizer_steps"] == 2
    resumed = train(tiny_cfg(out, checkpoint_every=1, resume=True))
    assert_same_run(out, resumed, *uninterrupted)
    assert not any(p.name.startswith((".checkpoint", "checkpoint")) for p in out.iterdir())


def test_loop_state_round_trips_and_refuses_what_is_not_one():
    from peftlab.errors import PeftlabError
    from peftlab.training.state import LoopState

    state = LoopState(epoch=1, step_in_epoch=2, global_step=10, optimizer_steps=5, epoch_aux_sum=0.25,
                      best={"epoch": 1, "metrics": {"accuracy": 0.5}}, curve=[{"step": 4}], timings={"eval_s": 1.5})
    assert LoopState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    # fields added later take their defaults, a key it does not know is ignored, epochs_run is derived
    partial = {"epoch": 1, "step_in_epoch": 3, "global_step": 11, "optimizer_steps": 11, "rng": "elsewhere",
               "epochs_log": [{"epoch": 1, "train_loss": 0.7, "metrics": {"accuracy": 0.5}}]}
    read = LoopState.from_dict(partial)
    assert (read.skipped_steps, read.curve, read.timings, read.eval_extras, read.stopped_early) == (0, [], {}, {}, None)
    assert read.optimizer_steps == 11 and read.epochs_run == 1 and read.epochs_log == partial["epochs_log"]
    # a state.json of a peftlab from before --grad-accum: resuming it at optimizer step 0 would overrun --max-steps
    with pytest.raises(PeftlabError, match="'optimizer_steps' missing"):
        LoopState.from_dict({"epoch": 1, "step_in_epoch": 3, "global_step": 11}, where="x/state.json")
    with pytest.raises(PeftlabError, match="'global_step' missing"):
        LoopState.from_dict({"epoch": 0, "step_in_epoch": 0}, where="x/state.json")


def test_a_checkpoint_without_accelerates_random_state_is_refused_in_one_line(tmp_path, monkeypatch):
    """An older peftlab's checkpoint (no save_state) or one cut short has no random state: one line, not a trace."""
    from accelerate.utils import RNG_STATE_NAME

    from peftlab.errors import PeftlabError

    out = tmp_path / "run"
    kill_after_checkpoint(monkeypatch, 3)
    with pytest.raises(Killed):
        train(tiny_cfg(out, checkpoint_every=1))
    monkeypatch.undo()
    for rng in (out / "checkpoint").glob(f"{RNG_STATE_NAME}_*.pkl"):
        rng.unlink()
    with pytest.raises(PeftlabError, match="has no random state") as err:
        train(tiny_cfg(out, checkpoint_every=1, resume=True))
    assert "--overwrite" in err.value.fix


# --------------------------------------------------------------------------- divergence and collapse


def test_injected_nan_ends_run_as_diverged(tmp_path, monkeypatch):
    inject_nan_at_step(monkeypatch, 3)
    result = train(tiny_cfg(tmp_path / "run"))
    assert result["status"] == "diverged"
    assert "non-finite loss at step 3" in result["status_reason"]
    on_disk = json.loads((tmp_path / "run" / "result.json").read_text())
    assert on_disk["status"] == "diverged"


@pytest.mark.slow
def test_diverged_run_exits_nonzero_with_reason(tmp_path):
    faults = Path(__file__).with_name("faults.py")  # the CLI with a NaN injected at step 1 (test-only)
    proc = subprocess.run([sys.executable, str(faults), "--nan-at-step", "1", "train", *TINY, "--output-dir",
                           str(tmp_path / "run")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "status=diverged" in proc.stdout and "reason: non-finite loss at step 1" in proc.stdout


def test_collapse_after_being_clearly_above_chance_is_labelled(tmp_path, monkeypatch):
    import peftlab.tasks.prepare as pipelines

    real = pipelines.build_glue
    scripted = iter([{"accuracy": 0.90}, {"accuracy": 0.40}])

    def fake_glue(cfg, tokenizer, model, task):
        pipe = real(cfg, tokenizer, model, task)
        pipe.chance = 0.5
        pipe.evaluate = lambda model, accelerator, tag: pipelines.Evaluation(next(scripted))
        return pipe

    monkeypatch.setitem(pipelines.BUILDERS, "glue", fake_glue)
    result = train(tiny_cfg(tmp_path / "run"))
    assert result["status"] == "collapsed"
    assert "fell to 0.4000 <= chance 0.5000 + 0.05 at epoch 2" in result["status_reason"]
    assert result["best"]["epoch"] == 1  # kept and reported, never hidden


def test_never_above_chance_is_not_a_collapse(tmp_path, monkeypatch):
    from peftlab.training.guards import check_collapse as _check_collapse
    from peftlab.training.state import LoopState

    state = LoopState()
    for value in (0.5, 0.52, 0.49):
        _check_collapse(state, value, 0.5, 1, "accuracy")
    assert state.status == "ok" and not state.clearly_above_chance
    for value in (0.6, 0.5):  # clearly above, then back at chance: that is a collapse
        _check_collapse(state, value, 0.5, 2, "accuracy")
    assert state.status == "collapsed" and "fell to 0.5000" in state.status_reason


@pytest.mark.parametrize("values, status", [
    ((0.35, 0.34, 0.22, 0.0051), "collapsed"),  # lambda 4 at 5e-4 on STS-B, seed 1: Pearson noise just above 0
    ((0.35, 0.04), "collapsed"),
    ((0.35, 0.051, 0.30), "ok"),  # a dip that stays clearly above chance is no collapse
    ((0.04, 0.049, -0.02), "ok"),  # never clearly above: no_learning's business, not a collapse
])
def test_a_correlation_that_falls_back_to_noise_around_zero_is_a_collapse(values, status):
    from peftlab.training.guards import check_collapse as _check_collapse
    from peftlab.training.state import LoopState

    state = LoopState()
    for epoch, value in enumerate(values, 1):
        _check_collapse(state, value, 0.0, f"epoch {epoch}", "selection_pearson")
    assert state.status == status


# --------------------------------------------------------------------------- bad input


def _glue_copy(tmp_path: Path, task_dir: str, train_text: str) -> Path:
    root = tmp_path / "data"
    folder = root / "glue" / task_dir
    folder.mkdir(parents=True)
    from conftest import DATA_DIR as shared
    (folder / "dev.tsv").write_text((shared / "glue" / task_dir / "dev.tsv").read_text(encoding="utf-8-sig"))
    (folder / "train.tsv").write_text(train_text)
    return root


RTE_HEADER = "index\tsentence1\tsentence2\tlabel\n"
STSB_HEADER = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"


def _bad_data(kind: str):
    def make(tmp_path: Path) -> list[str]:
        if kind == "columns":
            root = _glue_copy(tmp_path, "RTE", RTE_HEADER + "0\ta\tb\tentailment\n1\tonly two\n")
        elif kind == "label":
            root = _glue_copy(tmp_path, "RTE", RTE_HEADER + "0\ta\tb\tentailment\n1\ta\tb\tmaybe\n")
        elif kind == "score":
            root = _glue_copy(tmp_path, "STS-B", STSB_HEADER + "0\tg\tf\t2012\t1\ts\ts\ta\tb\tfive\n")
            return ["--task", "stsb", "--data-dir", str(root)]
        else:  # empty
            root = _glue_copy(tmp_path, "RTE", "")
        return ["--data-dir", str(root)]
    return make


def _glue_without_qnli_train(tmp_path: Path) -> list[str]:
    """GLUE's QNLI dev set only: no QNLI train, and no glue_subsets/QNLI to fall back on."""
    root = tmp_path / "data"
    (root / "glue" / "QNLI").mkdir(parents=True)
    (root / "glue" / "QNLI" / "dev.tsv").write_text("index\tquestion\tsentence\tlabel\n0\tq?\ts.\tentailment\n")
    return ["--task", "qnli", "--data-dir", str(root)]


def _yaml(text: str):
    def make(tmp_path: Path) -> list[str]:
        path = tmp_path / "c.yaml"
        path.write_text(text)
        return ["--config", str(path)]
    return make


def _finished(tmp_path: Path) -> list[str]:
    train(tiny_cfg(tmp_path / "out", epochs=1, max_train_samples=8, max_eval_samples=8))
    return []


def _unfinished(tmp_path: Path) -> list[str]:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.yaml").write_text("task: rte\n")
    return []


def _killed_before_first_checkpoint(tmp_path: Path) -> list[str]:
    """A run killed during its first epoch: config.yaml written, no checkpoint yet; resumed with another rank."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.yaml").write_text("task: rte\nmodel: tiny-bert\nrank: 8\n")
    return ["--resume", "--rank", "4"]


BAD_TRAIN_INPUTS = [
    # (case id, extra args or a builder returning args, phrase in the message)
    ("unknown-task", ["--task", "rtee"], "unknown task 'rtee' (did you mean 'rte'?)"),
    ("unknown-model", ["--model", "minilm-l7"], "unknown model 'minilm-l7'"),
    ("unknown-method", ["--method", "loraa"], "unknown method 'loraa'"),
    ("unknown-projection", ["--targets", "q,x"], "unknown projection 'x'"),
    ("empty-targets", ["--targets", ","], "no attention projection selected"),
    # options the run would ignore: an error, never silence (issue: honest knobs)
    ("ignored-dropout-fourierft", ["--method", "fourierft", "--dropout", "0.1"],
     "--dropout is set, but method 'fourierft' does not use it"),
    ("ignored-dropout-full", ["--method", "full", "--dropout", "0.1"], "--dropout is set, but method 'full'"),
    ("ignored-alpha-vera", ["--method", "vera", "--alpha", "32"], "--alpha is set, but method 'vera'"),
    ("ignored-alpha-fourierft", ["--method", "fourierft", "--alpha", "32"], "--alpha is set, but method 'fourierft'"),
    ("ignored-alpha-full", ["--method", "full", "--alpha", "32"], "--alpha is set, but method 'full'"),
    ("ignored-rank-full", ["--method", "full", "--rank", "4"], "--rank is set, but method 'full'"),
    ("ignored-lr-ratio-no-v", ["--targets", "q,k", "--lr-ratio", "4"], "--targets q,k has no v"),
    ("ignored-kasa-flag", ["--method", "lora", "--kasa-beta", "0.1"], "--kasa-beta is set, but method 'lora'"),
    ("ignored-corda-flag", ["--method", "kasa", "--corda-samples", "8"], "--corda-samples is set, but method 'kasa'"),
    ("ignored-vera-flag", ["--method", "dora", "--vera-d-initial", "0.2"], "--vera-d-initial is set, but method 'dora'"),
    ("ignored-fourierft-flag", ["--method", "pissa", "--fourierft-scaling", "10"],
     "--fourierft-scaling is set, but method 'pissa'"),
    ("ignored-in-yaml", _yaml("method: vera\nalpha: 32\n"), "--alpha is set, but method 'vera'"),
    ("max-length-above-positions", ["--pad-to-max", "--max-length", "1024"],
     "--max-length 1024 with --pad-to-max exceeds the 512 positions of model 'tiny-bert'"),
    ("fourierft-too-many-frequencies", ["--method", "fourierft", "--fourierft-n-frequency", "5000"],
     "--fourierft-n-frequency 5000 is more than the 1024 entries of the smallest adapted weight"),
    ("rank-above-width", ["--rank", "1000"], "--rank 1000 is larger than min(in, out) = 32"),
    ("rank-zero", ["--rank", "0"], "--rank must be a positive integer, got 0"),
    ("rank-negative", ["--rank", "-3"], "--rank must be a positive integer, got -3"),
    ("rank-not-int", ["--rank", "eight"], "--rank must be int"),
    ("rank-too-large-kasa", ["--method", "kasa", "--rank", "32"], "--rank 32 is too large for kasa"),
    ("rank-too-large-pissa", ["--method", "pissa", "--rank", "40"], "--rank 40 is too large for pissa"),
    ("lr-zero", ["--lr", "0"], "--lr must be a finite number > 0"),
    ("lr-nan", ["--lr", "nan"], "--lr must be a finite number > 0"),
    ("lr-not-number", ["--lr", "fast"], "--lr must be float"),
    ("lr-ratio-zero", ["--lr-ratio", "0"], "--lr-ratio must be a finite number > 0"),
    ("lr-ratio-negative", ["--lr-ratio", "-2"], "--lr-ratio must be a finite number > 0"),
    ("lr-ratio-inf", ["--lr-ratio", "inf"], "--lr-ratio must be a finite number > 0"),
    ("alpha-nan", ["--alpha", "nan"], "--alpha must be a finite number"),
    ("epochs-negative", ["--epochs", "-1"], "--epochs must be an integer >= 0, got -1"),  # 0 is valid
    ("unknown-flag", ["--learning-rate", "1e-3"], "unknown flag '--learning-rate' (did you mean '--lr'?)"),
    ("unknown-flag-typo", ["--max-lenght", "64"], "unknown flag '--max-lenght' (did you mean '--max-length'?)"),
    ("unknown-yaml-key", _yaml("learning_rate: 1.0e-3\n"), "unknown config key 'learning_rate' (did you mean 'lr'?)"),
    ("unknown-yaml-key-hf", _yaml("num_train_epochs: 3\n"), "unknown config key 'num_train_epochs' (did you mean 'epochs'?)"),
    ("warmup-too-big", ["--warmup-ratio", "1.5"], "--warmup-ratio must be a finite number >= 0 and < 1"),
    ("precision-unknown", ["--mixed-precision", "fp8"], "unknown --mixed-precision 'fp8'"),
    ("yaml-unknown-key", _yaml("lr_ratoi: 2\n"), "unknown config key 'lr_ratoi' (did you mean 'lr_ratio'?)"),
    ("yaml-syntax", _yaml("rank: [8\n"), "invalid YAML"),
    ("yaml-not-mapping", _yaml("- 1\n- 2\n"), "a config file must be a mapping"),
    ("yaml-bad-type", _yaml("rank: eight\n"), "--rank must be int"),
    ("config-missing", ["--config", "/nonexistent/c.yaml"], "config file not found"),
    ("data-wrong-columns", _bad_data("columns"), "train.tsv:3"),
    ("data-unknown-label", _bad_data("label"), "train.tsv:3"),
    ("data-stsb-score", _bad_data("score"), "train.tsv:2"),
    ("data-empty-file", _bad_data("empty"), "train.tsv"),
    ("data-missing-split", _glue_without_qnli_train, "no local copy of QNLI train"),
    ("data-dir-missing", ["--data-dir", "/nonexistent/data"], "/nonexistent/data"),
    ("output-finished", _finished, "already holds a finished run"),
    ("output-unfinished", _unfinished, "holds an unfinished run"),
    ("resume-changed-before-checkpoint", _killed_before_first_checkpoint,
     "--resume with a different config: rank was 8, now 4"),
]


@pytest.mark.parametrize("case,extra,phrase", BAD_TRAIN_INPUTS, ids=[c[0] for c in BAD_TRAIN_INPUTS])
def test_bad_train_input_one_line_exit_2_nothing_written(tmp_path, capsys, monkeypatch, case, extra, phrase):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = extra(tmp_path) if callable(extra) else list(extra)
    out = tmp_path / "out"
    before = sorted(p.relative_to(tmp_path) for p in out.rglob("*")) if out.exists() else None
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} if out.exists() else {}
    capsys.readouterr()
    code = main(["train", *TINY[:2], "--max-train-samples", "8", "--max-eval-samples", "8", "--max-length", "16",
                 *args, "--output-dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("peftlab: error: ") and "\n" not in err, err
    assert phrase in err, err
    after = sorted(p.relative_to(tmp_path) for p in out.rglob("*")) if out.exists() else None
    assert after == before, "a refused run must not create or change files"
    assert all(p.read_bytes() == data for p, data in snapshot.items())


# --------------------------------------------------------------------------- adapters


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter") / "run"
    train(tiny_cfg(out, epochs=1, max_train_samples=16, max_eval_samples=16))
    return out


def _corrupt(run: Path, tmp_path: Path) -> list[str]:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in (run / "adapter").iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "adapter_model.safetensors").write_bytes(b"\x00garbage, not safetensors")
    return ["--adapter", str(bad)]


def _truncated(run: Path, tmp_path: Path) -> list[str]:
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in (run / "adapter").iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    return ["--adapter", str(bad)]


def _pickle(run: Path, tmp_path: Path) -> list[str]:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((run / "adapter" / "adapter_config.json").read_text())
    (bad / "adapter_model.bin").write_bytes(b"pickle")
    return ["--adapter", str(bad)]


def _other_base(run: Path, tmp_path: Path) -> list[str]:
    other = tmp_path / "other"
    train(tiny_cfg(other, epochs=1, max_train_samples=8, max_eval_samples=8, method="lora", targets="q,k,v,o",
                   rank=8))
    run_copy = tmp_path / "run"
    run_copy.mkdir()
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"] = "tiny-llama"
    (run_copy / "config.yaml").write_text(yaml.safe_dump(config))
    bare = tmp_path / "bare-adapter"  # no run config beside it: the loader's own shape check must refuse it
    shutil.copytree(other / "adapter", bare)
    return ["RUN", str(run_copy), "--adapter", str(bare)]


def _other_task(run: Path, tmp_path: Path) -> list[str]:
    """An adapter of another run (another task) that would load: refused by what its run was trained for."""
    other = tmp_path / "other-task"
    train(tiny_cfg(other, epochs=1, max_train_samples=8, max_eval_samples=8, task="mrpc"))
    return ["--adapter", str(other)]


def _older_kasa(run: Path, tmp_path: Path) -> list[str]:
    """An earlier peftlab's KaSA adapter: peft would re-truncate the base its own way and load other weights."""
    old = tmp_path / "older"
    shutil.copytree(run / "adapter", old)
    (old / "peftlab_kasa_truncation.json").write_text('{"layers": {}}')
    return ["--adapter", str(old)]


def _missing(run: Path, tmp_path: Path) -> list[str]:
    return ["--adapter", str(tmp_path / "nowhere")]


BAD_ADAPTERS = [
    ("corrupt", _corrupt, "corrupt or truncated safetensors"),
    ("truncated", _truncated, "corrupt or truncated safetensors"),
    ("pickle", _pickle, "is a pickle"),
    ("other-base", _other_base, "does not fit this base model"),
    ("missing", _missing, "not found; fix: pass an adapter folder"),
    ("other-task", _other_task, "was trained with task='mrpc', but"),
    ("older-kasa", _older_kasa, "a format of an earlier peftlab"),
]


@pytest.mark.parametrize("case,make,phrase", BAD_ADAPTERS, ids=[c[0] for c in BAD_ADAPTERS])
def test_bad_adapter_one_line_exit_2(trained_run, tmp_path, capsys, case, make, phrase):
    args = make(trained_run, tmp_path)
    run_dir = str(trained_run)
    if args and args[0] == "RUN":
        run_dir, args = args[1], args[2:]
    capsys.readouterr()
    code = main(["evaluate", run_dir, *args])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("peftlab: error: ") and "\n" not in err and phrase in err, err


def test_saved_adapter_reproduces_final_metrics(trained_run, capsys):
    capsys.readouterr()
    assert main(["evaluate", str(trained_run)]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics == json.loads((trained_run / "result.json").read_text())["final"]["metrics"]


def test_sweep_records_a_diverged_run_and_goes_on(tmp_path):
    """An absurd learning rate blows the loss up to inf/NaN: that run ends 'diverged', the next still runs."""
    from peftlab.lab.records import load_rows
    from peftlab.lab.spec import load_spec
    from peftlab.lab.sweep import run_sweep

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({
        "base": {"task": "rte", "model": "tiny-bert", "method": "full", "targets": "q,v", "epochs": 2,
                 "max_train_samples": 32, "max_eval_samples": 16, "max_length": 32, "batch_size": 8,
                 "max_grad_norm": 0.0},
        "grid": {"lr": [1.0e30, 1.0e-3]},
        "output_dir": str(tmp_path / "sweep")}))
    run_sweep(load_spec(spec), progress=False)
    rows = load_rows([tmp_path / "sweep"])
    statuses = sorted(r["status"] for r in rows)
    assert statuses[0] == "diverged" and statuses[1] in ("no_learning", "ok") and len(statuses) == 2, statuses
    diverged = next(r for r in rows if r["status"] == "diverged")
    assert "non-finite" in diverged["result"]["status_reason"]


def test_atomic_writes_get_ordinary_file_permissions(tmp_path):
    import stat

    from peftlab.io_utils import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "table.csv", "a,b\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "table.csv").stat().st_mode) == 0o644


# --------------------------------------------------------------------------- malformed records named (issue 25)
# A bad spec (sweep, tune, study base config) or a bad record in a `peftlab predict --input` file: one line
# naming the file, the line and what is wrong; exit 2; nothing written.

BAD_YAML = [
    ("tab", "base:\n  model: tiny-bert\n\ttask: rte\n", ":3)", "found character '\\t' that cannot start any token"),
    ("unclosed", "base: {model: tiny-bert\n", ":2)", "expected ',' or '}'"),
    ("key-twice", "base:\n  model: tiny-bert\n  model: minilm-l6\n", ":3)", "key 'model' is given twice (first on line 2)"),
    ("not-utf8", b"base:\n  model: tiny-bert\n  task: \xff\xfe\n", ":3)", "not UTF-8 text (byte 0xff)"),
    ("a-list", "- base\n- grid\n", ")", "must be a mapping"),
]


@pytest.mark.parametrize("command", ["sweep", "tune", "study"])
@pytest.mark.parametrize("case, text, line, phrase", BAD_YAML, ids=[c[0] for c in BAD_YAML])
def test_a_malformed_spec_is_one_line_naming_file_and_line(tmp_path, capsys, command, case, text, line, phrase):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    out = tmp_path / "out"
    if command == "study":  # the study's base config (--config), flat keys
        flat = text.replace(b"base:\n  ", b"").replace(b"\n  ", b"\n") if isinstance(text, bytes) else \
            text.replace("base:\n  ", "").replace("\n  ", "\n")
        path.write_bytes(flat if isinstance(flat, bytes) else flat.encode())
        line = {"key-twice": ":2)", "not-utf8": ":2)", "tab": ":2)"}.get(case, line)
        phrase = phrase.replace("first on line 2", "first on line 1")
        args = ["study", "lambda", "--task", "rte", "--config", str(path), "--output-dir", str(out), "--dry-run"]
    else:
        args = [command, str(path), "--output-dir", str(out), "--dry-run"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("peftlab: error: "), err
    assert phrase in err and f"{path}{line}" in err and "fix: " in err, err
    assert not out.exists()


def test_an_empty_spec_is_refused(tmp_path, capsys):
    (tmp_path / "empty.yaml").write_text("")
    for command in ("sweep", "tune"):
        assert main([command, str(tmp_path / "empty.yaml"), "--dry-run"]) == 2
        assert f"the {command} spec is empty" in capsys.readouterr().err


BAD_INPUTS = [
    ("bad-json-line", "in.jsonl", '{"sentence1": "a", "sentence2": "b"}\n{"sentence1": "c", "sentence2"\n', ":2",
     "invalid JSON"),
    ("truncated-json", "in.json", '[{"sentence1": "a", "sentence2": "b"}, {"sentence1": ', ":1", "invalid JSON"),
    ("record-not-object", "in.jsonl", '{"sentence1": "a", "sentence2": "b"}\n[1, 2]\n', ":2", "not an object"),
    ("text-is-object", "in.jsonl", '{"sentence1": "a", "sentence2": "b"}\n{"sentence1": {"x": 1}, "sentence2": "b"}\n',
     "", "not a string"),
    ("open-quote", "in.csv", 'sentence1,sentence2\na,b\n"c,d\ne,f\n', ":3", "malformed CSV record"),
    ("extra-field", "in.tsv", "sentence1\tsentence2\na\tb\nc\td\te\n", ":3", "the header has 2"),
    ("not-utf8", "in.jsonl", b'{"sentence1": "a", "sentence2": "\xff"}\n', ":1", "not valid UTF-8"),
]


@pytest.mark.parametrize("case, name, text, line, phrase", BAD_INPUTS,
                         ids=[c[0] for c in BAD_INPUTS])
def test_a_malformed_predict_input_is_one_line_naming_file_and_line(trained_run, tmp_path, capsys, case, name,
                                                                    text, line, phrase):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    output = tmp_path / "predictions.jsonl"
    assert main(["predict", str(trained_run), "--input", str(path), "--output", str(output)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("peftlab: error: "), err
    assert phrase in err and f"{path}{line}" in err, err
    assert not output.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".predictions")]
