"""KaSA's regulariser, added to the task loss by the training loop through the method's ``extra_loss`` hook.

peft implements KaSA's layer (SVD truncation of the base weight, Delta_W = B diag(lora_diag) A) and the
per-module term ``beta*||diag||^2 + gamma*(||B^T B - I||_F + ||A A^T - I||_F)`` but leaves adding it to the
loss to the user (``LoraModel._get_kasa_loss``, which sums over modules). The authors' code averages over
modules instead, which keeps the penalty's weight independent of how many matrices are adapted; peftlab
defaults to that ``mean`` and offers ``sum`` for parity with peft.
"""

from __future__ import annotations

import torch
from torch import nn


def kasa_modules(model: nn.Module) -> list[nn.Module]:
    """The adapted layers that carry KaSA's learned singular values."""
    return [m for m in model.modules() if getattr(m, "lora_diag", None) is not None and len(m.lora_diag) > 0]


def regulariser(model: nn.Module, cfg) -> torch.Tensor:
    """beta*||dSigma||^2 + gamma*(orthogonality), reduced over adapted modules by ``cfg.kasa_reduction``."""
    total = model.base_model._get_kasa_loss()  # peft: sum over modules, with the adapter's beta and gamma
    if cfg.kasa_reduction == "mean":
        total = total / max(1, len(kasa_modules(model)))
    return total
