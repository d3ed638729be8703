"""Fused QKV projections split into three linear layers q, k, v for training, and fused back for export.

GPT-2 (``attn.c_attn``, a Conv1D), Phi-3 (``self_attn.qkv_proj``), Falcon (``self_attention.query_key_value``)
and ModernBERT (``attn.Wqkv``) compute q, k and v with one matrix. Yao et al.'s recipe needs them apart (W_q and
W_v at their own rates, W_k frozen), so :func:`split_fused_qkv` replaces each fused module by a :class:`SplitQKV`
of three ``nn.Linear`` children ``q_proj``, ``k_proj``, ``v_proj`` whose outputs it lays back out in the fused
order: the model's forward is unchanged (to float rounding) and peft adapts ``...c_attn.q_proj`` like Llama's.
Every fused output is ``groups`` blocks of ``[q rows | k rows | v rows]``, the widths read off the attention
module's own attributes (what its forward uses) and checked to add up to the matrix's rows. The
:class:`FusedSplit` record goes beside an adapter (``fused_qkv.json``); :func:`fuse_qkv` rebuilds the original
layout, so a merged export is a standard transformers model of the original architecture.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from peftlab.errors import PeftlabError

NOTE_FILE = "fused_qkv.json"
FORMAT = "peftlab fused-qkv split 1"
PARTS = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class Layout:
    """How one fused output is laid out: ``groups`` blocks of ``widths`` = (q, k, v) rows."""

    groups: int
    widths: tuple[int, int, int]
    description: str


def _gpt2(attn: nn.Module) -> Layout:  # c_attn(x).split(split_size, dim=2)
    width = attn.split_size
    return Layout(1, (width, width, width), "[q | k | v], each n_embd wide; Conv1D, weight stored (in, out)")


def _phi3(attn: nn.Module) -> Layout:
    q = attn.config.num_attention_heads * attn.head_dim
    kv = attn.num_key_value_heads * attn.head_dim
    return Layout(1, (q, kv, kv), "[q | k | v]: q num_attention_heads x head_dim, k and v num_key_value_heads x head_dim")


def _modernbert(attn: nn.Module) -> Layout:
    width = attn.config.num_attention_heads * attn.head_dim
    return Layout(1, (width, width, width), "[q | k | v], each hidden_size wide (view(3, heads, head_dim))")


def _falcon(attn: nn.Module) -> Layout:  # FalconAttention._split_heads's three layouts
    head = attn.head_dim
    if attn.new_decoder_architecture:
        per_group = attn.num_heads // attn.num_kv_heads
        return Layout(attn.num_kv_heads, (per_group * head, head, head),
                      f"new_decoder_architecture: {attn.num_kv_heads} kv groups of [{per_group} query heads | key | value]")
    if attn.multi_query:
        return Layout(1, (attn.num_heads * head, head, head), "multi-query: [q | one key head | one value head]")
    return Layout(attn.num_heads, (head, head, head), f"multi-head, interleaved: {attn.num_heads} x [q | k | v] per head")


@dataclass(frozen=True)
class Family:
    pattern: str  # the fused module's name tail (its parent is the attention module that the layout reads)
    layout: Callable[[nn.Module], Layout]


# model_type -> where its fused QKV is and how it is laid out. A family missing here is refused, never guessed.
FAMILIES: dict[str, Family] = {
    "gpt2": Family(r"attn\.c_attn", _gpt2),  # self-attention only (cross-attention is crossattention.c_attn)
    "phi3": Family(r"self_attn\.qkv_proj", _phi3),
    "falcon": Family(r"self_attention\.query_key_value", _falcon),
    "modernbert": Family(r"attn\.Wqkv", _modernbert),
}
# Fused QKV names seen in other families (Bloom, GPT-NeoX, MPT, CodeGen): found to refuse them in one line.
FUSED_PATTERNS = (r"attn\.c_attn", r"self_attention\.query_key_value", r"attention\.query_key_value", r"attn\.Wqkv",
                  r"qkv_proj")


@dataclass(frozen=True)
class SplitModule:
    """One fused module as it was before the split (what :func:`fuse_qkv` rebuilds)."""

    name: str  # dotted name in the model, e.g. transformer.h.0.attn.c_attn
    groups: int
    widths: tuple[int, int, int]  # q, k, v rows per group
    in_features: int
    bias: bool
    fused_class: str  # importable class name, e.g. transformers.pytorch_utils.Conv1D
    transposed: bool  # Conv1D: weight stored (in, out), constructed as Conv1D(nf=out, nx=in)

    @property
    def out_features(self) -> int:
        return self.groups * sum(self.widths)


@dataclass(frozen=True)
class FusedSplit:
    """What :func:`split_fused_qkv` did: empty (falsy) when the model has no fused QKV."""

    model_type: str = ""
    layout: str = ""
    modules: tuple[SplitModule, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.modules)

    @classmethod
    def from_dict(cls, data: dict) -> FusedSplit:
        modules = tuple(SplitModule(**{**m, "widths": tuple(m["widths"])}) for m in data["modules"])
        return cls(data["model_type"], data["layout"], modules)


NO_SPLIT = FusedSplit()


class SplitQKV(nn.Module):
    """Drop-in for a fused QKV projection: ``q_proj``, ``k_proj``, ``v_proj`` (nn.Linear), outputs laid out in
    the fused order (``groups`` blocks of [q | k | v] rows), so the attention's own code reads them unchanged."""

    def __init__(self, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, groups: int):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = q_proj, k_proj, v_proj
        self.groups = groups

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        parts = (self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states))
        return torch.cat([p.unflatten(-1, (self.groups, -1)) for p in parts], dim=-1).flatten(-2)

    def extra_repr(self) -> str:
        return f"groups={self.groups}"


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The (out, in) weight of a Linear or a Conv1D."""
    return module.weight.T if type(module).__name__ == "Conv1D" else module.weight


def _rows(weight: torch.Tensor, split: SplitModule) -> list[torch.Tensor]:
    """(out, ...) fused rows -> the q, k, v rows, each in its own head order."""
    blocks = weight.reshape(split.groups, sum(split.widths), *weight.shape[1:])
    return [part.reshape(split.groups * width, *weight.shape[1:])
            for part, width in zip(blocks.split(list(split.widths), dim=1), split.widths)]


def _fused_rows(parts: list[torch.Tensor], split: SplitModule) -> torch.Tensor:
    blocks = [p.reshape(split.groups, width, *p.shape[1:]) for p, width in zip(parts, split.widths)]
    return torch.cat(blocks, dim=1).reshape(split.out_features, *parts[0].shape[1:])


def fused_modules(model: nn.Module) -> list[str]:
    """Names of linear layers that look like a fused QKV projection (any family, known or not)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"]
    return [n for n in names if any(re.search(rf"(^|\.){p}$", n) for p in FUSED_PATTERNS)]


