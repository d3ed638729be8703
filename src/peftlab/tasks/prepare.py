"""Task pipelines: the data a run trains on and how it is evaluated (GLUE's and the labelled data's builders here).

A :class:`Pipeline` is what the training loop needs from a task: a tokenised training set (with ``length`` for
length-grouped batching), a collator and ``evaluate(model, accelerator, tag) -> Evaluation``. ``tag`` names the
evaluation (``before``, ``epoch<N>``, ``step<N>``, ``test``, ``evaluate``); a task that writes files names them by
it. :data:`BUILDERS` maps ``Task.pipeline`` to its builder ``(cfg, tokenizer, model, task) -> Pipeline``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch

from peftlab.tasks.batching import train_examples_digest
from peftlab.tasks.table import SELECTION_PREFIX, Task, task as registered_task


BEFORE_TAG = "before"  # the evaluation before fine-tuning
TEST_TAG = "test"  # --selection-samples: the one evaluation of the test split, on the weights the run saves
EVALUATE_TAG = "evaluate"  # `peftlab evaluate` of a saved run: never overwrites its training-time files


def epoch_tag(epoch: int) -> str:  # after epoch ``epoch`` (1-based)
    return f"epoch{epoch}"


def step_tag(step: int) -> str:  # an ``--eval-steps`` evaluation after optimizer step ``step``
    return f"step{step}"


def choosing(tag: str) -> bool:
    """Whether an evaluation is one a run chooses on (before fine-tuning, after an epoch or an --eval-steps step):
    with a selection split those score it alone; the others (``test``, ``evaluate``) score the test split."""
    return tag == BEFORE_TAG or tag.startswith(("epoch", "step"))


@dataclass(frozen=True)
class Evaluation:
    """What one ``evaluate(model, accelerator, tag)`` returns."""

    metrics: dict[str, float]
    # For result.json, merged over the run's evaluations (a dict value is merged key by key), e.g.
    # {"generations": {tag: file name}, "generations_file": file name}.
    extras: dict = field(default_factory=dict)


def merge_extras(into: dict, extras: dict) -> dict:
    """``into`` updated with one evaluation's extras: a dict value is merged key by key, others replace."""
    for key, value in extras.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key] = {**into[key], **value}
        else:
            into[key] = value
    return into


@dataclass
class Pipeline:
    train_dataset: Any
    collate: Callable
    evaluate: Callable  # (model, accelerator, tag) -> Evaluation
    primary_metric: str
    chance: float  # chance level of the primary metric (majority class; 0 for correlations)
    num_eval_examples: int = 0
    extras: dict = field(default_factory=dict)  # e.g. paths of generation logs; merged into result.json
    eval_sets: dict = field(default_factory=dict)  # split -> the raw (untokenised) examples it scores
    # train_examples_digest() of the raw training examples drawn (after --max-train-samples, in that order);
    # None only for a builder that does not say (result.json then records null).
    train_examples_digest: str | None = None
    # --selection-samples: the chance level of the selection split's metric; None: no selection split, the dev
    # set chooses (best epoch, early stopping, labels) as well as reports
    selection_chance: float | None = None
    # The task's row, attached by build_pipeline: what the loop, its guards and result.json read of the task
    task: Task | None = None

    @property
    def choice_metric(self) -> str:
        """The metric every choice of the run reads: the selection split's, else the dev set's primary one."""
        if self.selection_chance is None:
            return self.primary_metric
        return SELECTION_PREFIX + self.primary_metric

    @property
    def choice_chance(self) -> float:
        return self.chance if self.selection_chance is None else self.selection_chance


def examples_digest(datasets_by_split: dict) -> str:
    """SHA-256 (16 hex) of the evaluated examples, in order: equal digests = the same dev examples."""
    import hashlib
    import json

    h = hashlib.sha256()
    for split in sorted(datasets_by_split):
        ds = datasets_by_split[split]
        h.update(split.encode())
        for column in sorted(ds.column_names):
            # [:]: the values; datasets >= 4 returns a lazy Column, whose str() shows only its first five
            h.update(json.dumps(ds[column][:], default=str).encode())
    return h.hexdigest()[:16]


def eval_loader_on(accelerator, loader):
    """``loader`` sharded over the processes and put on the device as ``accelerator.prepare`` does it (Accelerate's
    public ``prepare_data_loader`` with the accelerator's settings), but not registered with the accelerator:
    an evaluation's loader is not training state (``save_state`` would checkpoint it, and
    ``accelerator.free_memory(loader)`` would also drop the model and optimizer the accelerator tracks)."""
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(
        loader, accelerator.device, num_processes=accelerator.num_processes, process_index=accelerator.process_index,
        split_batches=accelerator.split_batches, put_on_device=accelerator.device_placement,
        rng_types=list(accelerator.rng_types), even_batches=accelerator.even_batches,
        non_blocking=accelerator.non_blocking)


