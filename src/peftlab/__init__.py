"""peftlab: attention-targeted parameter-efficient fine-tuning lab.

The Python API: load a model, adapt it with a method, build its per-projection optimizer, step it.

>>> import torch
>>> from peftlab import MethodConfig, OptimConfig, apply_method, configure_optimizer, load_model
>>> model, tokenizer = load_model("tiny-bert", head="classification", num_labels=2)
>>> applied = apply_method(model, MethodConfig(method="kasa", targets=("q", "v"), rank=4), task_type="SEQ_CLS")
>>> sorted(applied.targets.modules), applied.heads
(['q', 'v'], ['classifier', 'bert.pooler.dense'])
>>> optimizer = configure_optimizer(applied, OptimConfig(lr=1e-4, lr_ratio=4))
>>> {group["name"]: group["lr"] for group in optimizer.param_groups}  # eta_V = lr_ratio * eta_QK
{'q': 0.0001, 'v': 0.0004, 'head': 0.0001}
>>> batch = tokenizer(["a fine film", "a dull one"], padding=True, return_tensors="pt")
>>> output = applied.model(**batch, labels=torch.tensor([1, 0]))
>>> loss = output.loss + applied.extra_loss()  # KaSA's regulariser joins the task loss
>>> loss.backward(); optimizer.step()

``applied`` (an :class:`~peftlab.methods.table.AppliedMethod`) also carries what the method's init decided
(``applied.init_stats``) for :func:`~peftlab.methods.saving.save_trained` (``applied=applied``). A whole
run with its run folder and result.json is ``train(build_config(TrainConfig, overrides={...}))``, what
``peftlab train`` does.

The names are imported on first use, so ``import peftlab`` stays light (no torch).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

from peftlab.errors import PeftlabError  # noqa: F401 - light: imports nothing

# public name -> the module that defines it (imported when the name is first used)
_EXPORTS = {
    "load_model": "peftlab.models.registry",
    "load_model_with_pooling": "peftlab.models.registry",
    "LoadedModel": "peftlab.models.registry",
    "METHODS": "peftlab.methods.table",
    "MethodConfig": "peftlab.config",  # the config schema: every option declared once (torch-free)
    "KasaOptions": "peftlab.config",  # MethodConfig(kasa=KasaOptions(beta=...)), as peft's kasa_config
    "CordaOptions": "peftlab.config",
    "VeraOptions": "peftlab.config",
    "FourierFTOptions": "peftlab.config",
    "apply_method": "peftlab.methods.table",
    "AppliedMethod": "peftlab.methods.table",
    "InitStats": "peftlab.methods.table",
    "OptimConfig": "peftlab.config",
    "configure_optimizer": "peftlab.methods.optim_groups",
    "save_trained": "peftlab.methods.saving",
    "load_trained": "peftlab.methods.saving",
    "merged": "peftlab.methods.saving",
    "TrainConfig": "peftlab.config",
    "build_config": "peftlab.config",
    "train": "peftlab.training.loop",
}

__all__ = ["PeftlabError", "__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'peftlab' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # imported once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
