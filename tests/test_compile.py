"""--compile (peftlab.training.compile): the train step's model compiled by torch.compile, with results equal to
eager. What is checked, never timed:

* the choice: ``auto`` stays eager until a break-even is measured for the device type; the key is a checked choice
  that may change on --resume and never enters the run key;
* the fallback: a step that does not compile is undone (its gradients cleared, torch's RNG restored) and run
  eagerly, so the run equals an eager run; with one line said; a later failure mid accumulation window is raised;
* equality (inductor, the real C++ build): a compiled LoRA run with dropout, gradient accumulation, --eval-steps,
  --save best and a resume from a mid-run checkpoint gives the eager run's loss per step, final and best metrics
  and adapter within float tolerance; its length-grouped batches (many padded lengths) compile ONE graph
  (torch._dynamo's unique_graphs counter: no recompile per batch, and no graph from the evaluations, which run
  eagerly); no saved tensor name carries torch.compile's ``_orig_mod.`` prefix;
* DoRA and KaSA through dynamo and AOTAutograd (the ``aot_eager`` backend: the same tracing as inductor without its
  C++ build), equal to eager, no recompiles (DoRA compiles with graph breaks: peft's quantisation check);
* --packing's per-example attention runs eagerly inside a compiled model: rows with other example counts and
  boundaries recompile nothing.

Tolerance of the equality (TOLERANCE): float32 has a relative precision of 1.2e-7; inductor fuses pointwise ops and
reorders reductions (layer norm, softmax, the loss mean), each rounding about one unit in the last place
differently, and over a dozen AdamW steps those differences feed back through the weights. Measured here: at most
2e-7 relative on the per-step losses. rtol 1e-5 leaves room for another CPU's vector width (AVX2 vs AVX-512 change
the reduction order) while anything that changes the computation (another dropout mask, a skipped batch or
gradient, another learning rate) moves these losses by 1e-3 or more.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import needs_data
from peftlab.config import ROLES, TrainConfig, build_config
from peftlab.errors import PeftlabError
from peftlab.training import compile as compiling

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the choice (no compilation)


def test_auto_stays_eager_until_a_break_even_is_measured(monkeypatch):
    assert compiling.AUTO_BREAK_EVEN_STEPS["cpu"] == math.inf  # measured on CPU: no per-step gain (BENCHMARKS.md)
    never = compiling.choose("auto", "cpu", 10**9)
    assert not never.enabled and "measured no faster" in never.reason and "--compile on forces it" in never.reason
    for device in ("cpu", "cuda"):
        monkeypatch.setitem(compiling.AUTO_BREAK_EVEN_STEPS, device, None)
        choice = compiling.choose("auto", device, 10**9)
        assert not choice.enabled and f"no break-even measured on {device}" in choice.reason
    monkeypatch.setitem(compiling.AUTO_BREAK_EVEN_STEPS, "cpu", 300)
    assert not compiling.choose("auto", "cpu", 299).enabled
    on = compiling.choose("auto", "cpu", 300)
    assert on.enabled and "300 optimizer steps >= 300" in on.reason
    assert compiling.choose("on", "cpu", 1) == compiling.CompileChoice(True, "--compile on")
    assert compiling.choose("off", "cpu", 10**9) == compiling.CompileChoice(False, "--compile off")


def test_compile_is_a_checked_choice_outside_the_run_key():
    from peftlab.lab.store import config_key

    assert build_config(TrainConfig, overrides={"compile": "ON"}).compile == "on"
    assert TrainConfig().compile == "auto"
    with pytest.raises(PeftlabError, match="compile"):
        build_config(TrainConfig, overrides={"compile": "fast"})
    assert "compile" in ROLES.resumable  # a killed compiled run may resume eagerly (and back)
    eager, compiled = (build_config(TrainConfig, overrides={"compile": c}).to_dict() for c in ("off", "on"))
    assert config_key(eager) == config_key(compiled)


def test_off_never_compiles():
    compiled = compiling.compile_for_training(torch.nn.Linear(2, 2), "off", "cpu", 10**6)
    assert compiled.module is None and not compiled.active
    assert compiled.record()["graphs"] == 0 and compiled.record()["compiled"] is False


# --------------------------------------------------------------------------- the fallback (no compilation)


class FailsMidStep(torch.nn.Module):
    """Stands for a compiled module whose step fails after it has drawn random numbers and left gradients."""

    def __init__(self, model, error):
        super().__init__()
        self.model, self.error = model, error

    def forward(self, x):
        self.model(x).sum().backward()  # dropout draws, gradients accumulate ...
        raise self.error  # ... then the compile fails


def _toy():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).train(), torch.randn(8, 4)


def _work(compiled, model, x):
    def work():
        loss = compiling.training_module(compiled, model)(x).sum()
        loss.backward()
        return loss.detach()

    return work


def _clear(model):
    return lambda: [setattr(p, "grad", None) for p in model.parameters()]


def test_a_first_step_that_fails_is_undone_and_run_eagerly():
    model, x = _toy()
    torch.manual_seed(7)
    expected = _work(None, model, x)()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    _clear(model)()

    compiled = compiling.CompiledTraining("on", compiling.CompileChoice(True, "--compile on"),
                                          module=FailsMidStep(model, RuntimeError("no C++ compiler\nmore")))
    said = []
    torch.manual_seed(7)
    got = compiling.guarded_step(compiled, _work(compiled, model, x), list(model.parameters()), _clear(model),
                                 say=said.append)
    assert torch.equal(got, expected)  # the same dropout mask: the RNG was restored
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected_grads))  # not doubled
    assert said == ["compile: the train step did not compile (RuntimeError: no C++ compiler); training eagerly"]
    assert not compiled.active and compiled.record()["fallback"] == "RuntimeError: no C++ compiler"
    assert compiling.training_module(compiled, model) is model and compiled.first_step_s is not None


def test_a_later_failure_falls_back_only_when_it_can_be_undone():
    from torch._dynamo.exc import TorchDynamoException

    model, x = _toy()
    params = list(model.parameters())

    def confirmed(error):
        return compiling.CompiledTraining("on", compiling.CompileChoice(True, "--compile on"),
                                          module=FailsMidStep(model, error), confirmed=True)

    # a recompile that fails at a window's first batch: undone and eager
    compiled = confirmed(TorchDynamoException("a new shape did not compile"))
    compiling.guarded_step(compiled, _work(compiled, model, x), params, _clear(model), say=lambda line: None)
    assert compiled.fallback.startswith("TorchDynamoException") and all(p.grad is not None for p in params)
    # ... but not mid accumulation window: the window's earlier gradients could not be told apart
    compiled = confirmed(TorchDynamoException("a new shape did not compile"))
    with pytest.raises(TorchDynamoException):
        compiling.guarded_step(compiled, _work(compiled, model, x), params, _clear(model), say=lambda line: None)
    # an error of the model itself (not dynamo's) after the first step is the run's error
    _clear(model)()
    compiled = confirmed(ValueError("bad batch"))
    with pytest.raises(ValueError, match="bad batch"):
        compiling.guarded_step(compiled, _work(compiled, model, x), params, _clear(model), say=lambda line: None)


# --------------------------------------------------------------------------- real runs


def _tiny_cfg(out: Path, **overrides) -> TrainConfig:
    values = dict(task="sst2", model="tiny-bert", max_train_samples=48, max_eval_samples=32, max_length=64,
                  batch_size=8, epochs=2, rank=4, lr=5e-3, dropout=0.1, grad_accum=2, eval_steps=2, save="best",
                  checkpoint_every=2, report_to="none", output_dir=str(out))
    values.update(overrides)
    return build_config(TrainConfig, overrides=values)


def _recording_steps(monkeypatch, fail_at: int | None = None) -> list:
    """Wrap the loop's train_step: (padded shape, loss) of every batch; raise before batch ``fail_at``."""
    import peftlab.training.fit as fit

    # the loop's own step, never an earlier wrapper of this test (a resumed run must not meet the old fault)
    steps, real = [], getattr(fit.train_step, "unwrapped", fit.train_step)

    def train_step(run, batch, trainable):
        if fail_at is not None and run.state.global_step == fail_at:
            raise RuntimeError("injected failure")
        result = real(run, batch, trainable)
        steps.append((tuple(batch["input_ids"].shape), result.loss))
        return result

    train_step.unwrapped = real
    monkeypatch.setattr(fit, "train_step", train_step)
    return steps


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def _same_losses(got: list, expected: list) -> None:
    assert [shape for shape, _ in got] == [shape for shape, _ in expected]
    torch.testing.assert_close(torch.tensor([loss for _, loss in got]), torch.tensor([loss for _, loss in expected]),
                               **TOLERANCE)