@torch.no_grad()
def gather_predictions(model, accelerator, tokenised, collate, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits and labels of one tokenised eval set, gathered over processes (classification and regression).
    Longest examples first: no compute is spent on padding, and predictions travel with their labels."""
    order = np.argsort(-np.asarray(tokenised["length"]), kind="stable")
    loader = torch.utils.data.DataLoader(tokenised.select(order), batch_size=batch_size, collate_fn=collate,
                                         generator=torch.Generator())  # leaves the global RNG (dropout) alone
    logits, labels = [], []
    for batch in eval_loader_on(accelerator, loader):
        out = model(**batch)
        step_logits, step_labels = accelerator.gather_for_metrics((out.logits.float(), batch["labels"]))
        logits.append(step_logits.cpu())
        labels.append(step_labels.cpu())
    return torch.cat(logits).numpy(), torch.cat(labels).numpy()


def label_pipeline(cfg, tokenizer, train_raw, evals_raw: dict, *, kind: str, metric: str, num_labels: int,
                   metrics: Callable, extras: dict, selection_raw=None) -> Pipeline:
    """A classifier's or regressor's Pipeline (GLUE's and the user's labelled data): ``text_a``/``text_b`` tokenised,
    chance from the first eval split's labels, scored by ``metrics(logits, labels)``."""
    from peftlab.tasks import batching
    from peftlab.tasks.metrics import chance_level

    def tokenised(raw, split: str, content: str | None = None):
        return batching.tokenize(raw, tokenizer, cfg.max_length, task=cfg.task, cache_key=f"{cfg.model}-{split}",
                                 content=content)

    train_digest = train_examples_digest(train_raw)  # once: the token cache's key and result.json's digest

    evals = {split: (raw, tokenised(raw, split)) for split, raw in evals_raw.items()}
    collate = batching.Collator(tokenizer, cfg.pad_to_max, cfg.max_length)
    selection = None
    if selection_raw is not None:
        selection = Selection(tokenised(selection_raw, "selection"),
                              chance_level(kind, metric, selection_raw["label"][:], num_labels))
    return Pipeline(tokenised(train_raw, "train", train_digest), collate,
                    label_evaluate(cfg, metrics, evals, selection, collate), metric,
                    chance_level(kind, metric, next(iter(evals_raw.values()))["label"][:], num_labels),
                    num_eval_examples=sum(len(t) for _, t in evals.values()),
                    extras={**extras, "eval_examples_digest": examples_digest(evals_raw)}, eval_sets=dict(evals_raw),
                    train_examples_digest=train_digest,
                    selection_chance=None if selection is None else selection.chance)


def build_glue(cfg, tokenizer, model, task: Task) -> Pipeline:
    """GLUE: the training subset, the dev set (the *test* split when ``--selection-samples`` carves a
    selection split out of the training data, else the split that chooses and reports) and its metrics."""
    from peftlab.tasks import data_files as data
    from peftlab.tasks.metrics import compute_metrics

    pool = data.load_split(task, "train", cfg.data_dir)
    selection_raw, extras = None, {}
    if cfg.selection_samples:  # carved before any seed draws, so no seed's subset can hold a selection example
        pool, selection_raw, stratified = data.selection_split(pool, cfg.selection_samples, cfg.eval_seed,
                                                               regression=task.kind == "regression")
        extras["selection"] = {"examples": len(selection_raw), "stratified": stratified,
                               "examples_digest": examples_digest({"selection": selection_raw})}
    splits = data.available_eval_splits(task, cfg.data_dir)
    sources = {split: data.locate_split(task, split, cfg.data_dir)[0] for split in ("train", *splits)}
    # cfg.eval_seed, not cfg.seed: every training seed is scored on the same dev examples.
    evals = {split: data.subset(data.load_split(task, split, cfg.data_dir), cfg.max_eval_samples, cfg.eval_seed)
             for split in splits}
    # Say in result.json which data was used: a 10k subset is never passed off as the full task.
    kinds = {s.dataset if s is not None else "hub" for s in sources.values()}
    extras.update({
        "dataset": data.SUBSET_DATASET if data.SUBSET_DATASET in kinds else ("glue" if kinds == {"glue"}
                                                                            else "+".join(sorted(kinds))),
        "data_files": {split: str(s.path) if s is not None else data.HUB_DATASET for split, s in sources.items()}})
    return label_pipeline(cfg, tokenizer, data.subset(pool, cfg.max_train_samples, cfg.seed), evals, kind=task.kind,
                          metric=task.primary_metric, num_labels=task.num_labels, extras=extras,
                          metrics=lambda logits, labels: compute_metrics(task, logits, labels),
                          selection_raw=selection_raw)


@dataclass(frozen=True)
class Selection:
    """The selection split of a run (``--selection-samples``): its tokenised examples and its chance level."""

    tokenised: Any
    chance: float


def label_evaluate(cfg, metrics: Callable, evals: dict, selection: Selection | None, collate) -> Callable:
    """``evaluate(model, accelerator, tag)``: ``metrics(logits, labels)`` of the dev set under their plain names
    (MNLI: per split and their mean). With a selection split, every evaluation during training scores it alone
    (``selection_<name>``) and the dev set becomes the test split, scored once, by the ``test`` evaluation."""

    def scores(model, accelerator, tokenised) -> dict[str, float]:
        return metrics(*gather_predictions(model, accelerator, tokenised, collate, cfg.eval_batch_size))

    @torch.no_grad()
    def evaluate(model, accelerator, tag: str) -> Evaluation:  # tag: GLUE writes no files
        model.eval()
        if selection is not None and choosing(tag):
            chosen = scores(model, accelerator, selection.tokenised)
            model.train()
            return Evaluation({f"{SELECTION_PREFIX}{k}": v for k, v in chosen.items()})
        results = {split: scores(model, accelerator, tokenised) for split, (_, tokenised) in evals.items()}
        model.train()
        if len(results) == 1:
            flat = dict(next(iter(results.values())))
        else:  # MNLI: matched and mismatched, and their mean under the plain metric name (the papers' column)
            flat = {f"{split.replace('validation_', '')}_{k}": v for split, m in results.items() for k, v in m.items()}
            for key in next(iter(results.values())):
                flat[key] = float(np.mean([m[key] for m in results.values()]))
        return Evaluation(flat)

    return evaluate


def build_labelled(cfg, tokenizer, model, task: Task) -> Pipeline:
    """The user's own labelled data (``--task classify|regress``, :mod:`peftlab.tasks.labelled_data`), scored at
    its ``--metric``."""
    from peftlab.errors import PeftlabError
    from peftlab.tasks.data_files import subset
    from peftlab.tasks.labelled_data import HeadLabels, load_labelled
    from peftlab.tasks.metrics import compute_label_metrics
    from peftlab.tasks.table import task_label

    loaded = load_labelled(cfg, task)
    labels = HeadLabels(len(loaded.label_names) or 1, loaded.label_names)
    if model is not None and task.kind == "classification":  # a saved run evaluated on its data: the same classes
        trained = tuple(model.config.id2label[i] for i in range(model.config.num_labels))
        if trained != labels.names:
            raise PeftlabError(f"the model's classes ({', '.join(trained)}) are not the data's "
                               f"({', '.join(labels.names)})", where=loaded.dataset,
                               fix="evaluate the run on the data it was trained on")
    extras = {"dataset": loaded.dataset, "data_files": dict(loaded.sources), "task_label": task_label(cfg.to_dict()),
              **({"heldout": loaded.heldout} if loaded.heldout else {}),  # the dev set: held out of the training data
              **{k: {str(a): b for a, b in v.items()} for k, v in labels.config_values().items()}}
    return label_pipeline(
        cfg, tokenizer, subset(loaded.train, cfg.max_train_samples, cfg.seed),
        {"validation": subset(loaded.eval, cfg.max_eval_samples, cfg.eval_seed)}, kind=task.kind, metric=cfg.metric,
        num_labels=labels.num_labels, extras=extras,
        metrics=lambda logits, gold: compute_label_metrics(task.kind, logits, gold, labels.num_labels))


# A task's row names its pipeline (``Task.pipeline``); builders other than GLUE's are imported on demand. Each takes
# ``(cfg, tokenizer, model, task)``: the Task resolved once, so none looks ``cfg.task`` up again.
BUILDERS: dict[str, str | Callable] = {
    "glue": build_glue,
    "instruction": "peftlab.tasks.instructions:build_pipeline",
    "mt_bench": "peftlab.tasks.mt_bench:build_pipeline",
    # Decoder tasks scored on generated text.
    "commonsense": "peftlab.tasks.commonsense:build_pipeline",
    "math": "peftlab.tasks.math_tasks:build_pipeline",
    "e2e": "peftlab.tasks.e2e:build_pipeline",
    # The user's own labelled files and datasets (--train-file / --dataset).
    "labelled": build_labelled,
}


def build_pipeline(cfg, tokenizer, model, task: Task | None = None) -> Pipeline:
    """The run's pipeline, carrying its :class:`Task` (``task``: the one the caller resolved from ``cfg.task``;
    looked up here when it has none)."""
    task = task or registered_task(cfg.task)
    builder = BUILDERS[task.pipeline]
    if isinstance(builder, str):
        module, name = builder.split(":")
        builder = getattr(importlib.import_module(module), name)
    return replace(builder(cfg, tokenizer, model, task), task=task)
