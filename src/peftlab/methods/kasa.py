"""KaSA (Wang et al. 2024): SVD truncation of the base + learned singular values, and its regulariser.

peft implements KaSA's layer (the base loses its r smallest singular components, Delta_W = s * B diag(lora_diag) A)
and its per-module regulariser, but leaves adding it to the loss to the user: peftlab adds it through the method's
``extra_loss`` hook, combined over modules by ``--kasa-reduction`` (``mean``: the authors' code; ``sum``: peft's),
and adds two knobs peft lacks (docs/KASA_MODES.md):

* ``--kasa-truncate-rank k`` (default: r): the base loses its k smallest components while the adapter keeps rank r.
* ``--kasa-mode reference``: the authors' released code: the base keeps ``in_features - k`` components and the
  orthogonality penalty uses d x d Gram matrices, whose floor is sqrt(in - r) + sqrt(out - r) instead of 0.

For either, each base is re-truncated from its original weight after peft's init, and the run is saved as a plain
LoRA on the original base (:func:`save_as_lora`), since peft's loader would truncate by its own rule.
"""

from __future__ import annotations

import copy
import re
import weakref
from pathlib import Path

import torch
from torch import nn

from peftlab.errors import PeftlabError
# --kasa-* options: KasaOptions (cfg.kasa), declared with its row in peftlab.methods.registry

ADAPTER = "default"


def kasa_modules(model: nn.Module) -> list[nn.Module]:
    """The adapted layers that carry KaSA's learned singular values."""
    return [m for m in model.modules() if getattr(m, "lora_diag", None) is not None and len(m.lora_diag) > 0]


def singular_values(model: nn.Module) -> dict[str, list[float]] | None:
    """KaSA's learned singular values per adapted module (for KaSA Figure 4-style plots); None without KaSA."""
    out = {}
    for name, module in model.named_modules():
        diag = getattr(module, "lora_diag", None)
        if diag is not None and "default" in diag:
            out[name.removeprefix("base_model.model.")] = diag["default"].detach().float().cpu().tolist()
    return out or None


# --------------------------------------------------------------------------- truncation


def truncate_rank(cfg) -> int:
    """k: how many of the smallest singular components the truncation is defined by (default: the rank)."""
    return cfg.rank if cfg.kasa.truncate_rank is None else cfg.kasa.truncate_rank


def kept_components(in_features: int, out_features: int, k: int, mode: str) -> int:
    """How many of the largest singular components of an (out x in) base weight stay after truncation.

    paper: min(in, out) - k.  reference (the authors' ``svd_rank = self.in_features - r`` followed by the
    slices ``U[:, :svd_rank]``, which stop at min(in, out)): min(in - k, min(in, out)).
    """
    smallest = min(in_features, out_features)
    if mode == "reference":
        return min(in_features - k, smallest)
    return smallest - k


def _in_out(module: nn.Module) -> tuple[int, int]:
    out_features, in_features = module.weight.shape  # KaSA only adapts nn.Linear (peft refuses Conv1D)
    return in_features, out_features


def truncation_plan(model: nn.Module, cfg, module_names) -> dict[str, int]:
    """{module: components to keep} for every target whose truncation differs from peft's (keep min - r).

    Raises a one-line :class:`PeftlabError` unless 1 <= k < min(in, out) for every target.
    """
    k = truncate_rank(cfg)
    modules = dict(model.named_modules())
    shapes = {name: _in_out(modules[name]) for name in module_names}
    smallest = min(min(shape) for shape in shapes.values())
    if not 1 <= k < smallest:
        raise PeftlabError(
            f"--kasa-truncate-rank {k} is out of range: it must be >= 1 and < min(in, out) = {smallest} of the "
            "adapted weights (the truncated base keeps at least one component)",
            fix=f"use --kasa-truncate-rank between 1 and {smallest - 1}",
        )
    plan = {}
    for name, (n_in, n_out) in shapes.items():
        keep = kept_components(n_in, n_out, k, cfg.kasa.mode)
        if keep != min(n_in, n_out) - cfg.rank:
            plan[name] = keep
    return plan



