"""Per-projection optimizer groups (Yao et al.: eta_V = lambda * eta_QK) and trainable-parameter counts.

Every trainable tensor goes to the group of the projection it adapts, whatever the method (lora_A/B, KaSA's
lora_diag, DoRA's magnitude, VeRA's vectors, FourierFT's spectrum, full weights): q, k, v, o, gate, up, down, head,
other. Weight decay is decided by tensor rank, as nanoGPT's ``configure_optimizers`` does: matrices decay; vectors
(biases, norms, learned scales) never do, so ``--weight-decay`` cannot pull a method's scales towards 0.
"""

from __future__ import annotations

import torch
from torch import nn

from peftlab.config import OptimConfig  # the optimizer's options: declared with the config (cfg.optim)
from peftlab.methods.targets import ResolvedTargets

GROUP_ORDER = ("q", "k", "v", "o", "gate", "up", "down", "head", "other")
_PEFT_PREFIX = "base_model.model."


def group_of(param_name: str, targets: ResolvedTargets, heads: list[str]) -> str:
    name = param_name[len(_PEFT_PREFIX):] if param_name.startswith(_PEFT_PREFIX) else param_name
    if any(name == head or name.startswith(head + ".") for head in heads):
        return "head"
    return targets.group_of(name.rsplit(".", 1)[0]) or "other"


def param_groups(model: nn.Module, targets: ResolvedTargets, heads: list[str], cfg: OptimConfig,
                 *, verbose: bool = True) -> list[dict]:
    """AdamW parameter groups by projection; prints a size table (like nanoGPT's configure_optimizers)."""
    buckets: dict[tuple[str, bool], list[tuple[str, torch.Tensor]]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        group = group_of(name, targets, heads)
        decay = param.dim() >= 2  # by rank, not by name (nanoGPT's rule)
        buckets.setdefault((group, decay), []).append((name, param))
    groups = []
    for group in GROUP_ORDER:
        for decay in (True, False):
            named = buckets.get((group, decay), [])
            if named:
                groups.append({"name": group, "params": [p for _, p in named], "param_names": [n for n, _ in named],
                               "lr": cfg.lr_of(group), "weight_decay": cfg.weight_decay if decay else 0.0})
    if verbose:
        print("parameter groups:")
        for g in groups:
            print(f"  {g['name']:<5} lr={g['lr']:.3g}  weight_decay={g['weight_decay']:<6g} {len(g['params']):>4} "
                  f"tensors  {sum(p.numel() for p in g['params']):>12,} parameters")
    return groups


def adamw(groups: list[dict]) -> torch.optim.AdamW:
    """AdamW over :func:`param_groups`' groups (each keeps its ``name`` for logging)."""
    return torch.optim.AdamW([{k: v for k, v in g.items() if k != "param_names"} for g in groups])


def configure_optimizer(applied, cfg: OptimConfig, *, verbose: bool = False) -> torch.optim.AdamW:
    """AdamW over the per-projection groups of ``applied`` (what :func:`peftlab.methods.table.apply_method`
    returned): q, k at ``cfg.lr``, v at ``cfg.lr_ratio * cfg.lr``, the head at ``cfg.head_lr``."""
    return adamw(param_groups(applied.model, applied.targets, applied.heads, cfg, verbose=verbose))


def count_trainable(model: nn.Module, targets: ResolvedTargets, heads: list[str]) -> dict[str, int]:
    """Trainable parameters as the papers' #Param: adapter (everything but the head), head, total.

    Tensors are counted by identity, so a head shared or tied with another module is counted once; peft's
    frozen original copy of a ``modules_to_save`` head is not trainable and not counted.
    """
    seen: set[int] = set()
    counts = {"adapter": 0, "head": 0}
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        key = "head" if group_of(name, targets, heads) == "head" else "adapter"
        counts[key] += param.numel()
    counts["total"] = counts["adapter"] + counts["head"]
    return counts
