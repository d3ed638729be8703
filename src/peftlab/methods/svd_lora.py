"""SVD-initialised LoRA: MiLoRA's init (not in peft) and conversion of PiSSA/MiLoRA/CorDA to plain LoRA.

These inits move r singular components of W into the adapter and leave W_res = W - scaling*B0*A0 in the frozen
base; to ship a trained adapter for the *original* base, the update is rewritten as a rank-2r plain LoRA:
Delta_W = s*(B*A - B0*A0) = s*[B | -B0] [A ; A0] (peft's ``subtract_mutated_init``, which drops the head:
:func:`save_converted` puts it back).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

INITIAL = "peftlab_initial"


@torch.no_grad()
def milora_init(model: nn.Module, adapter: str = "default") -> None:
    """MiLoRA (Wang et al. 2024): A, B from the r *smallest* singular components of W, subtracted from W.

    Mirrors peft's PiSSA init with the other end of the spectrum:
    A = diag(sqrt(S_r / s)) Vh_r,  B = U_r diag(sqrt(S_r / s)),  W_res = W - s*B*A.
    The SVD is exact (full, fp32): O(d^3) per matrix, paid once at init.
    """
    from peft.tuners.lora import LoraLayer

    for layer in [m for m in model.modules() if isinstance(m, LoraLayer) and adapter in m.lora_A]:
        base = layer.get_base_layer()
        weight = base.weight
        transposed = getattr(layer, "fan_in_fan_out", False)  # Conv1D stores (in, out)
        w = weight.detach().float()
        w = w.T if transposed else w
        r, scaling = layer.r[adapter], layer.scaling[adapter]
        U, S, Vh = torch.linalg.svd(w, full_matrices=False)
        Ur, Sr, Vhr = U[:, -r:], S[-r:] / scaling, Vh[-r:, :]
        lora_A = torch.diag(torch.sqrt(Sr)) @ Vhr
        lora_B = Ur @ torch.diag(torch.sqrt(Sr))
        layer.lora_A[adapter].weight.data = lora_A.to(weight.dtype)
        layer.lora_B[adapter].weight.data = lora_B.to(weight.dtype)
        residual = w - scaling * lora_B @ lora_A
        base.weight.data = (residual.T if transposed else residual).to(weight.dtype)


def initial_adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of A0, B0 right after the init (tiny, in memory): :func:`save_converted` needs them at save time."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def save_converted(model: nn.Module, out_dir: str | Path, initial_state: dict[str, torch.Tensor]) -> None:
    """Save the trained PiSSA/MiLoRA/CorDA adapter as a rank-2r LoRA on the original base weights, head
    included. ``initial_state``: :func:`initial_adapter_state` of the model before training."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        initial_dir = Path(tmp) / INITIAL
        config = model.peft_config["default"]
        init_mode = config.init_lora_weights
        config.init_lora_weights = True  # peft requires the initial adapter to load as plain LoRA
        try:
            initial_dir.mkdir()
            config.save_pretrained(initial_dir)
            save_file(initial_state, str(initial_dir / "adapter_model.safetensors"))
            model.save_pretrained(out_dir, path_initial_model_for_weight_conversion=str(initial_dir))
        finally:
            config.init_lora_weights = init_mode
    weights_file = out_dir / "adapter_model.safetensors"
    converted = load_file(str(weights_file))
    # peft's conversion keeps only lora_A/lora_B: add the trained head (modules_to_save) back.
    for key, value in get_peft_model_state_dict(model).items():
        if "lora_A" not in key and "lora_B" not in key:
            converted.setdefault(key, value.detach().contiguous())
    save_file(converted, str(weights_file), metadata={"format": "pt"})