def build(model: nn.Module, cfg, lora_config, module_names):
    """peft's KaSA, then (for k != r or reference mode) each planned base re-truncated from its original weight.

    Returns the model, the truncation plan and, where there is a plan, what each module's truncation drops from
    its original weight, ``{module: (U_d S_d, Vh_d)}`` (:func:`save_as_lora` saves the run from it). One fp32 SVD
    per adapted matrix, taken before peft truncates the weights."""
    from peft import get_peft_model

    plan = truncation_plan(model, cfg, module_names)
    truncated, dropped = {}, {}
    modules = dict(model.named_modules())
    for name in (module_names if plan else ()):  # no plan: peft's own truncation, nothing to take here
        weight = modules[name].weight.detach()
        U, S, Vh = torch.linalg.svd(weight.float(), full_matrices=False)
        kept = plan.get(name, min(weight.shape) - cfg.rank)  # elsewhere peft's rule: min(in, out) - r
        dropped[name] = ((U[:, kept:] * S[kept:]).contiguous(), Vh[kept:, :].contiguous())
        if name in plan:
            truncated[name] = ((U[:, :kept] * S[:kept]) @ Vh[:kept, :]).to(device=weight.device, dtype=weight.dtype)
    model = get_peft_model(model, lora_config)
    for name, weight in truncated.items():
        model.base_model.model.get_submodule(name).get_base_layer().weight.data = weight
    return model, plan, dropped or None


