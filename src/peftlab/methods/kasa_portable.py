"""KaSA with a truncation peft would not redo, saved as a plain LoRA that plain peft reproduces exactly.

peft's KaSA loader re-truncates every adapted base weight by its own rule (drop the r smallest singular
components). With ``--kasa-truncate-rank k != r`` or ``--kasa-mode reference`` this run trained on other
truncated bases, so a KaSA adapter loaded by plain peft would compute something else. Instead the whole
update relative to the *original* base is written as a plain LoRA, per module:

    W_run = W0 - U_d S_d Vh_d + s * B diag(sigma) A      (U_d S_d Vh_d: the components the run dropped)
          = W0 + [-U_d S_d | s * B diag(sigma)] [Vh_d ; A]
          = W0 + B' A'  with rank r' = dropped + r and lora_alpha = r' (scaling 1),

set per module through peft's ``rank_pattern`` / ``alpha_pattern``. Exact up to fp32 rounding; the head
(``modules_to_save``) is kept. The dropped factors are taken from the original weights before peft truncates
them (:func:`dropped_components`, kept in ``InitStats.kasa_dropped``): small, ``dropped x (in + out)``.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch
from torch import nn

ADAPTER = "default"


@torch.no_grad()
def dropped_components(model: nn.Module, module_names, keep: dict[str, int], rank: int
                       ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module: (U_d * S_d, Vh_d)} of each ORIGINAL base weight: what the run's truncation removes.

    ``keep``: components kept where they differ from peft's rule; elsewhere peft's ``min(in, out) - rank``.
    Call before peft truncates the weights (one fp32 SVD per adapted matrix, as peft's own init pays)."""
    modules = dict(model.named_modules())
    dropped = {}
    for name in module_names:
        weight = modules[name].weight.detach().float()
        kept = keep.get(name, min(weight.shape) - rank)
        U, S, Vh = torch.linalg.svd(weight, full_matrices=False)
        dropped[name] = ((U[:, kept:] * S[kept:]).contiguous(), Vh[kept:, :].contiguous())
    return dropped


@torch.no_grad()
def save_as_lora(model: nn.Module, out_dir: str | Path,
                 dropped: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Path:
    """Write the trained KaSA ``model`` (a PeftModel) as a plain LoRA adapter on the original base."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[ADAPTER]
    inner = model.base_model.model
    state = {key: value.detach().contiguous() for key, value in get_peft_model_state_dict(model).items()
             if not key.endswith("lora_diag")}
    ranks = {}
    for name, (dropped_us, dropped_vh) in dropped.items():
        layer = inner.get_submodule(name)
        A = layer.lora_A[ADAPTER].weight.float()
        B = layer.lora_B[ADAPTER].weight.float()
        sigma = layer.lora_diag[ADAPTER].float()
        scaling = float(layer.scaling[ADAPTER])
        dtype = layer.lora_A[ADAPTER].weight.dtype
        prefix = f"base_model.model.{name}"
        state[f"{prefix}.lora_B.weight"] = torch.cat([-dropped_us.to(B.device), scaling * B * sigma], dim=1).to(dtype).contiguous()
        state[f"{prefix}.lora_A.weight"] = torch.cat([dropped_vh.to(A.device), A], dim=0).to(dtype).contiguous()
        ranks[re.escape(name)] = dropped_us.shape[1] + A.shape[0]  # peft reads pattern keys as regexes
    plain = copy.deepcopy(config)
    plain.kasa_config, plain.rank_pattern, plain.alpha_pattern = None, ranks, dict(ranks)
    plain.use_rslora, plain.init_lora_weights = False, True
    plain.save_pretrained(str(out_dir))
    save_file({k: v.cpu() for k, v in state.items()}, str(out_dir / "adapter_model.safetensors"),
              metadata={"format": "pt", "peftlab": "KaSA with a non-peft truncation, saved as plain LoRA "
                                                  "(rank = dropped components + r, alpha = rank)"})
    return out_dir
