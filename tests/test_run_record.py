"""What a run's result.json records for a study: the no_learning and pruned statuses, epochs_run, the code block,
the training examples' digest, the --eval-steps learning curve (exact across a kill and --resume) and head-only
fine-tuning. Expectations are computed here, from the data files, git and the package files, not by the code
that writes result.json."""

from __future__ import annotations

import csv
import hashlib
import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.training.loop import train

from conftest import DATA_DIR, needs_data  # noqa: E402  (tests/ is on sys.path)
from faults import inject_nan_at_step  # noqa: E402
from test_train import validate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def tiny_cfg(out: Path, **overrides) -> TrainConfig:
    values = dict(task="rte", model="tiny-bert", method="lora", targets="q,v", rank=4, epochs=2, batch_size=8,
                  max_length=32, max_train_samples=24, max_eval_samples=16, output_dir=str(out), report_to="none")
    values.update(overrides)
    return build_run_config(overrides=values)


def toy_sst2(root: Path, *, signal_in_dev: bool = True, n_train: int = 64, n_dev: int = 32) -> Path:
    """A GLUE-layout SST-2 (glue/SST-2/{train,dev}.tsv) that tiny-bert learns in a few steps: the label is the
    word "wonderful" (1) or "terrible" (0) among filler words. ``signal_in_dev=False``: every dev sentence is the
    same text, half labelled 0, half 1, so every model scores exactly the majority class (0.5): nothing can be
    learned that the dev set could show."""
    rng = random.Random(0)
    filler = "the a film movie story it was and of this".split()

    def sentence(label: int) -> str:
        words = [rng.choice(filler) for _ in range(3)] + ["wonderful" if label else "terrible"] * rng.randint(1, 3)
        rng.shuffle(words)
        return " ".join(words)

    train_rows = [(sentence(i % 2), i % 2) for i in range(n_train)]
    dev_rows = [(sentence(i % 2), i % 2) if signal_in_dev else ("the film was a film", i % 2) for i in range(n_dev)]
    folder = root / "glue" / "SST-2"
    folder.mkdir(parents=True)
    for name, rows in (("train.tsv", train_rows), ("dev.tsv", dev_rows)):
        (folder / name).write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    return root


def toy_cfg(out: Path, data: Path, **overrides) -> TrainConfig:
    # mean pooling: a random tiny-bert's [CLS] carries too little of the words for 24 steps to find
    values = dict(task="sst2", model="tiny-bert", method="lora", targets="q,v", rank=4, epochs=3, batch_size=8,
                  max_length=32, lr=1e-2, head_lr=1e-2, pooling="mean", data_dir=str(data), output_dir=str(out),
                  report_to="none")
    values.update(overrides)
    return build_run_config(overrides=values)


def scripted_glue(monkeypatch, values: dict, chance: float | None = None):
    """Replace the GLUE pipeline's evaluation by scripted metrics: ``values[tag]`` (tags before, epoch<N>,
    step<N>); every call is recorded with the model's mode."""
    import peftlab.tasks.prepare as pipelines

    real = pipelines.build_glue
    calls = []

    def fake_glue(cfg, tokenizer, model, task):
        pipe = real(cfg, tokenizer, model, task)
        if chance is not None:
            pipe.chance = chance

        def evaluate(model, accelerator, tag):
            calls.append(tag)
            return pipelines.Evaluation(dict(values[tag]))

        pipe.evaluate = evaluate
        return pipe

    monkeypatch.setitem(pipelines.BUILDERS, "glue", fake_glue)
    return calls


# --------------------------------------------------------------------------- no_learning


def test_a_run_that_cannot_learn_ends_no_learning_and_a_learning_run_stays_ok(tmp_path):
    blind = train(toy_cfg(tmp_path / "blind", toy_sst2(tmp_path / "blind-data", signal_in_dev=False)))
    validate(blind)
    assert blind["majority_baseline"] == 0.5 and blind["best"]["metrics"]["accuracy"] == 0.5
    assert blind["status"] == "no_learning"
    assert blind["status_reason"] == ("best accuracy 0.5000 (epoch 1) is not clearly above chance: "
                                      "<= 0.5500 = chance 0.5000 + 0.05")
    on_disk = json.loads((tmp_path / "blind" / "result.json").read_text())
    assert on_disk["status"] == "no_learning" and on_disk["status_reason"] == blind["status_reason"]

    learned = train(toy_cfg(tmp_path / "learned", toy_sst2(tmp_path / "data")))
    validate(learned)
    assert learned["best"]["metrics"]["accuracy"] > 0.55  # clearly above the balanced dev set's 0.5
    assert learned["status"] == "ok" and learned["status_reason"] is None
    assert learned["epochs_run"] == 3


