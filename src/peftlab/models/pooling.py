"""Which token representation feeds an encoder's classification head: ``native`` or ``mean``.

Sentence-transformers checkpoints (``minilm-l6``, ``mpnet-base``) were trained with *mean* pooling and declare it in
``1_Pooling/config.json``: their [CLS] output never learned to summarise the input. ``--pooling auto`` uses the
declared pooling when it is ``mean`` and the architecture supports it, else ``native``. Mean pooling is a forward
hook on the encoder (which sees the attention mask): parameter names and saved files are unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from peftlab.errors import PeftlabError

POOLINGS = ("auto", "native", "mean")


def declared_pooling(source: str | Path | None) -> str | None:
    """The pooling a sentence-transformers checkpoint folder declares (``mean``, ``cls``, ...), else None."""
    if source is None:
        return None
    config = Path(source) / "1_Pooling" / "config.json"
    if not config.is_file():
        return None
    try:
        modes = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for mode in ("mean", "cls", "max"):
        if modes.get(f"pooling_mode_{mode}_tokens") or (mode == "cls" and modes.get("pooling_mode_cls_token")):
            return mode
    return None


def _encoder(model: nn.Module) -> nn.Module | None:
    return getattr(model, getattr(model, "base_model_prefix", ""), None)


def _pooler(model: nn.Module) -> nn.Module | None:
    """A BERT-style pooler: ``dense`` + ``activation`` on [CLS]."""
    pooler = getattr(_encoder(model), "pooler", None)
    return pooler if isinstance(getattr(pooler, "dense", None), nn.Linear) and hasattr(pooler, "activation") else None


def _first_token_head(model: nn.Module) -> bool:
    """RoBERTa/MPNet classifiers: ``classifier.dense`` + ``classifier.out_proj`` on token 0, no pooler."""
    base, head = _encoder(model), getattr(model, "classifier", None)
    return (base is not None and getattr(base, "pooler", None) is None
            and all(isinstance(getattr(head, name, None), nn.Linear) for name in ("dense", "out_proj")))


def supports_mean(model: nn.Module) -> bool:
    return _pooler(model) is not None or _first_token_head(model)


def masked_mean(hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None or mask.shape[:2] != hidden_states.shape[:2]:
        return hidden_states.mean(dim=1)
    weights = mask.to(hidden_states.dtype).unsqueeze(-1)
    return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def use_mean_pooling(model: nn.Module) -> None:
    """Switch a BERT-style or RoBERTa-style classifier to masked mean pooling, in place: a forward hook on the
    encoder (which sees the attention mask the pooler never gets) writes the masked token mean into token 0 for a
    first-token head, or recomputes ``pooler_output`` from it with the pooler's own dense layer and activation."""
    first_token = _first_token_head(model)
    if not first_token and _pooler(model) is None:
        raise PeftlabError(f"--pooling mean needs a BERT-style pooler or a RoBERTa-style head; "
                           f"{type(model).__name__} has neither", fix="use --pooling native (or auto)")

    def pool_mean(module, args, kwargs, output):
        mask = kwargs.get("attention_mask")
        mask = args[1] if mask is None and len(args) > 1 else mask  # BertModel.forward(input_ids, mask, ...)
        pooled = masked_mean(output[0], mask)
        if first_token:
            hidden = torch.cat([pooled.unsqueeze(1), output[0][:, 1:]], dim=1)
            if isinstance(output, tuple):
                return (hidden,) + tuple(output[1:])
            output.last_hidden_state = hidden  # ModelOutput keeps output[0] in sync
            return output
        pooled = module.pooler.activation(module.pooler.dense(pooled))
        if isinstance(output, tuple):
            return (output[0], pooled) + tuple(output[2:])
        output.pooler_output = pooled  # ModelOutput keeps output[1] in sync
        return output

    _encoder(model).register_forward_hook(pool_mean, with_kwargs=True)


def resolve(pooling: str, model: nn.Module, source: str | Path | None, head: str) -> str:
    """The pooling a run uses, ``native`` or ``mean`` (``auto`` resolved), applied to ``model`` in place.

    ``native`` is the architecture's own: [CLS] through the pooler for BERT, [CLS] for RoBERTa's head, the
    last non-padding token for decoder classifiers."""
    if pooling not in POOLINGS:
        raise PeftlabError(f"unknown --pooling '{pooling}'", fix=f"use one of {', '.join(POOLINGS)}")
    if head == "causal-lm":
        if pooling == "mean":
            raise PeftlabError("--pooling mean applies to encoder classifiers, not to causal-LM tasks",
                               fix="drop --pooling for this task")
        return "native"
    if pooling == "auto":
        pooling = "mean" if declared_pooling(source) == "mean" and supports_mean(model) else "native"
    if pooling == "mean":
        use_mean_pooling(model)
    return pooling
