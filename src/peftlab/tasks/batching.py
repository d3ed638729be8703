"""Tokenisation (cached), collation, length-grouped batching and packing (--packing) of a task's examples.

:func:`tokenize` is GLUE's (``text_a``/``text_b`` -> token ids); instruction data shares its cache
(:func:`cached_map`). :func:`length_grouped_batches` is what the training loop's sampler draws.
:class:`PackingCollator` (``--packing``) puts a batch's examples into one unpadded row;
:func:`prepare_packed_attention` makes the run's model attend within each packed example and verifies it.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from peftlab.errors import PeftlabError

_TOKENIZE_VERSION = "3"  # 3: keyed on the rows' JSON digest (2: a pandas hash of them)


# --------------------------------------------------------------------------- tokenisation


def tokenized_cache_dir() -> Path:
    from peftlab.models.registry import cache_dir

    return cache_dir() / "tokenized"


def train_examples_digest(dataset) -> str:
    """SHA-256 (64 hex) of a run's raw training examples in the order drawn: one JSON line per example (its
    columns, keys sorted, UTF-8), hashed in order. Equal for every run that draws the same examples (same data,
    --max-train-samples and --seed), different when any example, or their order, differs. Raw content, not
    tokens: the digest does not depend on the model's tokenizer or --max-length. result.json records it for the
    training examples; :func:`cached_map` keys the token cache on it for any rows it tokenises."""
    h = hashlib.sha256()
    columns = sorted(dataset.column_names)
    for batch in dataset.iter(batch_size=4096):  # columnar batches: far faster than row by row
        for values in zip(*(batch[c] for c in columns)):
            row = json.dumps(dict(zip(columns, values)), sort_keys=True, ensure_ascii=False, default=str)
            h.update(row.encode("utf-8") + b"\n")
    return h.hexdigest()


def cached_map(ds, encode, tokenizer, max_length: int, *, task: str, cache_key: str, content: str | None = None):
    """``ds.map(encode)`` (batched, ``encode(batch, max_length)``: the token columns), cached in
    ``$PEFTLAB_CACHE/tokenized/<hash>.arrow``: the hash covers the tokenizer (name/path, class, vocabulary size,
    truncation side), ``task``, ``cache_key``, the rows (:func:`train_examples_digest`: peftlab's own digest, so
    the cache follows the rows whatever built the dataset; an edited data file misses it) and ``max_length``, so
    a second call only reads the file."""
    if max_length is None or int(max_length) <= 0:
        raise PeftlabError(f"max_length must be a positive integer, got {max_length!r}", fix="use e.g. 128")
    key = {
        "version": _TOKENIZE_VERSION,
        "tokenizer": str(getattr(tokenizer, "name_or_path", "")),
        "tokenizer_class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "truncation_side": getattr(tokenizer, "truncation_side", "right"),
        "task": task,
        "cache_key": cache_key,
        "content": content or train_examples_digest(ds),  # ``content``: the caller's digest of ds, made once
        "max_length": int(max_length),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    out_dir = tokenized_cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    return ds.map(lambda batch: encode(batch, int(max_length)), batched=True, remove_columns=ds.column_names,
                  cache_file_name=str(out_dir / f"{digest}.arrow"), load_from_cache_file=True, new_fingerprint=digest,
                  desc=f"tokenising {task}")


def tokenize(ds, tokenizer, max_length: int, *, task: str, cache_key: str, content: str | None = None):
    """``text_a``/``text_b`` tokenised with truncation to ``max_length`` (no padding), cached (:func:`cached_map`):
    ``input_ids``, ``attention_mask``, [``token_type_ids``,] ``labels`` and ``length``."""
    pair = "text_b" in ds.column_names

    def encode(batch, max_length: int):
        texts = (batch["text_a"], batch["text_b"]) if pair else (batch["text_a"],)
        out = dict(tokenizer(*texts, truncation=True, max_length=max_length))
        return {**out, "labels": batch["label"], "length": [len(ids) for ids in out["input_ids"]]}

    return cached_map(ds, encode, tokenizer, max_length, task=task, cache_key=cache_key, content=content)


# --------------------------------------------------------------------------- collation and batching


class Collator:
    """Pads tokenised examples into a batch of tensors (``length``, the sampler's, dropped first): to the longest
    example, or to ``max_length`` when ``pad_to_max``."""

    def __init__(self, tokenizer, pad_to_max: bool, max_length: int):
        from transformers import DataCollatorWithPadding

        self.inner = DataCollatorWithPadding(tokenizer, padding="max_length" if pad_to_max else "longest",
                                             max_length=int(max_length) if pad_to_max else None, return_tensors="pt")

    def __call__(self, features: Sequence[dict]):
        return self.inner([{k: v for k, v in f.items() if k != "length"} for f in features])


def _derived_seed(seed: int, epoch: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{epoch}".encode()).digest()[:8], "little") >> 1


def length_grouped_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches of indices with similar lengths; every index appears exactly once.

    Uses transformers' ``get_length_grouped_indices``: a seeded permutation, megabatches of
    ``50 * batch_size`` (fewer for small data sets, so there are at least 4), each sorted by length
    descending; the result is cut into batches, the batch holding the longest example stays first (an
    out-of-memory error shows at step one) and the others are shuffled. Deterministic in ``(seed, epoch)``.
    """
    import torch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    if batch_size <= 0:
        raise PeftlabError(f"batch size must be positive, got {batch_size}", fix="use e.g. 32")
    lengths = [int(x) for x in lengths]
    if not lengths:
        return []
    derived = _derived_seed(seed, epoch)
    generator = torch.Generator().manual_seed(derived)
    order = get_length_grouped_indices(lengths, batch_size, generator=generator)
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    rest = batches[1:]
    random.Random(derived).shuffle(rest)
    return [batches[0]] + rest


# --------------------------------------------------------------------------- packing (--packing)


class PackingCollator:
    """``--packing``: a batch's examples concatenated into ONE unpadded row (transformers'
    ``DataCollatorWithFlattening``): ``position_ids`` restarting at 0 per example, the boundaries as
    flash-attention's ``cu_seq_lens``, no ``attention_mask``; each example's first label is -100, so no example is
    trained to predict the next one's first token (the loss covers the same tokens as a padded batch's).

    The batch carries ``use_cache=False``: transformers builds the block-diagonal causal mask from restarting
    ``position_ids`` only with no attention mask AND no cache, and a causal LM whose config says ``use_cache``
    (Llama's, Qwen2's, SmolLM2's) makes an empty cache even in a training forward, letting every token attend
    across the whole row. :func:`prepare_packed_attention` also moves an SDPA model to per-example attention and
    verifies it.
    """

    KEEP = ("input_ids", "labels")

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.inner = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100, return_tensors="pt",
                                                return_flash_attn_kwargs=True)

    def __call__(self, features: Sequence[dict]):
        batch = self.inner([{k: f[k] for k in self.KEEP} for f in features])
        batch["use_cache"] = False  # no cache: the packed rows' block-diagonal mask is built (see above)
        return batch