@pytest.mark.parametrize("task, chance, script, status, reason", [
    # the bar is inclusive: exactly chance + 0.05 is not clearly above it
    ("rte", 0.6, {"epoch1": 0.62, "epoch2": 0.65}, "no_learning",
     "best accuracy 0.6500 (epoch 2) is not clearly above chance: <= 0.6500 = chance 0.6000 + 0.05"),
    ("rte", 0.6, {"epoch1": 0.62, "epoch2": 0.6501}, "ok", None),
    # above chance, but not above the model before fine-tuning
    ("rte", 0.5, {"before": 0.80, "epoch1": 0.78, "epoch2": 0.80}, "no_learning",
     "best accuracy 0.8000 (epoch 2) is not above the model before fine-tuning: <= 0.8000"),
    ("rte", 0.5, {"before": 0.80, "epoch1": 0.78, "epoch2": 0.81}, "ok", None),
    # a correlation's chance is 0
    ("stsb", None, {"epoch1": 0.03, "epoch2": 0.05}, "no_learning",
     "best pearson 0.0500 (epoch 2) is not clearly above chance: <= 0.0500 = chance 0.0000 + 0.05"),
    ("stsb", None, {"epoch1": 0.03, "epoch2": 0.2}, "ok", None),
])
def test_the_chance_bar_and_the_before_bar(tmp_path, monkeypatch, task, chance, script, status, reason):
    metric = "pearson" if task == "stsb" else "accuracy"
    scripted_glue(monkeypatch, {tag: {metric: value} for tag, value in script.items()}, chance=chance)
    result = train(tiny_cfg(tmp_path / "run", task=task, eval_before="before" in script))
    validate(result)
    assert (result["status"], result["status_reason"]) == (status, reason)


def test_no_learning_is_never_given_to_loss_scored_tasks_or_runs_that_trained_nothing(tmp_path):
    from types import SimpleNamespace

    from peftlab.tasks.table import task
    from peftlab.training.guards import no_learning_reason
    from peftlab.training.state import LoopState

    def pipeline(metric: str, name: str):  # the pipeline carries its task's row (tasks.prepare.build_pipeline)
        return SimpleNamespace(choice_metric=metric, choice_chance=0.0, task=task(name))

    state = LoopState(best={"epoch": 1, "metrics": {"eval_loss": 9.0}}, before={"eval_loss": 1.0})
    assert no_learning_reason(state, pipeline("eval_loss", "alpaca")) is None
    flat = LoopState(best={"epoch": 1, "metrics": {"accuracy": 0.0}})
    assert no_learning_reason(flat, pipeline("accuracy", "gsm8k")) is None
    assert no_learning_reason(flat, pipeline("accuracy", "rte")) is not None
    before_row = train(tiny_cfg(tmp_path / "before", epochs=0))  # the before-fine-tuning row: nothing trained
    validate(before_row)
    assert before_row["status"] == "ok" and before_row["epochs_run"] == 0 and before_row["curve"] == []


def test_a_diverged_run_keeps_its_status_and_counts_its_cut_epoch(tmp_path, monkeypatch):
    inject_nan_at_step(monkeypatch, 4)  # 3 batches per epoch: step 4 is in epoch 2
    result = train(tiny_cfg(tmp_path / "run"))
    assert result["status"] == "diverged" and "non-finite loss at step 4" in result["status_reason"]
    assert result["epochs_run"] == 2 and len(result["epochs_log"]) == 1


# --------------------------------------------------------------------------- pruned


