"""CorDA through peftlab: calibration over task inputs, step-0 equivalence, the oriented components, the
converted save and a short `peftlab train` run.

peft's CorDA README promises the same output as the pre-trained model at the start of adaptation in both
modes ("to ensure the same inference result ... we multiply the inverse of these covariance matrices with
the decomposed components"; peft's ``corda_init`` subtracts s*B0*A0 from the base in KPM and IPM alike), so
step 0 is checked in both.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from conftest import TINY_VOCAB
from peftlab.methods import corda
from peftlab.methods.saving import load_trained, save_trained
from peftlab.errors import PeftlabError
from peftlab.config import CordaOptions
from peftlab.methods.table import METHODS, MethodConfig, apply_method

RANK = 4
N_CALIBRATION = 6
TARGETS = {"bert": ("q", "v"), "llama": ("q", "k", "v", "o"), "gpt2": ("q", "k", "v")}
MODULES = {
    "bert": [f"bert.encoder.layer.{i}.attention.self.{p}" for i in range(2) for p in ("query", "value")],
}


def calibration_examples(count: int = N_CALIBRATION):
    """One-example batches of different lengths, right-padded to 12 (padding must be ignored)."""
    out = []
    for seed in range(count):
        length = 6 + seed % 5
        ids = torch.randint(1, TINY_VOCAB, (1, 12), generator=torch.Generator().manual_seed(100 + seed))
        mask = torch.zeros(1, 12, dtype=torch.long)
        mask[:, :length] = 1
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": torch.tensor([seed % 2])})
    return out


def corda_model(arch: str, mode: str, tiny_model, **overrides):
    model = tiny_model(arch)
    original = copy.deepcopy(model)
    examples = calibration_examples()
    calibration = corda.calibration_from_examples(model, lambda: iter(examples))
    cfg = MethodConfig(method="corda", targets=TARGETS[arch], rank=RANK, alpha=8.0,
                       corda=CordaOptions(mode=mode), **overrides)
    applied = apply_method(model, cfg, task_type="SEQ_CLS", calibration=calibration)
    return applied, original, examples


@torch.no_grad()
def logits(model, inputs):
    model.eval()
    return model(**inputs).logits.detach().clone()


def test_corda_is_in_the_method_table():
    method = METHODS["corda"]
    assert method.svd_init and method.converts_to_lora and method.needs_calibration and method.fused_qkv


@pytest.mark.parametrize("arch,mode", [("bert", "ipm"), ("bert", "kpm"), ("llama", "kpm"), ("llama", "ipm"),
                                       ("gpt2", "ipm")])  # GPT-2: a fused QKV Conv1D
def test_step0_output_unchanged(arch, mode, tiny_model, inputs):
    applied, original, _ = corda_model(arch, mode, tiny_model)
    torch.testing.assert_close(logits(applied.model, inputs), logits(original, inputs), atol=1e-5, rtol=0)
    assert applied.init_stats.calibration_seconds > 0
    assert applied.init_stats.initial_adapter  # A0, B0 for the conversion to plain LoRA at save time


@torch.no_grad()
def _covariances(model: nn.Module, names, examples) -> dict[str, torch.Tensor]:
    """Mean over examples of X^T X / max(X)^2 of each module's unpadded input (CorDA's statistic)."""
    sums = {name: 0.0 for name in names}
    modules = dict(model.named_modules())

    def hook(name):
        def record(module, args, output):
            x = args[0][0].float()  # (tokens, in)
            x = x / x.max().abs()
            sums[name] = sums[name] + x.T @ x
        return record

    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    model.eval()
    for example in examples:
        keep = example["attention_mask"][0].bool()
        model(input_ids=example["input_ids"][:, keep], attention_mask=example["attention_mask"][:, keep])
    for handle in handles:
        handle.remove()
    return {n: s / len(examples) for n, s in sums.items()}


@pytest.mark.parametrize("mode", ["ipm", "kpm"])
def test_adapter_holds_the_covariance_oriented_components(mode, tiny_model):
    """delta = s*B0*A0 satisfies delta (C + lambda I) = U_r S_r V_r^T, the r largest (ipm) / smallest (kpm)
    components of the SVD of W (C + lambda I), with C the unpadded inputs' covariance (lambda: peft's damping)."""
    applied, original, examples = corda_model("bert", mode, tiny_model)
    model, targets = applied.model, applied.targets
    covariances = _covariances(original, MODULES["bert"], examples)
    inner = model.base_model.model
    for name in MODULES["bert"]:
        C = covariances[name]
        damp = 0.01
        while True:  # peft's collect_eigens_for_layer damping
            fixed = C + torch.eye(C.shape[0]) * C.diag().mean() * damp
            if torch.dist(fixed @ torch.linalg.inv(fixed), torch.eye(C.shape[0])) < 0.05:
                break
            damp *= 2
        W = original.get_submodule(name).weight.detach().float()
        U, S, Vh = torch.linalg.svd(W @ fixed, full_matrices=False)
        part = slice(0, RANK) if mode == "ipm" else slice(-RANK, None)
        want = U[:, part] @ torch.diag(S[part]) @ Vh[part, :]
        layer = inner.get_submodule(name)
        delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        torch.testing.assert_close((delta @ fixed).detach(), want, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(layer.get_base_layer().weight + delta, W, atol=1e-5, rtol=0)


def test_corda_without_calibration_is_one_line(tiny_model):
    with pytest.raises(PeftlabError) as err:
        apply_method(tiny_model("bert"), MethodConfig(method="corda", targets=("q", "v"), rank=RANK))
    message = str(err.value)
    assert "\n" not in message and "corda" in message and "calibration" in message


def test_saved_as_plain_lora_on_the_original_base(tiny_model, inputs, tmp_path):
    from safetensors.torch import load_file

    applied, original, _ = corda_model("llama", "kpm", tiny_model)
    model = applied.model
    with torch.no_grad():
        generator = torch.Generator().manual_seed(3)
        for _, param in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    trained = logits(model, inputs)
    save_trained(model, tmp_path / "adapter", applied=applied)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 2 * RANK and config["init_lora_weights"] is True
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert any("score" in k for k in saved), "the trained head must travel with the converted adapter"
    loaded = load_trained(copy.deepcopy(original), tmp_path / "adapter")
    torch.testing.assert_close(logits(loaded, inputs), trained, atol=1e-5, rtol=0)


class _Recorder(nn.Module):
    """Stands in for a model: records the inputs of each forward call."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.calls = []

    def forward(self, **batch):
        self.calls.append({k: v.clone() for k, v in batch.items()})