def split_fused_qkv(model: nn.Module) -> FusedSplit:
    """Replace every fused QKV projection of ``model`` (in place) by a :class:`SplitQKV`; returns what was split
    (:data:`NO_SPLIT` for a model with separate q/k/v, or of a family not in :data:`FAMILIES`: its layout is never
    guessed, and ``resolve_targets`` refuses q, k, v on a matrix left fused, in one line)."""
    found = fused_modules(model)
    model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
    family = FAMILIES.get(model_type)
    if not found or family is None:
        return NO_SPLIT
    regex = re.compile(rf"(^|\.){family.pattern}$")
    records, layouts = [], []
    for name in [n for n in found if regex.search(n)]:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        fused = getattr(parent, child)
        layout = family.layout(parent)
        weight = dense_weight(fused)
        record = SplitModule(name, layout.groups, layout.widths, weight.shape[1], fused.bias is not None,
                             f"{type(fused).__module__}.{type(fused).__qualname__}", type(fused).__name__ == "Conv1D")
        if record.out_features != weight.shape[0]:
            raise PeftlabError(f"{name}: the {model_type} layout ({layout.description}) has {record.out_features} "
                               f"rows, but the matrix has {weight.shape[0]}",
                               fix="report this model's config; peftlab.methods.fused_qkv.FAMILIES reads it wrong")
        setattr(parent, child, _split_module(fused, record))
        records.append(record)
        layouts.append(layout.description)
    return FusedSplit(model_type, "; ".join(sorted(set(layouts))), tuple(records))