@pytest.mark.slow
@needs_data("glue", "SST-2", "train.tsv")
def test_compiled_run_equals_eager_run(tmp_path, monkeypatch, single_thread, capsys):
    from safetensors.torch import load_file

    from peftlab.training.loop import train

    eager_steps = _recording_steps(monkeypatch)
    eager = train(_tiny_cfg(tmp_path / "eager", compile="off"))
    assert eager["compile"]["compiled"] is False and eager["compile"]["graphs"] == 0

    # compiled: killed by a failure after 8 batches (checkpoint at optimizer step 4), then resumed, compiled again
    out = tmp_path / "compiled"
    steps = _recording_steps(monkeypatch, fail_at=8)
    with pytest.raises(RuntimeError, match="injected failure"):
        train(_tiny_cfg(out, compile="on"))
    first_attempt = list(steps)
    assert len(first_attempt) == 8 and "compile: on (--compile on)" in capsys.readouterr().out
    checkpoint = load_file(str(out / "checkpoint" / "trainable.safetensors"))
    assert checkpoint and not [n for n in checkpoint if "_orig_mod" in n]
    assert set(checkpoint) == {n for n, p in _trainable_names(out)}
    steps = _recording_steps(monkeypatch)
    compiled = train(_tiny_cfg(out, compile="on", resume=True))

    _same_losses(first_attempt + steps, eager_steps)
    assert len({shape[1] for shape, _ in eager_steps}) >= 5  # length-grouped: many padded lengths ...
    record = compiled["compile"]
    assert record["compiled"] is True and record["backend"] == "inductor" and record["fallback"] is None
    assert record["graphs"] == record["graphs_after_first_step"] == 1  # ... one graph, evaluations eager
    assert compiled["status"] == eager["status"] and compiled["best"]["epoch"] == eager["best"]["epoch"]
    for key in ("final", "best"):
        for name, value in eager[key]["metrics"].items():
            assert compiled[key]["metrics"][name] == pytest.approx(value, abs=1e-6), (key, name)
    assert [p["step"] for p in compiled["curve"]] == [p["step"] for p in eager["curve"]]
    got, expected = _adapter(out), _adapter(tmp_path / "eager")
    assert got.keys() == expected.keys() and not [n for n in got if "_orig_mod" in n]
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6)