def test_a_hook_stopped_run_is_pruned_with_epochs_run(tmp_path):
    seen = []

    def prune_after_first(end):
        seen.append(end.epoch)
        return "pruned by the test at epoch 1"

    result = train(tiny_cfg(tmp_path / "run", epochs=3), on_epoch_end=prune_after_first)
    validate(result)
    assert seen == [1]
    assert result["status"] == "pruned" and result["epochs_run"] == 1 < result["epochs"] == 3
    assert result["stopped_early"] == {"epoch": 1, "reason": "pruned by the test at epoch 1"}
    assert result["status_reason"] == "stopped after epoch 1: pruned by the test at epoch 1"
    assert len(result["epochs_log"]) == 1
    # a pruned run is finished: --resume returns it, it is never trained on
    again = train(tiny_cfg(tmp_path / "run", epochs=3, resume=True))
    assert again == json.loads(json.dumps(result))


def test_a_hook_at_the_last_epoch_prunes_nothing_and_a_collapsed_run_stays_collapsed(tmp_path, monkeypatch):
    last = train(toy_cfg(tmp_path / "last", toy_sst2(tmp_path / "data"), epochs=1), on_epoch_end=lambda end: True)
    assert last["status"] == "ok" and last["stopped_early"] is None and last["epochs_run"] == 1

    scripted_glue(monkeypatch, {"epoch1": {"accuracy": 0.9}, "epoch2": {"accuracy": 0.4}}, chance=0.5)
    collapsed = train(tiny_cfg(tmp_path / "collapsed", epochs=3),
                      on_epoch_end=lambda end: "collapsed: stopped" if end.status == "collapsed" else None)
    validate(collapsed)
    assert collapsed["status"] == "collapsed" and collapsed["stopped_early"]["epoch"] == 2
    assert collapsed["epochs_run"] == 2 and "fell to 0.4000" in collapsed["status_reason"]


def test_the_cli_exits_0_for_a_run_that_learned_nothing(tmp_path, capsys):
    from peftlab.cli.main import main

    data = toy_sst2(tmp_path / "data", signal_in_dev=False)
    code = main(["train", "--task", "sst2", "--model", "tiny-bert", "--pooling", "mean", "--data-dir", str(data),
                 "--epochs", "1", "--batch-size", "8", "--max-length", "32", "--report-to", "none",
                 "--output-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0 and "status=no_learning" in out and "reason: best accuracy 0.5000" in out


# --------------------------------------------------------------------------- code


def _independent_source_digest(root: Path) -> str:
    h = hashlib.sha256()
    paths = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".py", ".json")
                   and "__pycache__" not in p.parts)
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        data = path.read_bytes()
        h.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


def test_result_records_the_code_it_ran(tmp_path):
    from peftlab.training.run_folder import source_digest

    first = train(tiny_cfg(tmp_path / "a", epochs=1))
    second = train(tiny_cfg(tmp_path / "b", epochs=1, seed=1))
    validate(first)
    code = first["code"]
    assert set(code) == {"commit", "dirty", "version", "source_digest"}
    assert code["version"] == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert HEX64.match(code["source_digest"]) and second["code"]["source_digest"] == code["source_digest"]
    assert code["source_digest"] == source_digest()  # once per process
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True).stdout
        assert code["commit"] == head.stdout.strip() and code["dirty"] == bool(status.strip())
        assert first["git_commit"] == code["commit"] + ("+dirty" if code["dirty"] else "")
    else:
        assert code["commit"] is None and code["dirty"] is None


