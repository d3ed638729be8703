"""Resolve logical projections (q, k, v, o; gate, up, down) to module names by inspecting a model.

:data:`_ALIASES` covers BERT-style encoders, DeBERTa-v2, MPNet, DistilBERT, Llama-style decoders, OPT/BART, and the
fused-QKV families (GPT-2, Phi-3, Falcon, ModernBERT) once :mod:`peftlab.methods.fused_qkv` has split them; a
fused QKV matrix still fused is refused for q, k or v in one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peftlab.config import parse_layers, parse_targets  # declared with --targets / --layers (pure text)
from peftlab.errors import PeftlabError

if TYPE_CHECKING:  # torch loads when a model is inspected, not when targets are parsed
    from torch import nn

# Patterns match the tail of a module's dotted name. Each projection is found by the first pattern
# that matches any linear layer, so an architecture never mixes two naming schemes.
_ALIASES: dict[str, tuple[str, ...]] = {
    "q": (r"attention\.self\.query", r"attention\.self\.query_proj", r"attn\.q", r"q_lin", r"q_proj", r"attention\.q"),
    "k": (r"attention\.self\.key", r"attention\.self\.key_proj", r"attn\.k", r"k_lin", r"k_proj", r"attention\.k"),
    "v": (r"attention\.self\.value", r"attention\.self\.value_proj", r"attn\.v", r"v_lin", r"v_proj", r"attention\.v"),
    "o": (r"attention\.output\.dense", r"attn\.o", r"out_lin", r"o_proj", r"self_attn\.out_proj", r"attn\.c_proj",
          r"self_attention\.dense", r"attn\.Wo"),  # ... GPT-2, Falcon, ModernBERT
    # MLP: BERT/RoBERTa/MPNet/DeBERTa (intermediate.dense, then the block's own output.dense, not the attention's),
    # Llama/Mistral/Qwen2/Phi-3 (gate/up/down_proj), GPT-2 (mlp.c_fc, mlp.c_proj), DistilBERT (ffn.lin1/lin2),
    # Falcon (dense_h_to_4h, dense_4h_to_h), ModernBERT (mlp.Wo; its mlp.Wi fuses gate and up, so it is neither).
    "gate": (r"mlp\.gate_proj",),
    "up": (r"intermediate\.dense", r"mlp\.up_proj", r"mlp\.c_fc", r"ffn\.lin1", r"mlp\.dense_h_to_4h"),
    "down": (r"(?<!attention\.)output\.dense", r"mlp\.down_proj", r"mlp\.c_proj", r"ffn\.lin2", r"mlp\.dense_4h_to_h",
             r"mlp\.Wo"),
}


def _is_linear(module: nn.Module) -> bool:
    from torch import nn

    # transformers' GPT-2 uses Conv1D (a transposed linear layer); peft adapts both.
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def linear_layer_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if _is_linear(module)]


def _match(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    for pattern in patterns:
        regex = re.compile(rf"(^|\.){pattern}$")
        found = [n for n in names if regex.search(n)]
        if found:
            return found
    return []


@dataclass(frozen=True)
class ResolvedTargets:
    """Module names per projection group. ``conv1d``: the targets stored transposed (GPT-2's Conv1D ``c_proj``,
    ``c_fc``), for peft's ``fan_in_fan_out``."""

    modules: dict[str, tuple[str, ...]]  # projection group ("q", "k", "v", "o", "gate", "up", "down") -> names
    conv1d: tuple[str, ...] = ()

    @property
    def all_modules(self) -> list[str]:
        return [name for names in self.modules.values() for name in names]

    def group_of(self, module_name: str) -> str | None:
        """The projection group whose module is ``module_name`` or contains it (peft wraps modules)."""
        for group, names in self.modules.items():
            for name in names:
                if module_name == name or module_name.endswith("." + name) or f".{name}." in f".{module_name}.":
                    return group
        return None


NO_TARGETS = ResolvedTargets({})  # a method that adapts no projection (head-only fine-tuning)


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_of(module_name: str) -> int | None:
    """The transformer block index in a module name (``...layer.7.attention...`` -> 7)."""
    match = _LAYER_INDEX.search("." + module_name + ".")
    return int(match.group(1)) if match else None


