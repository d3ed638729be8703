"""The task table: label spaces, input fields, metrics and files of every task peftlab can train.

GLUE tasks are sequence classification (STS-B: regression); ``gsm8k``, ``alpaca`` and ``json`` are
instruction tasks for causal LMs. To add a task, add a row here and, if its files have a new layout, a
reader in :mod:`peftlab.tasks.data_files`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "classification", "regression" or "instruction"
    primary_metric: str  # the papers' table column
    label_names: tuple[str, ...] = ()  # index = class id; raw labels in files are mapped by name
    text_fields: tuple[str, ...] = ()  # Hub (nyu-mll/glue) column names of the one or two input texts
    glue_dir: str = ""  # folder name in the GLUE glue_data layout
    eval_splits: tuple[str, ...] = ("validation",)  # MNLI has matched and mismatched
    eval_before: bool = False  # evaluate the untrained model too (GSM8K: accuracy before and after)
    # Defaults for --max-length / --batch-size when not given (None: TrainConfig's). GSM8K question + worked
    # answer is ~175 tokens (p99 ~350) with the chat template, so 128 would cut most answers before "#### N";
    # 32 x 512 tokens of a 49k-vocabulary decoder would need ~30 GB of activations and logits on CPU.
    default_max_length: int | None = None
    default_batch_size: int | None = None
    # Default --eval-every (None: 1). GSM8K's evaluation generates an answer per problem, about as costly as
    # an epoch of training on 500 examples, so by default it runs only before and after fine-tuning (0).
    default_eval_every: int | None = None

    @property
    def num_labels(self) -> int:
        return 1 if self.kind == "regression" else len(self.label_names)

    @property
    def head(self) -> str:
        return {"classification": "classification", "regression": "regression"}.get(self.kind, "causal-lm")


_BIN = ("0", "1")

TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        Task("cola", "classification", "matthews_correlation", _BIN, ("sentence",), "CoLA"),
        Task("sst2", "classification", "accuracy", _BIN, ("sentence",), "SST-2"),
        Task("mrpc", "classification", "accuracy", _BIN, ("sentence1", "sentence2"), "MRPC"),
        Task("qqp", "classification", "accuracy", _BIN, ("question1", "question2"), "QQP"),
        Task("stsb", "regression", "pearson", (), ("sentence1", "sentence2"), "STS-B"),
        Task("mnli", "classification", "accuracy", ("entailment", "neutral", "contradiction"),
             ("premise", "hypothesis"), "MNLI", ("validation_matched", "validation_mismatched")),
        Task("qnli", "classification", "accuracy", ("entailment", "not_entailment"), ("question", "sentence"), "QNLI"),
        Task("rte", "classification", "accuracy", ("entailment", "not_entailment"), ("sentence1", "sentence2"), "RTE"),
        Task("wnli", "classification", "accuracy", _BIN, ("sentence1", "sentence2"), "WNLI"),
        Task("gsm8k", "instruction", "accuracy", eval_splits=("test",), eval_before=True,
             default_max_length=512, default_batch_size=8, default_eval_every=0),
        Task("alpaca", "instruction", "eval_loss", default_max_length=512, default_batch_size=8),
        Task("json", "instruction", "eval_loss", default_max_length=512, default_batch_size=8),
    ]
}

GLUE_TASKS = tuple(name for name, t in TASKS.items() if t.glue_dir)