def test_source_digest_follows_the_files(tmp_path):
    """The digest's recipe, on a frozen copy of the package (the live tree may be edited meanwhile)."""
    import peftlab
    from peftlab.training.run_folder import source_digest

    copy = tmp_path / "peftlab"
    shutil.copytree(Path(peftlab.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "notes.txt").write_text("not a source file")
    digest = source_digest(copy)
    assert digest == _independent_source_digest(copy)
    (copy / "notes.txt").write_text("still not a source file")
    assert source_digest.__wrapped__(copy) == digest  # only .py and .json count
    table = copy / "methods" / "table.py"
    table.write_bytes(table.read_bytes() + b"\n")
    assert source_digest.__wrapped__(copy) != digest
    (copy / "schemas" / "result.schema.json").write_text("{}")
    assert source_digest.__wrapped__(copy) == _independent_source_digest(copy)


# --------------------------------------------------------------------------- training examples


def _rte_rows() -> list[dict]:
    with open(DATA_DIR / "glue" / "RTE" / "train.tsv", encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
        next(reader)
        return [{"label": ("entailment", "not_entailment").index(row[3]), "text_a": row[1], "text_b": row[2]}
                for row in reader if row]


def _digest(rows: list[dict]) -> str:
    lines = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows)
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


@needs_data("glue", "RTE", "train.tsv")
def test_train_examples_digest_is_the_raw_examples_drawn(tmp_path):
    from peftlab.models.registry import load_tokenizer
    from peftlab.tasks.prepare import build_pipeline

    tokenizer = load_tokenizer("tiny-bert")

    def digest(**overrides):
        return build_pipeline(tiny_cfg(tmp_path, **overrides), tokenizer, None).train_examples_digest

    rows = _rte_rows()
    assert digest(max_train_samples=None) == _digest(rows)  # the whole file, in file order
    assert digest(max_train_samples=None, seed=5) == _digest(rows)  # no draw: the seed picks nothing
    drawn = digest()
    assert HEX64.match(drawn) and drawn == digest() == digest(max_length=64)  # raw text, not tokens
    assert digest(seed=1) != drawn and digest(max_train_samples=25) != drawn
    assert digest(eval_seed=3, max_eval_samples=8) == drawn  # the dev draw is not the training set
    from peftlab.tasks.table import task

    rte = task("rte")  # the pipeline carries the Task it was built for: the one passed, else looked up once
    assert build_pipeline(tiny_cfg(tmp_path), tokenizer, None, rte).task is rte
    assert build_pipeline(tiny_cfg(tmp_path), tokenizer, None).task is rte
    # end to end: result.json records it; equal for equal data and seed, not otherwise
    first = train(tiny_cfg(tmp_path / "a", epochs=1))
    again = train(tiny_cfg(tmp_path / "b", epochs=1, method="kasa"))
    other = train(tiny_cfg(tmp_path / "c", epochs=1, seed=1))
    validate(first)
    assert first["train_examples_digest"] == again["train_examples_digest"] == drawn
    assert other["train_examples_digest"] == digest(seed=1) != drawn


@needs_data("alpaca", "alpaca_data_1k.json")
@needs_data("commonsense", "boolq", "train.json")
@needs_data("mt_bench")
@pytest.mark.parametrize("task, extra", [("alpaca", {}), ("commonsense", {"train_sets": "boolq", "eval_sets": "boolq"}),
                                         ("mt-bench", {})])
def test_instruction_and_generation_tasks_record_their_training_examples(tmp_path, task, extra):
    from peftlab.models.registry import load_tokenizer
    from peftlab.tasks.prepare import build_pipeline

    tokenizer = load_tokenizer("tiny-llama")

    def pipeline(**overrides):
        values = dict(task=task, model="tiny-llama", max_length=64, max_train_samples=8, max_eval_samples=2,
                      output_dir=str(tmp_path / "run"), **extra)
        cfg = build_run_config(overrides={**values, **overrides})
        return build_pipeline(cfg, tokenizer, None)

    first = pipeline()
    assert HEX64.match(first.train_examples_digest) and pipeline().train_examples_digest == first.train_examples_digest
    assert pipeline(seed=1).train_examples_digest != first.train_examples_digest
    assert pipeline(max_train_samples=9).train_examples_digest != first.train_examples_digest


# --------------------------------------------------------------------------- learning curve


def expected_curve_steps(steps_per_epoch: int, epochs: int, eval_steps: int, eval_every: int = 1) -> list[tuple]:
    """(step, epoch, epoch_end) of every evaluation: each --eval-steps multiple and each evaluated epoch end,
    one point where both fall on the same step (grad_accum 1: a step is a batch)."""
    total = steps_per_epoch * epochs
    ends = {e * steps_per_epoch for e in range(1, epochs + 1) if e == epochs or (eval_every and e % eval_every == 0)}
    points = {s: False for s in range(eval_steps, total + 1, eval_steps)} if eval_steps else {}
    points.update({s: True for s in ends})
    return [(s, s / steps_per_epoch, points[s]) for s in sorted(points)]


@pytest.mark.parametrize("eval_steps, eval_every", [(2, 1), (1, 1), (3, 2), (0, 1)])
def test_eval_steps_curve_points(tmp_path, eval_steps, eval_every):
    out = tmp_path / "run"
    result = train(tiny_cfg(out, eval_steps=eval_steps, eval_every=eval_every))  # 24 examples / 8: 3 steps an epoch
    validate(result)
    curve = result["curve"]
    assert [(p["step"], p["epoch"], p["epoch_end"]) for p in curve] == expected_curve_steps(3, 2, eval_steps, eval_every)
    assert all(p["metrics"] and set(p["metrics"]) == {"accuracy"} for p in curve)
    by_epoch = {e["epoch"]: e["metrics"] for e in result["epochs_log"]}
    assert [p["metrics"] for p in curve if p["epoch_end"]] == [by_epoch[e] for e in by_epoch if by_epoch[e]]
    if eval_steps:
        lines = [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()]
        assert lines == json.loads(json.dumps(curve))
    else:
        assert not (out / "curve.jsonl").exists()


def test_eval_steps_count_optimizer_steps_under_grad_accum(tmp_path):
    result = train(tiny_cfg(tmp_path / "run", max_train_samples=32, grad_accum=2, eval_steps=1))  # 4 batches = 2 steps
    assert [(p["step"], p["epoch"], p["epoch_end"]) for p in result["curve"]] == [
        (1, 0.5, False), (2, 1.0, True), (3, 1.5, False), (4, 2.0, True)]


def test_the_best_epoch_comes_from_epoch_ends_only(tmp_path, monkeypatch):
    script = {"epoch1": {"accuracy": 0.70}, "epoch2": {"accuracy": 0.75}, "epoch3": {"accuracy": 0.72}}
    script.update({f"step{s}": {"accuracy": 0.99} for s in range(1, 10)})  # far better, never the best epoch
    calls = scripted_glue(monkeypatch, script, chance=0.5)
    result = train(tiny_cfg(tmp_path / "run", epochs=3, eval_steps=2))
    # 3 steps an epoch: step 6 is epoch 2's end, evaluated once, as the epoch end
    assert calls == ["step2", "epoch1", "step4", "epoch2", "step8", "epoch3"]
    assert result["best"] == {"epoch": 2, "metrics": {"accuracy": 0.75}} and result["saved_epoch"] == 2
    assert [p["metrics"]["accuracy"] for p in result["curve"]] == [0.99, 0.70, 0.99, 0.75, 0.99, 0.72]


def test_evaluation_during_training_leaves_training_unchanged(tmp_path, monkeypatch):
    """Dropout on: a run with an evaluation after every step trains exactly as one without, also when the task's
    evaluation leaves the model in eval mode (the loop restores train mode)."""
    plain = train(tiny_cfg(tmp_path / "plain", dropout=0.1))
    stepped = train(tiny_cfg(tmp_path / "stepped", dropout=0.1, eval_steps=1))
    assert [e["train_loss"] for e in stepped["epochs_log"]] == [e["train_loss"] for e in plain["epochs_log"]]
    assert stepped["final"] == plain["final"]

    import peftlab.tasks.prepare as pipelines

    real = pipelines.build_glue

    def leaves_eval_mode(cfg, tokenizer, model, task):
        pipe = real(cfg, tokenizer, model, task)
        inner = pipe.evaluate

        def evaluate(model, accelerator, tag):
            evaluation = inner(model, accelerator, tag)
            model.eval()
            return evaluation

        pipe.evaluate = evaluate
        return pipe

    monkeypatch.setitem(pipelines.BUILDERS, "glue", leaves_eval_mode)
    careless = train(tiny_cfg(tmp_path / "careless", dropout=0.1, eval_steps=1))
    assert [e["train_loss"] for e in careless["epochs_log"]] == [e["train_loss"] for e in plain["epochs_log"]]


def test_eval_steps_must_be_a_count():
    with pytest.raises(PeftlabError, match="--eval-steps must be an integer >= 0"):
        tiny_cfg(Path("unused"), eval_steps=-1)


def test_a_kill_between_an_evaluation_and_its_checkpoint_loses_and_doubles_no_point(tmp_path, monkeypatch):
    """The narrowest window: the step-4 evaluation is in curve.jsonl, its checkpoint was never written. The
    resumed run starts from step 3's checkpoint, evaluates step 4 again, and its curve is the uninterrupted one."""
    import peftlab.training.fit as fit_mod

    reference = train(tiny_cfg(tmp_path / "reference", eval_steps=2, checkpoint_every=1))
    out = tmp_path / "killed"
    real = fit_mod.checkpoint

    class Killed(BaseException):  # not an Exception: the loop writes no failed result.json, as after SIGKILL
        pass

    def checkpoint(run):
        if run.state.optimizer_steps == 4 and run.state.step_in_epoch:
            raise Killed
        real(run)

    monkeypatch.setattr(fit_mod, "checkpoint", checkpoint)
    with pytest.raises(Killed):
        train(tiny_cfg(out, eval_steps=2, checkpoint_every=1))
    on_disk = [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()]
    assert [p["step"] for p in on_disk] == [2, 3, 4] and not (out / "result.json").exists()
    monkeypatch.setattr(fit_mod, "checkpoint", real)
    resumed = train(tiny_cfg(out, eval_steps=2, checkpoint_every=1, resume=True))
    assert resumed["curve"] == json.loads(json.dumps(reference["curve"]))
    assert [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()] == resumed["curve"]


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_uninterrupted_curve(tmp_path):
    args = ["--model", "tiny-bert", "--task", "rte", "--max-train-samples", "64", "--max-eval-samples", "32",
            "--max-length", "32", "--batch-size", "8", "--epochs", "2", "--rank", "4", "--eval-steps", "3",
            "--report-to", "none"]
    reference = train(build_run_config(overrides=dict(
        task="rte", model="tiny-bert", max_train_samples=64, max_eval_samples=32, max_length=32, batch_size=8,
        epochs=2, rank=4, eval_steps=3, report_to="none", output_dir=str(tmp_path / "reference"))))
    assert [p["step"] for p in reference["curve"]] == [3, 6, 8, 9, 12, 15, 16]
    kill_after = random.Random("curve").randint(2, 13)  # 16 steps in all
    out = tmp_path / "killed"
    cli = [sys.executable, "-m", "peftlab.cli.main", "train", *args, "--checkpoint-every", "1", "--output-dir", str(out)]
    proc = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    done = subprocess.run(cli + ["--resume"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = json.loads((out / "result.json").read_text())
    assert resumed["curve"] == json.loads(json.dumps(reference["curve"]))
    assert [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()] == resumed["curve"]
    assert resumed["final"] == reference["final"]


# --------------------------------------------------------------------------- head-only


@pytest.mark.parametrize("model", ["tiny-bert", "tiny-llama"])
def test_head_only_trains_the_head_alone_and_its_run_reproduces_its_logits(tmp_path, model):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    from peftlab.models.registry import load_model
    from peftlab.training.evaluation import evaluate_run, load_run

    cfg = tiny_cfg(tmp_path / "run", model=model, method="head", head_lr=1e-2, max_train_samples=32)
    result = train(cfg)
    validate(result)
    base, tokenizer = load_model(model, num_labels=2, seed=cfg.seed, pooling="native")  # the untrained model
    fresh = {n: p.detach() for n, p in base.state_dict().items()}
    heads = {"tiny-bert": ("classifier.", "bert.pooler."), "tiny-llama": ("score.",)}[model]
    head_numel = sum(p.numel() for n, p in fresh.items() if n.startswith(heads))
    assert result["trainable_params"] == {"adapter": 0, "head": head_numel, "total": head_numel}
    assert set(result["group_lrs"]) == {"head"} and result["group_lrs"]["head"] == 1e-2 and result["targets"] == ""
    saved = load_file(str(tmp_path / "run" / "adapter" / "model.safetensors"))
    frozen = [n for n in saved if not n.startswith(heads)]
    assert frozen and all(torch.equal(saved[n], fresh[n]) for n in frozen), "a base weight moved"
    assert any(not torch.equal(saved[n], fresh[n]) for n in saved if n.startswith(heads)), "the head did not train"
    # the saved run: plain transformers, peftlab's loader and `peftlab evaluate` agree with what training measured
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "adapter").eval()
    ours = load_run(tmp_path / "run").model.eval()
    batch = tokenizer(["a first sentence .", "and a second, longer one ?"], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, ours(**batch).logits, atol=1e-6, rtol=0)
    assert evaluate_run(tmp_path / "run") == pytest.approx(result["best"]["metrics"])