@torch.no_grad()
def save_as_lora(model: nn.Module, out_dir: str | Path, dropped: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Path:
    """Write a trained KaSA ``model`` whose truncation peft's loader would not redo (``--kasa-truncate-rank k !=
    r``, ``--kasa-mode reference``) as a plain LoRA on the *original* base, which plain peft reproduces exactly:

        W_run = W0 - U_d S_d Vh_d + s * B diag(sigma) A      (U_d S_d Vh_d: the components the run dropped)
              = W0 + [-U_d S_d | s * B diag(sigma)] [Vh_d ; A]  = W0 + B' A'

    with rank r' = dropped + r and lora_alpha = r' (scaling 1) per module, through peft's ``rank_pattern`` /
    ``alpha_pattern``. Exact up to fp32 rounding; the head (``modules_to_save``) is kept."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    inner = model.base_model.model
    state = {key: value.detach().contiguous() for key, value in get_peft_model_state_dict(model).items()
             if not key.endswith("lora_diag")}
    ranks = {}
    for name, (dropped_us, dropped_vh) in dropped.items():
        layer = inner.get_submodule(name)
        A, B = layer.lora_A[ADAPTER].weight.float(), layer.lora_B[ADAPTER].weight.float()
        sigma, scaling = layer.lora_diag[ADAPTER].float(), float(layer.scaling[ADAPTER])
        dtype = layer.lora_A[ADAPTER].weight.dtype
        prefix = f"base_model.model.{name}"
        state[f"{prefix}.lora_B.weight"] = torch.cat([-dropped_us.to(B.device), scaling * B * sigma], dim=1).to(dtype)
        state[f"{prefix}.lora_A.weight"] = torch.cat([dropped_vh.to(A.device), A], dim=0).to(dtype)
        ranks[re.escape(name)] = dropped_us.shape[1] + A.shape[0]  # peft reads pattern keys as regexes
    plain = copy.deepcopy(model.peft_config[ADAPTER])
    plain.kasa_config, plain.rank_pattern, plain.alpha_pattern = None, ranks, dict(ranks)
    plain.use_rslora, plain.init_lora_weights = False, True
    plain.save_pretrained(str(out_dir))
    save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(out_dir / "adapter_model.safetensors"),
              metadata={"format": "pt", "peftlab": "KaSA with a non-peft truncation, saved as plain LoRA "
                                                  "(rank = dropped components + r, alpha = rank)"})
    return out_dir


# --------------------------------------------------------------------------- regulariser


# model -> (adapters key, shape groups, module count); weak keys: a model's entry goes when the model does.
_SHAPE_GROUPS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def shape_groups(model: nn.Module) -> tuple[list[list[tuple[nn.Module, str]]], int]:
    """The active (module, adapter) KaSA pairs grouped by shape, and the module count; cached per model.

    Walking every module (hundreds in a transformer) costs about a millisecond of Python per call, and a
    per-module loss launches ~25 small kernels per module forward and backward; ``regulariser`` runs every
    step, so both are paid once here. The cache is keyed by the active adapters and the adapter names in
    ``peft_config``, so adding, deleting or switching adapters rebuilds it.
    """
    adapters = tuple(model.active_adapters) if hasattr(model, "active_adapters") else ("default",)
    key = (adapters, tuple(getattr(model, "peft_config", {}) or {}))
    cached = _SHAPE_GROUPS.get(model)
    if cached is not None and cached[0] == key:
        return cached[1], cached[2]
    modules = kasa_modules(model)
    groups: dict[tuple, list] = {}
    for module in modules:
        for adapter in adapters:
            if adapter in module.lora_diag:
                A, B = module.lora_A[adapter].weight, module.lora_B[adapter].weight
                shape_key = (tuple(A.shape), tuple(B.shape), A.device, A.dtype, B.dtype, adapter)
                groups.setdefault(shape_key, []).append((module, adapter))
    plan = list(groups.values())
    _SHAPE_GROUPS[model] = (key, plan, len(modules))
    return plan, len(modules)


def _group_terms(pairs, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed ||diag||^2 and summed orthogonality of same-shaped modules, batched (one bmm per Gram), in fp32.

    paper:     ||B^T B - I_r||_F + ||A A^T - I_r||_F            (peft's ``_kasa_layer_regularization_loss``)
    reference: ||A^T A - I_in||_F + ||B B^T - I_out||_F       (the authors' ``loss_fn`` in main.py)

    The reference Grams are in x in and out x out, but their norms follow from the r x r ones:
    ||A^T A - I_in||_F^2 = ||A A^T - I_r||_F^2 + (in - r), and likewise for B; so the reference term is
    sqrt(paper_part^2 + d - r), the authors' value and gradient at r x r cost.
    """
    diag = torch.stack([m.lora_diag[a] for m, a in pairs]).float()  # (n, r)
    A = torch.stack([m.lora_A[a].weight for m, a in pairs]).float()  # (n, r, in)
    B = torch.stack([m.lora_B[a].weight for m, a in pairs]).float()  # (n, out, r)
    r = diag.shape[-1]
    eye = torch.eye(r, device=diag.device, dtype=torch.float32)
    part_a = torch.linalg.matrix_norm(A @ A.transpose(-1, -2) - eye)  # Frobenius, (n,)
    part_b = torch.linalg.matrix_norm(B.transpose(-1, -2) @ B - eye)
    if mode == "reference":
        part_a = torch.sqrt(part_a ** 2 + (A.shape[-1] - r))
        part_b = torch.sqrt(part_b ** 2 + (B.shape[-2] - r))
    return (diag ** 2).sum(), (part_a + part_b).sum()


def regulariser(model: nn.Module, cfg) -> torch.Tensor:
    """beta*||dSigma||^2 + gamma*(orthogonality), reduced over adapted modules by ``cfg.kasa.reduction``.

    ``paper`` mode equals peft's ``LoraModel._get_kasa_loss`` (per-module sum, with each adapter's
    ``KasaConfig`` beta and gamma) and, with ``mean``, that divided by the number of modules; ``reference``
    mode with ``mean`` equals the authors' ``loss_fn``:
    (beta * sum ||diag||^2 + gamma * sum(||A^T A - I||_F + ||B B^T - I||_F)) / number of modules.
    Computed batched over same-shaped modules (see :func:`shape_groups`): a few kernels per shape instead of
    ~25 per module, which is what kept KaSA's train step above LoRA's (docs/BENCHMARKS.md).
    """
    mode = cfg.kasa.mode
    plan, count = shape_groups(model)
    total: torch.Tensor | float = 0.0
    for pairs in plan:
        l2, ortho = _group_terms(pairs, mode)
        if mode == "paper":
            kasa_config = model.peft_config[pairs[0][1]].kasa_config
            beta, gamma = kasa_config.beta, kasa_config.gamma
        else:
            beta, gamma = cfg.kasa.beta, cfg.kasa.gamma
        total = total + beta * l2 + gamma * ortho
    if cfg.kasa.reduction == "mean":
        total = total / max(1, count)
    return total