def _trainable_names(out: Path):
    """The trainable tensors' names of the run's (eager) model, as a fresh setup builds it."""
    from peftlab.methods.table import apply_method
    from peftlab.models.registry import load_model
    from peftlab.resolve import resolve_config

    cfg = resolve_config(_tiny_cfg(out))
    model, _ = load_model(cfg.model, num_labels=2, seed=cfg.seed)
    model = apply_method(model, cfg, train_head=True, task_type="SEQ_CLS").model
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dora", "kasa"])
@needs_data("glue", "SST-2", "train.tsv")
def test_dora_and_kasa_compile_and_match_eager(tmp_path, monkeypatch, single_thread, method):
    from peftlab.training.loop import train

    monkeypatch.setattr(compiling, "BACKEND", "aot_eager")
    settings = dict(method=method, max_train_samples=24, epochs=1, eval_steps=0, checkpoint_every=0)
    eager_steps = _recording_steps(monkeypatch)
    eager = train(_tiny_cfg(tmp_path / "eager", compile="off", **settings))
    steps = _recording_steps(monkeypatch)
    compiled = train(_tiny_cfg(tmp_path / "compiled", compile="on", **settings))
    _same_losses(steps, eager_steps)
    record = compiled["compile"]
    assert record["compiled"] is True and record["graphs"] == record["graphs_after_first_step"] >= 1
    if method == "kasa":  # the regulariser (eager, outside the compiled model) is in the objective
        assert compiled["epochs_log"][0]["train_regulariser"] == pytest.approx(
            eager["epochs_log"][0]["train_regulariser"], rel=1e-5)


@pytest.mark.slow
@needs_data("glue", "SST-2", "train.tsv")
def test_a_run_that_does_not_compile_trains_eagerly_after_one_line(tmp_path, monkeypatch, single_thread, capsys):
    from peftlab.training.loop import train

    def broken_backend(graph, example_inputs):
        raise RuntimeError("this backend builds nothing")

    monkeypatch.setattr(compiling, "BACKEND", broken_backend)
    settings = dict(max_train_samples=16, epochs=1, eval_steps=0, checkpoint_every=0)
    eager_steps = _recording_steps(monkeypatch)
    train(_tiny_cfg(tmp_path / "eager", compile="off", **settings))
    capsys.readouterr()
    steps = _recording_steps(monkeypatch)
    result = train(_tiny_cfg(tmp_path / "fallback", compile="on", **settings))
    lines = [line for line in capsys.readouterr().out.splitlines() if "did not compile" in line]
    assert len(lines) == 1 and "BackendCompilerFailed" in lines[0] and lines[0].endswith("training eagerly")
    assert "Traceback" not in lines[0]
    assert [loss for _, loss in steps] == [loss for _, loss in eager_steps]  # exactly the eager run
    assert result["compile"]["compiled"] is False and "BackendCompilerFailed" in result["compile"]["fallback"]


@pytest.mark.slow
def test_packed_rows_recompile_nothing(single_thread):
    """Per-example attention (a loop over the row's examples) runs eagerly between compiled graphs."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoModelForCausalLM

    from peftlab.models.packed_attention import use_packed_attention
    from peftlab.tasks.batching import PackingCollator

    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                  pad_token_id=0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    assert use_packed_attention(model)
    generator = torch.Generator().manual_seed(1)

    def row(lengths):
        ids = [torch.randint(1, 128, (n,), generator=generator).tolist() for n in lengths]
        return PackingCollator()([{"input_ids": i, "labels": i} for i in ids])

    # other example counts and boundaries; the first two rows may trace twice (a count first seen as 2: dynamo's
    # size specialisation), after which no row may compile anything new
    rows = [row((9, 4, 13)), row((5, 7)), row((3, 11, 6, 8)), row((10, 2, 5)), row((6, 6)), row((4, 4, 4, 4, 4))]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    graphs = []
    for batch in rows:
        torch.testing.assert_close(compiled(**batch).loss, model(**batch).loss, **TOLERANCE)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[-1] > 1, graphs  # graph breaks around the eager per-example attention, no recompile