def _split_module(fused: nn.Module, record: SplitModule) -> SplitQKV:
    weight = dense_weight(fused).detach()
    weights = _rows(weight, record)
    biases = _rows(fused.bias.detach(), record) if record.bias else [None] * 3
    parts = []
    for w, b in zip(weights, biases):
        linear = nn.Linear(record.in_features, w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
            linear.weight.requires_grad_(fused.weight.requires_grad)
            if b is not None:
                linear.bias.copy_(b)
                linear.bias.requires_grad_(fused.bias.requires_grad)
        parts.append(linear)
    return SplitQKV(*parts, groups=record.groups)


def _parts_of(model: nn.Module, record: SplitModule) -> list[nn.Module]:
    wrapper = model.get_submodule(record.name)
    if not isinstance(wrapper, SplitQKV):
        raise PeftlabError(f"{record.name} is a {type(wrapper).__name__}, not a split q/k/v projection",
                           fix="fuse the model that split_fused_qkv split (after merging its adapter)")
    parts = [getattr(wrapper, p) for p in PARTS]
    if not all(type(p) is nn.Linear for p in parts):
        raise PeftlabError(f"{record.name}'s q/k/v still carry an adapter ({type(parts[0]).__name__})",
                           fix="merge the adapter first (peftlab.methods.saving.merged)")
    return parts


def fused_tensors(model: nn.Module, record: SplitModule) -> dict[str, torch.Tensor]:
    """``{"weight": ..., "bias": ...}`` of ``record``'s module in its original layout, from the split parts."""
    parts = _parts_of(model, record)
    weight = _fused_rows([p.weight.detach() for p in parts], record)
    out = {"weight": weight.T.contiguous() if record.transposed else weight}
    if record.bias:
        out["bias"] = _fused_rows([p.bias.detach() for p in parts], record)
    return out


def fuse_qkv(model: nn.Module, split: FusedSplit) -> nn.Module:
    """Put the original fused modules back (in place; a merged or full fine-tuned model): each becomes its
    original class (Conv1D, FalconLinear, nn.Linear) holding the current q/k/v weights. Returns ``model``."""
    for record in split.modules:
        tensors = fused_tensors(model, record)
        module, _, name = record.fused_class.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        weight = tensors["weight"]
        with torch.device(weight.device):
            fused = cls(record.out_features, record.in_features) if record.transposed else \
                cls(record.in_features, record.out_features, bias=record.bias)
        fused.to(weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(weight)
            if record.bias:
                fused.bias.copy_(tensors["bias"])
        parent_name, _, child = record.name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fused)
    return model


def fused_state_dict(model: nn.Module, split: FusedSplit) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each split module's q/k/v tensors replaced by the fused ones: what the
    original architecture's ``from_pretrained`` reads (the model itself is left split)."""
    state = model.state_dict()
    for record in split.modules:
        for part in PARTS:
            for tensor in ("weight", "bias"):
                state.pop(f"{record.name}.{part}.{tensor}", None)
        for tensor, value in fused_tensors(model, record).items():
            state[f"{record.name}.{tensor}"] = value
    return state


# --------------------------------------------------------------------------- the note beside an adapter

NOTE = ("This adapter targets q/k/v modules that the plain model does not have: peftlab split each fused QKV "
        "projection listed under 'modules' into three nn.Linear children q_proj, k_proj, v_proj (the rows of each "
        "'groups' block of the fused output: 'widths' = q, k, v rows). To load it: peftlab evaluate/predict RUN, "
        "or peftlab export RUN --merged OUT (a standard transformers folder of the original architecture), or in "
        "Python: split = peftlab.methods.fused_qkv.split_for_adapter(base, ADAPTER_DIR); "
        "model = peft.PeftModel.from_pretrained(base, ADAPTER_DIR); and for the original layout "
        "peftlab.methods.fused_qkv.fuse_qkv(model.merge_and_unload(), split).")


def write_note(out_dir: str | Path, split: FusedSplit) -> None:
    """``fused_qkv.json`` (the split record and how to load) and a section in the adapter's README.md."""
    out_dir = Path(out_dir)
    (out_dir / NOTE_FILE).write_text(json.dumps({"format": FORMAT, "note": NOTE, **asdict(split)}, indent=2) + "\n")
    names = ", ".join(sorted({re.sub(r"\.\d+\.", ".N.", m.name) for m in split.modules}))
    section = (f"\n## Fused QKV, split by peftlab\n\nThe base model ({split.model_type}) fuses q, k and v in {names} "
               f"({split.layout}). {NOTE} The split is recorded in `{NOTE_FILE}`.\n")
    readme = out_dir / "README.md"
    readme.write_text((readme.read_text() if readme.is_file() else "") + section)


def read_split(folder: str | Path) -> FusedSplit:
    """The split recorded beside an adapter (:data:`NO_SPLIT` when there is none)."""
    note = Path(folder) / NOTE_FILE
    if not note.is_file():
        return NO_SPLIT
    try:
        data = json.loads(note.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
        return FusedSplit.from_dict(data)
    except (ValueError, KeyError, TypeError) as err:
        raise PeftlabError(f"corrupt {note}: {err}", fix="re-save the adapter with peftlab") from None


def split_for_adapter(base: nn.Module, adapter_dir: str | Path) -> FusedSplit:
    """Split ``base`` (fresh, fused) as the adapter in ``adapter_dir`` was trained; returns the record (NO_SPLIT,
    and ``base`` untouched, for an adapter without one). Refused when ``base`` splits otherwise."""
    saved = read_split(adapter_dir)
    if not saved:
        return NO_SPLIT
    made = split_fused_qkv(base)
    if made != saved:
        raise PeftlabError(f"the adapter in {adapter_dir} was trained on {saved.model_type} split as "
                           f"'{saved.layout}' ({len(saved.modules)} modules), but this base splits as "
                           f"'{made.layout or 'nothing'}' ({len(made.modules)} modules)",
                           fix="load it on the model it was trained from (see its adapter_config.json)")
    return made
