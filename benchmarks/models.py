"""The models and inputs of the micro benchmark: random-config models on the device, random batches, and the
frozen tensors every configuration shares with one base model (so many configurations fit in memory at once)."""

from __future__ import annotations

import torch

from peftlab.errors import PeftlabError


def load_bench_model(name: str, device: torch.device, seed: int = 0):
    """A sequence-classification model (2 labels) on ``device``; random-config models skip the tokenizer.

    Registry models with ``random_config`` are built straight from their config on ``device`` (no tokenizer
    package needed, so this runs on a bare GPU machine); anything else goes through
    :func:`peftlab.models.registry.load_model`.
    """
    import transformers
    from transformers import AutoModelForSequenceClassification

    from peftlab.models.registry import MODELS, load_model

    spec = MODELS.get(name)
    if spec is not None and spec.random_config is not None:
        transformers.logging.set_verbosity_error()
        config = spec.random_config()
        config.num_labels = 2
        config.problem_type = "single_label_classification"
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0  # decoders need one for batched classification; inputs never contain it
        torch.manual_seed(seed)
        with torch.device(device):  # initialise on the GPU directly (a 1B-parameter init is slow on CPU)
            model = AutoModelForSequenceClassification.from_config(config)
        return model.to(device)
    model, _ = load_model(name, head="classification", num_labels=2, seed=seed)
    return model.to(device)


def make_batch(model: torch.nn.Module, batch_size: int, seq_len: int, device: torch.device,
               seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids (never the pad id), an all-ones mask and random labels."""
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if config.model_type in ("roberta", "xlm-roberta", "camembert") and limit:
        limit -= 2  # positions start after padding_idx
    if limit and seq_len > limit:
        raise PeftlabError(f"--seq-len {seq_len} is longer than this model's {limit} positions",
                           fix=f"use --seq-len {limit} or less")
    generator = torch.Generator().manual_seed(seed)
    low = 5
    ids = torch.randint(low, config.vocab_size, (batch_size, seq_len), generator=generator)
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and pad >= low:
        ids[ids == pad] = pad + 1 if pad + 1 < config.vocab_size else low
    labels = torch.randint(0, 2, (batch_size,), generator=generator)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "labels": labels.to(device)}


def shared_frozen(base: torch.nn.Module, protected: set[str], heads: list[str]) -> dict[int, torch.Tensor]:
    """{id: tensor} of the parameters and buffers that no configuration changes (deepcopy memo)."""
    shared: dict[int, torch.Tensor] = {}
    for name, module in base.named_modules():
        if name in protected or any(name == h or name.startswith(h + ".") for h in heads):
            continue
        if any(name.startswith(p + ".") for p in protected):
            continue
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            shared[id(tensor)] = tensor
    return shared
