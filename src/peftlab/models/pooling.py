"""Which token representation feeds an encoder's classification head: ``native`` or ``mean``.

Sentence-transformers checkpoints (``minilm-l6``, ``mpnet-base``) were trained with *mean* pooling and declare it
in ``1_Pooling/config.json``: their [CLS] output was never trained to summarise the input. ``--pooling auto``
(default) uses the declared pooling when it is ``mean`` and the architecture supports it, else ``native`` (only
local folders are inspected). Mean pooling is a forward hook on the encoder: for a BERT-style pooler the pooled
output is recomputed from the masked token mean with the pooler's own layer; for a RoBERTa-style first-token head
the mean is written into token 0. Parameter names and saved files are unchanged; ``peftlab evaluate`` resolves the
saved config's ``pooling`` the same way, so it rebuilds the same model."""

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


def _encoder_with_pooler(model: nn.Module) -> nn.Module | None:
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    pooler = getattr(base, "pooler", None)
    if pooler is None or not isinstance(getattr(pooler, "dense", None), nn.Linear) or not hasattr(pooler, "activation"):
        return None
    return base


def _encoder_with_first_token_head(model: nn.Module) -> nn.Module | None:
    """RoBERTa/MPNet classifiers: ``classifier.dense`` + ``classifier.out_proj`` on token 0, no pooler."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "classifier", None)
    if base is None or getattr(base, "pooler", None) is not None or head is None:
        return None
    if not isinstance(getattr(head, "dense", None), nn.Linear) or not isinstance(getattr(head, "out_proj", None),
                                                                              nn.Linear):
        return None
    return base


def supports_mean(model: nn.Module) -> bool:
    return _encoder_with_pooler(model) is not None or _encoder_with_first_token_head(model) is not None


def masked_mean(hidden_states: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None or mask.shape[:2] != hidden_states.shape[:2]:
        return hidden_states.mean(dim=1)
    weights = mask.to(hidden_states.dtype).unsqueeze(-1)
    return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def _attention_mask(args, kwargs):
    """The attention mask an encoder's forward hook sees: by keyword, or BertModel.forward(input_ids, mask, ...)."""
    mask = kwargs.get("attention_mask")
    return args[1] if mask is None and len(args) > 1 else mask


def _mean_into_first_token(encoder: nn.Module) -> None:
    """The head reads token 0: a forward hook on the encoder writes the masked token mean there."""

    def put_mean_first(module, args, kwargs, output):
        mask = _attention_mask(args, kwargs)
        hidden = output[0]
        pooled = masked_mean(hidden, mask)
        hidden = torch.cat([pooled.unsqueeze(1), hidden[:, 1:]], dim=1)
        if isinstance(output, tuple):
            return (hidden,) + tuple(output[1:])
        output.last_hidden_state = hidden  # ModelOutput keeps output[0] in sync
        return output

    encoder.register_forward_hook(put_mean_first, with_kwargs=True)


def use_mean_pooling(model: nn.Module) -> None:
    """Switch a BERT-style or RoBERTa-style classifier to masked mean pooling, in place."""
    first_token = _encoder_with_first_token_head(model)
    if first_token is not None:
        _mean_into_first_token(first_token)
        return
    encoder = _encoder_with_pooler(model)
    if encoder is None:
        raise PeftlabError(f"--pooling mean needs a BERT-style pooler or a RoBERTa-style head; "
                           f"{type(model).__name__} has neither", fix="use --pooling native (or auto)")
    _mean_through_pooler(encoder)


def _mean_into_pooler_output(pooler: nn.Module, mask, output):
    """The encoder's output with ``pooler_output`` = tanh(dense(masked token mean)) (BERT's pooler on the mean)."""
    pooled = pooler.activation(pooler.dense(masked_mean(output[0], mask)))
    if isinstance(output, tuple):
        return (output[0], pooled) + tuple(output[2:])
    output.pooler_output = pooled  # ModelOutput keeps output[1] in sync
    return output


def _mean_through_pooler(encoder: nn.Module) -> None:
    """A BERT-style encoder's pooler reads [CLS]: a forward hook on the encoder, which sees the attention mask
    the pooler never gets, recomputes the pooled output from the masked token mean with the pooler's own dense
    layer and activation (their parameters and names unchanged; the pooler's [CLS] product it replaces is one
    batch x hidden x hidden matmul)."""

    def pool_mean(module, args, kwargs, output):
        return _mean_into_pooler_output(module.pooler, _attention_mask(args, kwargs), output)

    encoder.register_forward_hook(pool_mean, with_kwargs=True)


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