def test_calibration_runner_first_n_examples_one_at_a_time_unpadded():
    def collate(rows):  # pads to 8 like a pad-to-max collator, on the right
        ids = torch.zeros(len(rows), 8, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
            mask[i, : len(row["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([r["label"] for r in rows])}

    dataset = [{"input_ids": list(range(1, 2 + i)), "label": i % 2, "length": 1 + i} for i in range(7)]
    model = _Recorder().train()
    run = corda.calibration_runner(model, dataset, collate, samples=5)
    assert not model.calls  # nothing runs until CorDA calls it
    run()
    assert [c["input_ids"].tolist() for c in model.calls] == [[list(range(1, 2 + i))] for i in range(5)]
    assert all("labels" not in c and c["attention_mask"].all() for c in model.calls)
    assert model.training  # the caller's mode is restored
    model.calls.clear()
    corda.calibration_runner(model, dataset, collate, samples=100)()
    assert len(model.calls) == 7  # at most the training set


def test_unpadded_handles_left_padding():
    batch = {"input_ids": torch.tensor([[0, 0, 5, 6]]), "attention_mask": torch.tensor([[0, 0, 1, 1]]),
             "token_type_ids": torch.tensor([[0, 0, 0, 0]]), "labels": torch.tensor([1])}
    out = corda.unpadded(batch)
    assert out["input_ids"].tolist() == [[5, 6]] and out["token_type_ids"].shape == (1, 2) and "labels" not in out


def test_train_corda_records_calibration_cost(tmp_path):
    from peftlab.config import TrainConfig
    from peftlab.resolve import build_run_config
    from peftlab.training.loop import train

    cfg = build_run_config(overrides=dict(
        task="rte", model="tiny-bert", method="corda", corda_mode="kpm", corda_samples=4, targets="q,v", rank=4,
        epochs=1, batch_size=8, max_length=32, max_train_samples=16, max_eval_samples=16,
        output_dir=str(tmp_path / "run")))
    result = train(cfg)
    assert result["status"] in ("ok", "no_learning")  # trained to its end (a tiny model need not learn)
    assert result["calibration_seconds"] > 0 and result["init_seconds"] >= result["calibration_seconds"]
    assert result["config"]["corda_mode"] == "kpm" and result["config"]["corda_samples"] == 4
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8  # saved converted: rank 2r plain LoRA