def examples_in_batch(batch) -> int:
    """Training examples in a collated batch: a packed row (:class:`PackingCollator`) counts its examples by
    their ``position_ids`` restarting at 0; a padded batch has one example per row."""
    positions = batch.get("position_ids") if hasattr(batch, "get") else None
    if positions is not None:
        return int((positions == 0).sum())
    return int(batch["input_ids"].shape[0])


PACKING_CHECK_LENGTHS = (7, 5, 1)  # three short examples (one of a single token), one row


@dataclass(frozen=True)
class PackedAttention:
    """How a model attends within packed rows (:func:`prepare_packed_attention`)."""

    per_example: bool  # each example attends on its own (models.packed_attention); False: a block-diagonal mask
    implementation: str  # the model's attention implementation now
    max_difference: float  # largest |packed - alone| logit of the check's examples


def prepare_packed_attention(model, tolerance: float = 1e-3) -> PackedAttention:
    """Make ``model`` attend within each example of a packed row, and verify it: an SDPA model is switched to
    per-example attention (:func:`peftlab.models.packed_attention.use_packed_attention`), any other keeps
    transformers' block-diagonal mask. Then the logits of three short random examples packed into one row
    (:class:`PackingCollator`) must equal each example's logits run alone with the model's original attention,
    within ``tolerance`` x their scale; else :class:`PeftlabError`. Four forwards of a few tokens (no grad, eval
    mode; the model's mode is restored)."""
    import torch

    from peftlab.models.packed_attention import use_packed_attention

    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if vocab < 2:
        raise PeftlabError("--packing: cannot check the model's attention (its config has no vocab_size)",
                           fix="drop --packing for this model")
    generator = torch.Generator().manual_seed(0)
    examples = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in PACKING_CHECK_LENGTHS]
    batch = PackingCollator()([{"input_ids": ids, "labels": [-100] * len(ids)} for ids in examples])
    device = next(model.parameters()).device
    inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in batch.items() if k != "labels"}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = torch.cat([model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float()
                               for ids in examples])
            per_example = use_packed_attention(model)
            packed = model(**inputs).logits[0].float()
    finally:
        model.train(was_training)
    difference = float((packed - alone).abs().max())
    scale = max(1.0, float(alone.abs().max()))
    if not difference <= tolerance * scale:
        raise PeftlabError(
            f"--packing: {type(model).__name__} lets packed examples attend to each other (packed vs alone logits "
            f"differ by up to {difference:.3g}): its attention ignores the restarting position_ids",
            fix="drop --packing for this model (dynamic padding with length-grouped batches is the default)")
    implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", None))
    return PackedAttention(per_example, implementation, difference)
