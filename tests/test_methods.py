"""The method table, checked like peft's TEST_CASES: every method x target set x tiny architecture.

A new row in ``peftlab.methods.table.METHODS`` is picked up by every parametrised test here; the tables
``ADAPTER_TENSORS`` and ``ADAPTER_NUMEL`` below say which trainable tensors (and how many parameters) the
method puts on each adapted projection, and a method missing from them fails with a message saying so.

Expectations are written independently of the library: the module names of each projection come from
``ARCHS`` (not from ``peftlab.methods.targets``), a tensor's group and learning rate from those names, and parameter
counts from the weight shapes. GPT-2 fuses q, k, v into one Conv1D (``attn.c_attn``), which ``apply_method`` splits
into linear ``c_attn.q_proj/k_proj/v_proj`` layers (the split layouts themselves are checked family by family in
``tests/test_families.py``); its ``c_proj`` (o) stays a Conv1D, which KaSA cannot adapt.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, replace

import pytest
import torch
from torch import nn

from peftlab.methods import kasa
from peftlab.methods.fused_qkv import split_for_adapter
from peftlab.methods.saving import is_peft, load_trained, merged, save_trained
from peftlab.errors import PeftlabError
from peftlab.config import FourierFTOptions, KasaOptions
from peftlab.methods.table import METHODS, MethodConfig, apply_method, extra_loss
from peftlab.methods.optim_groups import OptimConfig, count_trainable, param_groups

from test_train import assert_trained  # noqa: E402  (tests/ is on sys.path, as for conftest)

pytestmark = pytest.mark.usefixtures("single_thread")

RANK = 4
N_FREQUENCY = 40  # FourierFT: must stay below in*out of the smallest adapted matrix (Llama's k: 32 x 16)
LR, LR_RATIO, HEAD_LR = 1e-3, 4.0, 3e-3
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Arch:
    model_type: str
    layer: str  # module path of attention layer i, with {i}
    projections: dict  # projection -> module name relative to the layer (a fused matrix's split part: c_attn.q_proj)
    heads: tuple  # the task-head modules that a run trains in full (output layer, and BERT's pooler)
    fused: str | None = None  # the fused QKV module (relative to the layer) that apply_method splits
    conv1d: tuple = ()  # projections stored as a Conv1D (weights (in, out))

    def modules(self, projection: str, n_layers: int = 2) -> tuple[str, ...]:
        return tuple(f"{self.layer.format(i=i)}.{self.projections[projection]}" for i in range(n_layers))


ARCHS = {
    "bert": Arch("bert", "bert.encoder.layer.{i}.attention",
                 {"q": "self.query", "k": "self.key", "v": "self.value", "o": "output.dense"},
                 ("classifier", "bert.pooler.dense")),  # BERT's pooler is the head's hidden layer
    "llama": Arch("llama", "model.layers.{i}.self_attn",
                  {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}, ("score",)),
    "deberta-v2": Arch("deberta-v2", "deberta.encoder.layer.{i}.attention",
                       {"q": "self.query_proj", "k": "self.key_proj", "v": "self.value_proj", "o": "output.dense"},
                       ("pooler", "classifier")),
    "qwen2": Arch("qwen2", "model.layers.{i}.self_attn",
                  {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}, ("score",)),
    "gpt2": Arch("gpt2", "transformer.h.{i}.attn",
                 {"q": "c_attn.q_proj", "k": "c_attn.k_proj", "v": "c_attn.v_proj", "o": "c_proj"}, ("score",),
                 fused="c_attn", conv1d=("o",)),
}
TARGET_SETS = [("q", "v"), ("q", "k", "v"), ("v",), ("q", "k")]

# Methods that adapt no projection (head-only): their targets are empty whatever was asked, nothing but the head
# trains, and the model is saved without peft. Methods whose model is not a PeftModel.
NO_TARGET_METHODS = {"head"}
PEFT_FREE = {"full", "head"}

_LORA = {"lora_A.default.weight", "lora_B.default.weight"}
# method -> the trainable tensors on each adapted projection (suffix after the module name)
ADAPTER_TENSORS = {
    "full": None,  # the projection's own weight (and bias, where it has one)
    "lora": _LORA,
    "dora": _LORA | {"lora_magnitude_vector.default.weight"},
    "pissa": _LORA,
    "milora": _LORA,
    "kasa": _LORA | {"lora_diag.default"},
    "corda": _LORA,
    "vera": {"vera_lambda_b.default", "vera_lambda_d.default"},
    "fourierft": {"fourierft_spectrum.default"},
    "head": set(),  # adapts no projection
}
# method -> trainable parameters per adapted projection, from (in_features, out_features, has_bias)
ADAPTER_NUMEL = {
    "full": lambda i, o, bias: i * o + (o if bias else 0),
    "lora": lambda i, o, bias: RANK * (i + o),
    "dora": lambda i, o, bias: RANK * (i + o) + o,
    "pissa": lambda i, o, bias: RANK * (i + o),
    "milora": lambda i, o, bias: RANK * (i + o),
    "kasa": lambda i, o, bias: RANK * (i + o) + RANK,
    "corda": lambda i, o, bias: RANK * (i + o),
    "vera": lambda i, o, bias: RANK + o,
    "fourierft": lambda i, o, bias: N_FREQUENCY,
    "head": lambda i, o, bias: 0,
}


def method_config(method: str, targets, **overrides) -> MethodConfig:
    return MethodConfig(method=method, targets=targets, rank=RANK, alpha=8.0,
                        fourierft=FourierFTOptions(n_frequency=N_FREQUENCY), **overrides)


def calibration_inputs(n: int = 8, length: int = 16) -> list[dict[str, torch.Tensor]]:
    """One-example batches (no pad token) for methods whose init runs the model over task inputs (CorDA)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 128, (n, length), generator=generator)
    return [{"input_ids": ids[i:i + 1], "attention_mask": torch.ones(1, length, dtype=torch.long)} for i in range(n)]


