"""Task pipelines: the data a run trains on and how it is evaluated, by task kind.

A :class:`Pipeline` is what the training loop needs from a task and nothing more: a tokenised training set
(with a ``length`` column for length-grouped batching), a collator, and an ``evaluate(model, accelerator)``
function returning a flat metric dict. Classification/regression (GLUE) lives here; instruction tuning
(GSM8K, Alpaca, JSON) in :mod:`peftlab.sft`. Add a task kind by adding a builder
``(cfg, tokenizer, model) -> Pipeline`` to ``BUILDERS``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from peftlab.tasks import TASKS


@dataclass
class Pipeline:
    train_dataset: Any
    collate: Callable
    evaluate: Callable  # (model, accelerator) -> dict[str, float]
    primary_metric: str
    chance: float  # chance level of the primary metric (majority class; 0 for correlations)
    num_eval_examples: int = 0
    extras: dict = field(default_factory=dict)  # e.g. paths of generation logs


def _eval_loader(dataset, collate, batch_size: int):
    # Sorting eval examples by length wastes no compute on padding; metrics do not depend on order
    # because predictions and labels travel together.
    order = np.argsort(-np.asarray(dataset["length"]), kind="stable")
    return torch.utils.data.DataLoader(dataset.select(order), batch_size=batch_size, collate_fn=collate,
                                       generator=torch.Generator())  # leaves the global RNG (dropout) alone


def build_glue(cfg, tokenizer, model=None) -> Pipeline:
    from peftlab import data
    from peftlab.metrics import compute_metrics

    task = TASKS[cfg.task]
    cache_prefix = f"{cfg.model}"
    train_raw = data.subset(data.load_split(cfg.task, "train", cfg.data_dir), cfg.max_train_samples, cfg.seed)
    train = data.tokenize(train_raw, tokenizer, cfg.max_length, task=cfg.task, cache_key=f"{cache_prefix}-train")
    evals = {}
    for split in task.eval_splits:
        raw = data.subset(data.load_split(cfg.task, split, cfg.data_dir), cfg.max_eval_samples, cfg.seed)
        evals[split] = (raw, data.tokenize(raw, tokenizer, cfg.max_length, task=cfg.task,
                                           cache_key=f"{cache_prefix}-{split}"))
    collate = data.make_collator(tokenizer, cfg.pad_to_max, cfg.max_length)
    first_raw = next(iter(evals.values()))[0]
    chance = data.majority_baseline(cfg.task, train_raw["label"], first_raw["label"])

    @torch.no_grad()
    def evaluate(model, accelerator) -> dict[str, float]:
        model.eval()
        results: dict[str, dict[str, float]] = {}
        for split, (_, tokenised) in evals.items():
            loader = accelerator.prepare(_eval_loader(tokenised, collate, cfg.eval_batch_size))
            logits, labels = [], []
            for batch in loader:
                out = model(**batch)
                step_logits, step_labels = accelerator.gather_for_metrics((out.logits.float(), batch["labels"]))
                logits.append(step_logits.cpu())
                labels.append(step_labels.cpu())
            accelerator.free_memory(loader)
            results[split] = compute_metrics(cfg.task, torch.cat(logits).numpy(), torch.cat(labels).numpy())
        model.train()
        if len(results) == 1:
            return next(iter(results.values()))
        # MNLI: matched and mismatched, and their mean under the plain metric name (the papers' column).
        flat = {f"{split.replace('validation_', '')}_{k}": v for split, m in results.items() for k, v in m.items()}
        for key in next(iter(results.values())):
            flat[key] = float(np.mean([m[key] for m in results.values()]))
        return flat

    return Pipeline(train, collate, evaluate, task.primary_metric, chance,
                    num_eval_examples=sum(len(t) for _, t in evals.values()))


BUILDERS: dict[str, str | Callable] = {
    "classification": build_glue,
    "regression": build_glue,
    "instruction": "peftlab.sft:build_pipeline",  # imported on demand
}


def build_pipeline(cfg, tokenizer, model) -> Pipeline:
    builder = BUILDERS[TASKS[cfg.task].kind]
    if isinstance(builder, str):
        module, name = builder.split(":")
        builder = getattr(importlib.import_module(module), name)
    return builder(cfg, tokenizer, model)
