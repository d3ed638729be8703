"""Attention over each example of a packed row on its own (``--packing``): the CPU's stand-in for flash-attention's
variable-length kernel, which is CUDA-only.

transformers keeps a packed row's examples apart with a block-diagonal causal mask, but SDPA then computes the
scores of the whole row ((sum of lengths)² per head). :func:`packed_sdpa_attention` runs transformers' own
``sdpa_attention_forward`` once per example instead (the boundaries are the collator's ``cu_seq_lens_q``); without
them (evaluation, generation) it is plain SDPA. It is registered with transformers' ``AttentionInterface``; models
on another attention, or with a sliding window, keep the block-diagonal mask."""

from __future__ import annotations

import torch

IMPLEMENTATION = "peftlab_packed_sdpa"
BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                          is_causal=None, **kwargs):
    """transformers' attention-function signature: ``query``/``key``/``value`` (batch, heads, length, head dim)
    -> (attention output (batch, length, heads, head dim), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    bounds = kwargs.get("cu_seq_lens_q")
    kwargs = {k: v for k, v in kwargs.items() if k not in BOUNDARY_KWARGS}
    if bounds is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return attend_each_example(module, query, key, value, bounds, dropout, scaling, kwargs), None


# Eager even inside a compiled model (--compile): the loop's length is the row's example count and its slices
# are read off the boundaries (.tolist()), so a traced loop would be specialised on them, one recompile per
# batch. torch.compiler.disable makes it a graph break instead: the layers around it stay compiled.
@torch.compiler.disable
def attend_each_example(module, query, key, value, bounds, dropout, scaling, kwargs):
    """SDPA once per example of a packed row, causal, on its slice ``bounds[i]:bounds[i + 1]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    edges = [int(e) for e in bounds.tolist()]
    pieces = [sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                     None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
              for start, end in zip(edges[:-1], edges[1:])]
    return torch.cat(pieces, dim=1)


def register() -> None:
    """Make :data:`IMPLEMENTATION` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, packed_sdpa_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # unpacked batches get SDPA's masks


def _sliding(config) -> bool:
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False


def use_packed_attention(model) -> bool:
    """Switch ``model`` (a transformers model running SDPA) to per-example attention for packed rows; False, and
    nothing changed, for any other attention or a sliding window."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) == IMPLEMENTATION:
        return config is not None
    if config._attn_implementation != "sdpa" or _sliding(config) or not hasattr(model, "set_attn_implementation"):
        return False
    register()
    model.set_attn_implementation(IMPLEMENTATION)
    return config._attn_implementation == IMPLEMENTATION