def adapt(model: nn.Module, cfg: MethodConfig, **kwargs):
    """``apply_method`` with SEQ_CLS, plus a calibration pass for the methods that need one."""
    if getattr(METHODS[cfg.method], "needs_calibration", False):
        @torch.no_grad()
        def calibration():
            was_training = model.training
            model.eval()
            for batch in calibration_inputs():
                model(**batch)
            model.train(was_training)

        kwargs["calibration"] = calibration
    kwargs.setdefault("task_type", "SEQ_CLS")
    return apply_method(model, cfg, **kwargs)


def in_out(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or a transposed Conv1D."""
    weight = module.weight
    if type(module).__name__ == "Conv1D":
        return weight.shape[0], weight.shape[1]
    return weight.shape[1], weight.shape[0]


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The (out, in) matrix of a Linear or a Conv1D."""
    weight = module.weight.detach().float()
    return weight.T if type(module).__name__ == "Conv1D" else weight


def strip(name: str) -> str:
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


def expected_modules(arch: Arch, targets) -> dict[str, tuple[str, ...]]:
    return {p: arch.modules(p) for p in targets}


def splits(arch: Arch, targets) -> bool:
    """Whether apply_method splits the fused QKV matrix: the model has one and --targets names q, k or v."""
    return arch.fused is not None and bool({"q", "k", "v"} & set(targets))


def is_accepted(method: str, arch: Arch, targets) -> bool:
    if splits(arch, targets) and not METHODS[method].fused_qkv:
        return False
    return METHODS[method].conv1d or not set(targets) & set(arch.conv1d)


def split_copy(model: nn.Module) -> nn.Module:
    """A copy of the unadapted model with its fused QKV split as apply_method splits it (to read the split
    layers' shapes and weights; a model without fused QKV is copied as it is)."""
    from peftlab.methods.fused_qkv import split_fused_qkv

    reference = copy.deepcopy(model)
    split_fused_qkv(reference)
    return reference


def owner_of(name: str, modules: dict[str, tuple[str, ...]], heads) -> tuple[str, str, str]:
    """(group, module, suffix) of a parameter name, from the expected module names; fails outside them."""
    name = strip(name)
    for head in heads:
        if name.startswith(head + "."):
            return "head", head, name[len(head) + 1:]
    for group, names in modules.items():
        for module in names:
            if name.startswith(module + "."):
                return group, module, name[len(module) + 1:]
    raise AssertionError(f"trainable tensor {name} is neither in a targeted projection nor in the head")


def expected_lr(group: str, lr_ratio: float, head_lr: float | None) -> float:
    if group == "v":
        return LR * lr_ratio
    if group == "head":
        return head_lr if head_lr is not None else LR
    return LR


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@torch.no_grad()
def perturb(model: nn.Module, scale: float = 0.05, seed: int = 123) -> None:
    """Simulate training: add seeded noise to every trainable tensor (heads included)."""
    generator = torch.Generator().manual_seed(seed)
    for _, param in sorted(trainable(model).items()):
        param.add_(scale * torch.randn(param.shape, generator=generator))


@torch.no_grad()
def logits(model: nn.Module, inputs) -> torch.Tensor:
    model.eval()
    return model(**inputs).logits.detach().clone()


def adapted_layers(model: nn.Module, modules) -> dict[str, nn.Module]:
    """The peft layers wrapping the given module names, by name."""
    inner = model.base_model.model
    return {name: inner.get_submodule(name) for name in modules}


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert message and "\n" not in message, f"error message is not one line: {message!r}"
    return message


# --------------------------------------------------------------------------- the method x target x arch matrix

def target_sets(method: str) -> list[tuple]:
    """The target sets a method is checked on: head-only adapts none, so once, with none."""
    return [()] if method in NO_TARGET_METHODS else TARGET_SETS


CASES = [(m, a, t) for m in METHODS for a in ARCHS for t in target_sets(m)]
ACCEPTED = [c for c in CASES if is_accepted(c[0], ARCHS[c[1]], c[2])]
# what is refused: a method that cannot adapt a Conv1D, asked for GPT-2's o (c_proj) beside its split q, v
REFUSED = [c for c in CASES if not is_accepted(c[0], ARCHS[c[1]], c[2])] + [
    (m, a, ("q", "v", "o")) for m in METHODS for a, arch in ARCHS.items()
    if m not in NO_TARGET_METHODS and not is_accepted(m, arch, ("q", "v", "o"))]


def _case_id(case) -> str:
    method, arch, targets = case
    return f"{method}-{arch}-{''.join(targets)}"


def test_every_method_has_expectations():
    missing = sorted(set(METHODS) - set(ADAPTER_TENSORS) | set(METHODS) - set(ADAPTER_NUMEL))
    assert not missing, f"add the trainable tensors and counts of {missing} to ADAPTER_TENSORS/ADAPTER_NUMEL"
    assert any(a.fused for a in ARCHS.values()) and sum(not a.fused for a in ARCHS.values()) >= 3
    # every method adapts the split q/k/v of a fused matrix (`peftlab methods` says so: fused QKV "yes")
    assert all(METHODS[m].fused_qkv for m in METHODS if m not in NO_TARGET_METHODS)
    assert REFUSED and all(set(t) & set(ARCHS[a].conv1d) for _, a, t in REFUSED)


@pytest.mark.parametrize("case", ACCEPTED, ids=_case_id)
def test_trainable_set_groups_and_counts(case, tiny_model):
    method, arch_name, target_set = case
    arch = ARCHS[arch_name]
    model = tiny_model(arch.model_type)
    original = split_copy(model)  # the shapes of the layers the method adapts (a fused QKV's split parts)
    applied = adapt(model, method_config(method, target_set))
    model, targets, heads = applied.model, applied.targets, applied.heads

    # targets and heads resolve to the architecture's modules (split q/k/v of a fused matrix included)
    modules = expected_modules(arch, target_set)
    assert targets.modules == modules
    assert set(targets.conv1d) == {n for p in arch.conv1d if p in target_set for n in arch.modules(p)}
    assert (applied.split is not None) == splits(arch, target_set)
    if applied.split is not None:
        assert [m.name for m in applied.split.modules] == [f"{arch.layer.format(i=i)}.{arch.fused}" for i in range(2)]
    assert heads == list(arch.heads)
    assert is_peft(model) == (method not in PEFT_FREE)

    # the trainable set: exactly the method's tensors on each targeted projection, plus the whole head
    params = trainable(model)
    per_module: dict[str, set[str]] = {}
    for name in params:
        group, module, suffix = owner_of(name, modules, heads)
        per_module.setdefault(module, set()).add(suffix)
    for group, names in modules.items():
        for name in names:
            base = original.get_submodule(name)
            want = ADAPTER_TENSORS[method]
            if want is None:
                want = {"weight"} | ({"bias"} if base.bias is not None else set())
            assert per_module.get(name) == want, f"{name}: trainable {per_module.get(name)}, expected {want}"
    for head in heads:
        head_numel = sum(p.numel() for p in original.get_submodule(head).parameters())
        got = sum(p.numel() for n, p in params.items() if strip(n).startswith(head + "."))
        assert got == head_numel, f"head {head}: {got} trainable parameters, expected {head_numel}"

    # optimizer groups: each trainable tensor in exactly one group, with its projection's learning rate
    for lr_ratio, head_lr in ((LR_RATIO, HEAD_LR), (1.0, None)):  # fused or not: v at lr_ratio x lr
        groups = param_groups(model, targets, heads, OptimConfig(lr=LR, lr_ratio=lr_ratio, head_lr=head_lr,
                                                                 weight_decay=0.01), verbose=False)
        seen: dict[int, int] = {}
        for g in groups:
            assert len(g["params"]) == len(g["param_names"])
            for name, param in zip(g["param_names"], g["params"]):
                assert param.requires_grad, f"frozen tensor {name} in optimizer group {g['name']}"
                assert param is params[name]
                seen[id(param)] = seen.get(id(param), 0) + 1
                group, _, _ = owner_of(name, modules, heads)
                assert g["name"] == group, f"{name} is in group {g['name']}, expected {group}"
                assert math.isclose(g["lr"], expected_lr(group, lr_ratio, head_lr)), (name, g["lr"])
                if name.endswith("bias"):
                    assert g["weight_decay"] == 0.0, f"bias {name} is decayed"
        for name, param in params.items():
            assert seen.get(id(param), 0) == 1, f"{name} is in {seen.get(id(param), 0)} optimizer groups"

    # parameter counts: head = the head's trainable tensors; adapter = the rest, as the method's formula says
    counts = count_trainable(model, targets, heads)
    direct_head = sum(p.numel() for n, p in params.items() if owner_of(n, modules, heads)[0] == "head")
    direct_adapter = sum(p.numel() for n, p in params.items()) - direct_head
    assert counts == {"adapter": direct_adapter, "head": direct_head, "total": direct_adapter + direct_head}
    formula = sum(ADAPTER_NUMEL[method](*in_out(original.get_submodule(n)), original.get_submodule(n).bias is not None)
                  for names in modules.values() for n in names)
    assert counts["adapter"] == formula
    if method in NO_TARGET_METHODS:  # head-only: every head parameter trains, nothing else does
        assert counts["adapter"] == 0
        assert counts["head"] == sum(p.numel() for h in arch.heads for p in original.get_submodule(h).parameters())


@pytest.mark.parametrize("case", REFUSED, ids=_case_id)
def test_conv1d_refusals(case, tiny_model):
    method, arch_name, target_set = case
    arch = ARCHS[arch_name]
    model = tiny_model(arch.model_type)
    with pytest.raises(PeftlabError) as err:
        adapt(model, method_config(method, target_set))
    message = one_line(err)
    assert method in message and "Conv1D" in message
    assert any(name in message for p in arch.conv1d for name in arch.modules(p))  # names the layer it cannot adapt


def test_a_fused_matrix_left_fused_is_refused_in_one_line(tiny_model):
    """resolve_targets on a GPT-2 that nobody split: {q,v} of c_attn cannot be adapted; it says how to split it."""
    from peftlab.methods.targets import resolve_targets

    with pytest.raises(PeftlabError) as err:
        resolve_targets(tiny_model("gpt2"), ("q", "v"))
    message = one_line(err)
    assert "c_attn" in message and "{q,v}" in message and "split_fused_qkv" in message
    assert resolve_targets(tiny_model("gpt2"), ("o",)).modules == {"o": ARCHS["gpt2"].modules("o")}  # nothing fused


@pytest.mark.parametrize("method", list(METHODS))
def test_no_head_when_head_not_trained(method, tiny_model):
    """train_head=False (causal LM runs): only the targeted projections train, nothing counts as head; head-only
    would train nothing and is refused in one line."""
    arch = ARCHS["llama"]
    if method in NO_TARGET_METHODS:
        with pytest.raises(PeftlabError) as err:
            adapt(tiny_model(arch.model_type), method_config(method, ("q", "v")), train_head=False, task_type=None)
        assert "trains only the task head" in one_line(err)
        return
    applied = adapt(tiny_model(arch.model_type), method_config(method, ("q", "v")),
                    train_head=False, task_type=None)
    model, targets, heads = applied.model, applied.targets, applied.heads
    assert heads == []
    modules = expected_modules(arch, ("q", "v"))
    params = trainable(model)
    assert params and all(owner_of(n, modules, heads)[0] in ("q", "v") for n in params)
    counts = count_trainable(model, targets, heads)
    assert counts["head"] == 0 and counts["adapter"] == sum(p.numel() for p in params.values())


# --------------------------------------------------------------------------- merge and save/load round trip

# (arch, targets) per architecture for the round-trip tests: Llama adds o and GQA shapes, GPT-2 the split fused
# matrix beside a Conv1D o (KaSA, which cannot adapt the Conv1D, is checked there without o)
ROUND_TRIP = [("bert", ("q", "v")), ("llama", ("q", "k", "v", "o")), ("gpt2", ("q", "k", "v", "o"))]
ROUND_TRIP_CASES = [(m, a, () if m in NO_TARGET_METHODS else t if is_accepted(m, ARCHS[a], t) else ("q", "k", "v"))
                    for m in METHODS for a, t in ROUND_TRIP]


def _trained(method, arch_name, target_set, tiny_model, inputs, **overrides):
    model = tiny_model(ARCHS[arch_name].model_type)
    original = copy.deepcopy(model)
    before = logits(original, inputs)
    applied = adapt(model, method_config(method, target_set, **overrides))
    perturb(applied.model)
    out = logits(applied.model, inputs)
    assert not torch.allclose(out, before, atol=1e-4), "perturbing the trainable tensors changed nothing"
    return applied, original, out


def _assert_merged_equivalent(model, unmerged, inputs, split=None, original=None) -> None:
    plain = merged(model, split=split)
    assert not is_peft(plain)
    leftovers = [n for n, _ in plain.named_parameters()
                 if any(k in n for k in ("lora_", "vera_", "fourierft_", "modules_to_save", "original_module"))]
    assert not leftovers, f"merged model still has adapter tensors: {leftovers[:3]}"
    assert not any("Wrapper" in type(m).__name__ for m in plain.modules())
    torch.testing.assert_close(logits(plain, inputs), unmerged, atol=1e-5, rtol=0)
    if original is not None:  # fused back: the original architecture's parameter names, shapes and module types
        shapes = {n: tuple(p.shape) for n, p in original.named_parameters()}
        assert {n: tuple(p.shape) for n, p in plain.named_parameters()} == shapes
        assert [type(m).__name__ for m in plain.modules()] == [type(m).__name__ for m in original.modules()]


@pytest.mark.parametrize("case", ROUND_TRIP_CASES, ids=_case_id)
def test_merge_equivalence(case, tiny_model, inputs):
    method, arch_name, target_set = case
    applied, original, unmerged = _trained(method, arch_name, target_set, tiny_model, inputs)
    _assert_merged_equivalent(applied.model, unmerged, inputs, split=applied.split,
                              original=original if applied.split is not None else None)


# Task heads that are composite modules without a .weight: RoBERTa's classification head (dense + out_proj) and
# DeBERTa-v2's ContextPooler. peft 0.21's merge_and_unload for VeRA and FourierFT (BaseTuner._replace_module)
# reads the head's .weight and raised AttributeError on them; peftlab.methods.saving.merged unwraps the head first.
COMPOSITE_HEAD_CASES = [(m, a, ("q", "v")) for m in METHODS for a in ("roberta", "deberta-v2")]


@pytest.mark.parametrize("case", COMPOSITE_HEAD_CASES, ids=_case_id)
def test_merge_equivalence_composite_head(case, tiny_model, inputs):
    from peftlab.methods.targets import head_module_names

    method, model_type, target_set = case
    model = tiny_model(model_type)
    assert any(not hasattr(model.get_submodule(h), "weight") for h in head_module_names(model))
    applied = adapt(model, method_config(method, target_set))
    model, heads = applied.model, applied.heads
    assert heads
    perturb(model)
    _assert_merged_equivalent(model, logits(model, inputs), inputs)


@pytest.mark.parametrize("case", ROUND_TRIP_CASES, ids=_case_id)
def test_save_load_round_trip(case, tiny_model, inputs, tmp_path):
    method, arch_name, target_set = case
    applied, original, out = _trained(method, arch_name, target_set, tiny_model, inputs)
    save_trained(applied.model, tmp_path / "adapter", base_model=arch_name, applied=applied)
    loaded = load_trained(copy.deepcopy(original), tmp_path / "adapter", base_model=arch_name)
    assert is_peft(loaded) == (method not in PEFT_FREE)
    torch.testing.assert_close(logits(loaded, inputs), out, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- PiSSA and MiLoRA

SVD_ARCHS = [("bert", ("q", "v")), ("llama", ("q", "k", "v")), ("gpt2", ("q", "k", "v"))]
# methods whose init moves singular components of W into the adapter and saves a converted rank-2r LoRA
CONVERTED = [name for name, m in METHODS.items() if m.converts_to_lora]
CONVERTED_CASES = [(m, a, t) for m in CONVERTED for a, t in SVD_ARCHS if is_accepted(m, ARCHS[a], t)]


def test_pissa_and_milora_convert():
    assert {"pissa", "milora"} <= set(CONVERTED)


@pytest.mark.parametrize("case", CONVERTED_CASES, ids=_case_id)
def test_svd_init_step0_output_unchanged(case, tiny_model, inputs):
    method, arch_name, target_set = case
    model = tiny_model(ARCHS[arch_name].model_type)
    original = split_copy(model)
    applied = adapt(model, method_config(method, target_set))
    model, targets = applied.model, applied.targets
    # the adapter plus the residual base weight reproduce the original model at step 0
    torch.testing.assert_close(logits(model, inputs), logits(original, inputs), atol=1e-5, rtol=0)
    layers = adapted_layers(model, targets.all_modules)
    assert len(layers) == 2 * len(targets.modules)
    for name, layer in layers.items():
        delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        assert torch.linalg.matrix_norm(delta) > 1e-3, f"{name}: the adapter starts at zero"
        torch.testing.assert_close(dense_weight(layer.get_base_layer()) + delta,
                                   dense_weight(original.get_submodule(name)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch_name,target_set", SVD_ARCHS, ids=[a for a, _ in SVD_ARCHS])
@pytest.mark.parametrize("method", ["pissa", "milora"])
def test_svd_init_components(method, arch_name, target_set, tiny_model):
    """PiSSA's adapter holds the r largest singular components of W, MiLoRA's the r smallest (of each split
    q/k/v weight on GPT-2)."""
    model = tiny_model(ARCHS[arch_name].model_type)
    original = split_copy(model)
    applied = adapt(model, method_config(method, target_set))
    model, targets = applied.model, applied.targets
    for name, layer in adapted_layers(model, targets.all_modules).items():
        w = dense_weight(original.get_submodule(name))
        U, S, Vh = torch.linalg.svd(w, full_matrices=False)
        part = slice(-RANK, None) if method == "milora" else slice(0, RANK)  # r smallest / r largest
        want = U[:, part] @ torch.diag(S[part]) @ Vh[part, :]
        delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        torch.testing.assert_close(delta, want, atol=1e-5, rtol=0, msg=f"{method} {name}: wrong components")
        sv = torch.linalg.svdvals(delta)[:RANK]
        torch.testing.assert_close(sv, S[part], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("case", CONVERTED_CASES, ids=_case_id)
def test_svd_methods_save_converted_lora(case, tiny_model, inputs, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    method, arch_name, target_set = case
    applied, original, out = _trained(method, arch_name, target_set, tiny_model, inputs)
    model, targets, heads = applied.model, applied.targets, applied.heads
    save_trained(model, tmp_path / "adapter", applied=applied)

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    lora_a = [v for k, v in saved.items() if "lora_A" in k]
    assert len(lora_a) == len(targets.all_modules)
    assert all(v.shape[0] == 2 * RANK for v in lora_a), "not converted to a rank-2r LoRA"
    assert config["r"] == 2 * RANK and config["init_lora_weights"] is True
    # the trained head travels with the converted adapter
    trained_head = {strip(n).replace(".modules_to_save.default", ""): p for n, p in trainable(model).items()
                    if strip(n).split(".", 1)[0] in heads}
    assert trained_head
    for name, value in trained_head.items():
        key = PEFT_PREFIX + name
        assert key in saved, f"head tensor {key} missing from the saved adapter ({sorted(saved)[:4]}...)"
        torch.testing.assert_close(saved[key], value.detach(), atol=0, rtol=0)

    # the converted adapter on a fresh copy of the ORIGINAL base reproduces the trained model
    loaded = load_trained(copy.deepcopy(original), tmp_path / "adapter")
    torch.testing.assert_close(logits(loaded, inputs), out, atol=1e-5, rtol=0)
    base = copy.deepcopy(original)
    split_for_adapter(base, tmp_path / "adapter")  # plain peft on a split base (a no-op without fused_qkv.json)
    direct = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    torch.testing.assert_close(logits(direct, inputs), out, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- KaSA

KASA_ARCHS = [("bert", ("q", "v")), ("llama", ("q", "k", "v", "o"))]


@pytest.mark.parametrize("arch_name,target_set", KASA_ARCHS, ids=[a for a, _ in KASA_ARCHS])
def test_kasa_truncates_r_smallest_singular_values(arch_name, target_set, tiny_model):
    model = tiny_model(ARCHS[arch_name].model_type)
    original = copy.deepcopy(model)
    applied = adapt(model, method_config("kasa", target_set))
    model, targets = applied.model, applied.targets
    layers = adapted_layers(model, targets.all_modules)
    assert len(layers) == 2 * len(target_set)
    for name, layer in layers.items():
        s_orig = torch.linalg.svdvals(dense_weight(original.get_submodule(name)))
        s_new = torch.linalg.svdvals(dense_weight(layer.get_base_layer()))
        assert s_new.shape == s_orig.shape
        k = s_orig.shape[0]
        assert torch.all(s_new[k - RANK:] < 1e-5 * s_orig[0]), f"{name}: r smallest not removed: {s_new[k - RANK:]}"
        torch.testing.assert_close(s_new[: k - RANK], s_orig[: k - RANK], rtol=1e-4, atol=0)


@pytest.mark.parametrize("arch_name,target_set", KASA_ARCHS, ids=[a for a, _ in KASA_ARCHS])
def test_kasa_regulariser(arch_name, target_set, tiny_model):
    beta, gamma = 0.3, 0.7
    model = tiny_model(ARCHS[arch_name].model_type)
    cfg = method_config("kasa", target_set, kasa=KasaOptions(beta=beta, gamma=gamma, reduction="sum"))
    applied = adapt(model, cfg)
    model, targets = applied.model, applied.targets
    perturb(model)

    terms = []
    for layer in adapted_layers(model, targets.all_modules).values():
        diag = layer.lora_diag["default"].detach()
        A, B = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
        eye = torch.eye(RANK)
        ortho = torch.linalg.norm(B.T @ B - eye, "fro") + torch.linalg.norm(A @ A.T - eye, "fro")
        terms.append(beta * (diag ** 2).sum() + gamma * ortho)
    assert len(terms) == 2 * len(target_set)
    direct_sum = torch.stack(terms).sum()

    loss = extra_loss(model, cfg)
    assert torch.equal(applied.extra_loss(), loss)  # the same hook, bound to the model and its options
    torch.testing.assert_close(loss.detach(), direct_sum, rtol=1e-5, atol=0)
    torch.testing.assert_close(kasa.regulariser(model, cfg).detach(), direct_sum, rtol=1e-5, atol=0)
    loss.backward()  # differentiable w.r.t. the learned singular values
    assert all(layer.lora_diag["default"].grad is not None
               for layer in adapted_layers(model, targets.all_modules).values())

    torch.testing.assert_close(extra_loss(model, replace(cfg, kasa=replace(cfg.kasa, reduction="mean"))).detach(),
                               direct_sum / len(terms), rtol=1e-5, atol=0)


def test_extra_loss_is_none_without_regulariser(tiny_model):
    cfg = method_config("lora", ("q", "v"))
    applied = apply_method(tiny_model("bert"), cfg)
    assert extra_loss(applied.model, cfg) is None and applied.extra_loss() is None
    assert extra_loss(tiny_model("bert"), None) is None  # no method applied


def test_a_missing_package_in_a_builder_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """peft's CorDA imports `attr`; a package missing at build time names the pip package, no traceback."""
    import dataclasses

    from peftlab.cli.main import main
    from peftlab.methods.table import METHODS

    def build(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'attr'", name="attr")

    monkeypatch.setitem(METHODS, "lora", dataclasses.replace(METHODS["lora"], build=build))
    out = tmp_path / "run"
    code = main(["train", "--model", "tiny-bert", "--method", "lora", "--epochs", "1", "--max-train-samples", "8",
                 "--max-eval-samples", "8", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "method 'lora' needs the Python package 'attrs'" in err[0] and "pip install attrs" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("method", ["dora", "kasa", "vera", "fourierft", "full", "lora"])
def test_weight_decay_goes_by_tensor_rank_never_to_learned_vectors(method):
    """--weight-decay decays matrices only: DoRA's magnitude, KaSA's singular values, VeRA's vectors and
    FourierFT's spectrum (all 1-D) are never pulled towards 0."""
    from peftlab.config import TrainConfig
    from peftlab.resolve import build_run_config
    from peftlab.methods.table import apply_method
    from peftlab.models.registry import load_model
    from peftlab.methods.optim_groups import param_groups

    cfg = build_run_config(overrides=dict(model="tiny-bert", method=method, targets="q,v", rank=4,
                                                   weight_decay=0.1))
    model, _ = load_model("tiny-bert")
    applied = apply_method(model, cfg, train_head=True, task_type="SEQ_CLS")
    model, targets, heads = applied.model, applied.targets, applied.heads
    groups = param_groups(model, targets, heads, cfg.optim, verbose=False)
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in g["param_names"]}
    kept = {n for g in groups if g["weight_decay"] == 0 for n in g["param_names"]}
    shapes = dict((n, p.dim()) for n, p in model.named_parameters())
    assert decayed and all(shapes[n] >= 2 for n in decayed)
    assert all(shapes[n] < 2 for n in kept)
    vectors = {"dora": "lora_magnitude_vector", "kasa": "lora_diag", "vera": "vera_lambda", "fourierft": "spectrum"}
    if method in vectors:
        learned = [n for n in kept if vectors[method] in n]
        assert learned and not any(vectors[method] in n for n in decayed)


@pytest.mark.parametrize("text, expected", [("6-11", (6, 7, 8, 9, 10, 11)), ("0,2,4", (0, 2, 4)),
                                            ("0-1,5", (0, 1, 5)), (None, None), ("", None)])
def test_parse_layers(text, expected):
    from peftlab.methods.targets import parse_layers

    assert parse_layers(text) == expected


def test_layers_restrict_the_adapted_blocks(tmp_path):
    from peftlab.config import TrainConfig
    from peftlab.resolve import build_run_config
    from peftlab.errors import PeftlabError
    from peftlab.methods.table import apply_method
    from peftlab.models.registry import load_model
    from peftlab.methods.targets import layer_of, parse_layers

    cfg = build_run_config(overrides=dict(model="tiny-bert", method="lora", targets="q,v", rank=4,
                                                   layers="1"))
    assert cfg.layers == "1"
    model, _ = load_model("tiny-bert")
    applied = apply_method(model, cfg, train_head=True, task_type="SEQ_CLS")
    model, targets = applied.model, applied.targets
    assert targets.all_modules and {layer_of(n) for n in targets.all_modules} == {1}
    lora = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    assert lora and all(".layer.1." in n for n in lora)
    with pytest.raises(PeftlabError, match="--layers asks for layer 5, but this model's blocks are 0-1"):
        apply_method(load_model("tiny-bert")[0], build_run_config(overrides=dict(
            model="tiny-bert", method="lora", layers="5")), train_head=True, task_type="SEQ_CLS")
    with pytest.raises(PeftlabError, match="is not a layer index or range"):
        parse_layers("3-1")


@pytest.mark.parametrize("model_name, targets, expected", [
    ("tiny-bert", "q,v,up,down", {"up": "intermediate.dense", "down": "output.dense"}),
    ("tiny-llama", "gate,up,down", {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}),
])
def test_mlp_projections_are_targets_too(tmp_path, model_name, targets, expected):
    from peftlab.config import TrainConfig
    from peftlab.resolve import build_run_config
    from peftlab.methods.table import apply_method
    from peftlab.models.registry import load_model
    from peftlab.methods.optim_groups import param_groups
    from peftlab.training.loop import train

    cfg = build_run_config(overrides=dict(model=model_name, method="lora", targets=targets, rank=4,
                                                   lr=1e-3, lr_ratio=2))
    model, _ = load_model(model_name)
    applied = apply_method(model, cfg, train_head=True, task_type="SEQ_CLS")
    model, resolved, heads = applied.model, applied.targets, applied.heads
    for group, suffix in expected.items():
        assert resolved.modules[group] and all(n.endswith(suffix) for n in resolved.modules[group])
    assert not any("attention.output" in n for n in resolved.modules.get("down", ()))  # that is o, not the MLP
    groups = {g["name"]: g["lr"] for g in param_groups(model, resolved, heads, cfg.optim, verbose=False)}
    for group in expected:
        assert groups[group] == pytest.approx(1e-3)  # MLP projections train at eta_QK (lambda is V's alone)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    in_groups = sum(p.numel() for g in param_groups(model, resolved, heads, cfg.optim, verbose=False) for p in g["params"])
    assert in_groups == trainable  # nothing trainable is left out of the optimizer
    result = train(build_run_config(overrides=dict(
        task="rte", model=model_name, method="lora", targets=targets, rank=4, epochs=1, batch_size=8, max_length=32,
        max_train_samples=16, max_eval_samples=8, output_dir=str(tmp_path / "run"))))
    assert_trained(result)
    assert set(expected) <= set(result["group_lrs"])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_apply_method_returns_its_state_and_sets_nothing_on_the_model(method, tiny_model):
    """What an init decided travels in AppliedMethod.init_stats; no peftlab_* attribute is stuck on a module."""
    cfg = method_config(method, ("q", "v"))
    applied = adapt(tiny_model("bert"), cfg)
    assert applied.method is cfg and applied.heads
    assert bool(applied.targets.all_modules) == (method not in NO_TARGET_METHODS)
    stats = applied.init_stats
    assert (stats.calibration_seconds is not None) == METHODS[method].needs_calibration
    assert (stats.initial_adapter is not None) == METHODS[method].converts_to_lora
    assert (stats.kasa_plan is not None) == (stats.kasa_sigma is not None) == (method == "kasa")
    stuck = [(name, key) for name, module in applied.model.named_modules() for key in vars(module)
             if key.lstrip("_").startswith("peftlab")]
    assert stuck == []



# --------------------------------------------------------------------------- head-only


@pytest.mark.parametrize("flag, value", [("--targets", "q,v"), ("--layers", "1"), ("--lr", "1e-3"),
                                         ("--lr-ratio", "4"), ("--rank", "8")])
def test_head_only_refuses_the_options_it_would_ignore(tmp_path, capsys, flag, value):
    """--method head reads none of the adapter's options: setting one is one line, exit 2, nothing written."""
    from peftlab.cli.main import main

    out = tmp_path / "run"
    code = main(["train", "--model", "tiny-bert", "--method", "head", flag, value, "--output-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"{flag} is set, but method 'head' does not use it" in err[0]
    assert not out.exists()


def test_head_only_config_has_no_targets_and_refuses_causal_lm_tasks():
    from peftlab.config import TrainConfig
    from peftlab.resolve import build_run_config

    cfg = build_run_config(overrides=dict(method="head", targets="q,k", layers="1", lr=1e-3, lr_ratio=4,
                                                   head_lr=2e-3))  # a sweep cell's values it has no use for
    assert cfg.targets == () and cfg.layers is None and cfg.to_dict()["targets"] == ""
    assert (cfg.optim.lr, cfg.optim.lr_ratio, cfg.optim.head_lr) == (2e-3, 1.0, 2e-3)  # the head's rate is the run's only one
    assert TrainConfig.from_dict(cfg.to_dict()).targets == ()  # config.yaml reads back
    with pytest.raises(PeftlabError, match="trains only a task head, and task 'alpaca' has none"):
        build_run_config(overrides=dict(method="head", task="alpaca", model="tiny-llama"))