def _keep_layers(names: list[str], layers: tuple[int, ...] | None) -> list[str]:
    if layers is None:
        return names
    present = sorted({i for i in (layer_of(n) for n in names) if i is not None})
    missing = [i for i in layers if i not in present]
    if missing:
        raise PeftlabError(f"--layers asks for layer {missing[0]}, but this model's blocks are "
                           f"{present[0]}-{present[-1]}" if present else "--layers given, but no layered modules found",
                           fix=f"use indices {present[0]}-{present[-1]}" if present else "drop --layers")
    return [n for n in names if layer_of(n) in layers]


def resolve_targets(model: nn.Module, targets, layers=None) -> ResolvedTargets:
    """Find the modules of each requested projection in ``model`` (only in blocks ``layers``, a tuple of
    indices or a ``--layers`` string, when given); raise a PeftlabError listing the model's linear layers
    when one cannot be found."""
    wanted = parse_targets(targets)
    if isinstance(layers, str):
        layers = parse_layers(layers)
    names = linear_layer_names(model)
    found: dict[str, tuple[str, ...]] = {}
    separate = {p: _match(names, _ALIASES[p]) for p in ("q", "k", "v")}
    qkv = [p for p in wanted if p in ("q", "k", "v")]
    if qkv and not any(separate.values()):
        from peftlab.methods.fused_qkv import FAMILIES, fused_modules

        fused = fused_modules(model)
        if fused:
            model_type = getattr(getattr(model, "config", None), "model_type", "")
            known = model_type in FAMILIES
            raise PeftlabError(
                f"this model fuses q, k and v into one matrix ({fused[0]}), so {{{','.join(qkv)}}} cannot be "
                "adapted " + ("before it is split" if known else
                              f"(peftlab does not know the layout of model type '{model_type}'; it splits "
                              f"{', '.join(FAMILIES)})"),
                fix="split it with peftlab.methods.fused_qkv.split_fused_qkv(model) (apply_method does)" if known else
                    "use a model with separate q/k/v projections, or add its layout to peftlab.methods.fused_qkv.FAMILIES",
            )
    for projection in wanted:
        modules = separate.get(projection) if projection in separate else _match(names, _ALIASES[projection])
        if not modules:
            shown = ", ".join(sorted({re.sub(r"\.\d+\.", ".N.", n) for n in names}))
            raise PeftlabError(
                f"cannot find attention projection '{projection}' in {type(model).__name__}",
                fix=f"this model's linear layers are: {shown}",
            )
        found[projection] = tuple(modules)
    if layers is not None:
        found = {group: tuple(_keep_layers(list(mods), layers)) for group, mods in found.items()}
    conv1d = tuple(n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"
                   and n in {name for mods in found.values() for name in mods})
    return ResolvedTargets(found, conv1d=conv1d)


HEAD_NAMES = ("classifier", "score", "pre_classifier", "pooler", "qa_outputs")


def head_module_names(model: nn.Module) -> list[str]:
    """The task head that a fine-tuning run trains in full.

    The new output layer (``classifier``, ``score``, ...) and, for BERT-style encoders, the encoder's
    ``pooler`` (dense + tanh over [CLS]). The pooler is the head's hidden layer: RoBERTa's classification
    head carries its own dense layer for the same role and peft trains it; a BERT pooler is only useful
    where pre-training trained it (NSP), and in sentence-embedding checkpoints such as all-MiniLM-L6-v2
    it maps every input to nearly the same vector (std ~0.03 across inputs), so a frozen pooler would
    leave the classifier nothing to separate.
    """
    from torch import nn

    heads = [n for n, _ in model.named_children() if n in HEAD_NAMES]
    for name, child in model.named_children():
        pooler = getattr(child, "pooler", None)
        if name not in heads and isinstance(pooler, nn.Module):
            # The pooler's linear layers, not the pooler itself: peft's VeRA/FourierFT unload assumes a
            # modules_to_save entry has a .weight and fails on a composite module.
            heads += [f"{name}.pooler.{sub}" for sub, m in pooler.named_modules() if _is_linear(m)]
    return heads
