"""Typed config schema (dataclasses) <-> command-line flags <-> YAML.

A run's config is one flat dataclass, :class:`TrainConfig`, built from the method part
(:class:`~peftlab.methods.table.MethodConfig`) and the optimizer part (:class:`~peftlab.methods.optim_groups.OptimConfig`) plus
the run's own fields. The docstring under each field is its ``--help`` text; cross-field checks live in
``__post_init__``. Precedence: defaults < ``--config`` YAML < flags. Unknown YAML keys are an error that
names the closest valid key. The resolved config is written beside every result (``config.yaml``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import math
import os
import textwrap
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from peftlab.errors import PeftlabError, closest
from peftlab.methods.table import MethodConfig
from peftlab.methods.optim_groups import OptimConfig


# --scheduler -> transformers' get_scheduler name (each after --warmup-ratio's linear warm-up).
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}
REPORT_TO = ("tensorboard", "wandb", "mlflow", "none")  # Accelerate trackers, or none


def _require_count(value, flag: str, *, zero_ok: bool = False, none_ok: bool = False) -> None:
    """An integer option: > 0 (>= 0 with ``zero_ok``), or None with ``none_ok``; else one line."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not zero_ok):
        kind = "an integer >= 0" if zero_ok else "a positive integer"
        raise PeftlabError(f"--{flag.replace('_', '-')} must be {kind}, got {value!r}")


@dataclass
class TrainConfig(MethodConfig, OptimConfig):
    """Run: task, model, data, training loop and output"""

    lr: float | None = None
    """Learning rate of q and k (eta_QK); default: the method's usual rate (`peftlab methods`)."""
    head_lr: float | None = None
    """Learning rate of the task head; default: the method's head rate (`peftlab methods`), whatever --lr is."""
    task: str = "rte"
    """Task: a GLUE task (cola sst2 mrpc qqp stsb mnli qnli rte wnli) or an instruction task (gsm8k, alpaca, json)."""
    model: str = "minilm-l6"
    """Model: a registered name (`peftlab models`), a local folder or a Hugging Face id."""
    epochs: int = 3
    """Training epochs; 0 evaluates the model before fine-tuning."""
    batch_size: int | None = None
    """Training examples per optimizer step (per process under accelerate launch); default 16 (GLUE), 8 for gsm8k/alpaca/json."""
    eval_batch_size: int = 64
    """Examples per evaluation batch."""
    max_length: int | None = None
    """Maximum tokens per example; longer inputs are truncated. Default 128 (the papers' T), 512 for gsm8k/alpaca/json."""
    pooling: str = "auto"
    """Encoder classifiers: what feeds the head. auto: the checkpoint's own sentence-transformers pooling if it declares mean (minilm-l6 does), else native; native: the architecture's ([CLS] for BERT); mean: masked mean of the tokens."""
    pad_to_max: bool = False
    """Pad every batch to --max-length (the papers' setup) instead of dynamic padding with length-grouped batches."""
    warmup_ratio: float = 0.06
    """Fraction of the optimizer steps with linear learning-rate warm-up."""
    scheduler: str = "linear"
    """Learning-rate schedule after the warm-up (transformers' get_scheduler): linear (decay to 0, the papers'), cosine or constant."""
    grad_accum: int = 1
    """Accumulate gradients over N batches per optimizer step (Accelerate's gradient_accumulation_steps): an effective batch of N x --batch-size."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (the schedule's length; overrides --epochs, the last epoch may be partial)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables clipping)."""
    seed: int = 0
    """Training seed: head init, adapter init, data order, dropout and the --max-train-samples draw. It never changes which dev examples are evaluated (--eval-seed does)."""
    max_train_samples: int | None = None
    """Train on a deterministic subset of this many examples (the first after a shuffle seeded by --seed)."""
    max_eval_samples: int | None = None
    """Evaluate on a fixed subset of this many dev examples, drawn with --eval-seed: identical for every training seed, so seeds differ only in training."""
    eval_seed: int = 0
    """Seed of the --max-eval-samples draw (recorded in result.json). Keep it fixed across a study so every run is scored on the same examples."""
    data_dir: str | None = None
    """Local data folder (GLUE `glue_data` layout); default $PEFTLAB_DATA_DIR, then ../shared/data, then the Hub."""
    output_dir: str = "runs/latest"
    """Where result.json, config.yaml, the adapter, logs and checkpoints go."""
    overwrite: bool = False
    """Replace a finished run already in --output-dir."""
    resume: bool = False
    """Continue a killed run from the last checkpoint in --output-dir."""
    save: str = "best"
    """What adapter/ holds: best (the weights of the epoch with the best dev metric, the number result.json reports as best, so `peftlab evaluate` reproduces it) or last (the final epoch's)."""
    checkpoint_every: int | None = None
    """Also checkpoint every N optimizer steps (atomic). Default: every 200 steps on epochs longer than that, so a kill loses at most 200 steps; 0: only at the end of each epoch."""
    mixed_precision: str = "auto"
    """auto, no, bf16 or fp16. auto: bf16 on CUDA; on a CPU with native bf16 (AMX/avx512_bf16) bf16 autocast for models of >= 100M parameters (measured 1.7-1.9x faster at the same accuracy on MPNet-base), else fp32. The choice is printed at start and recorded in result.json."""
    threads: int | None = None
    """CPU threads for this run's tensor maths (torch.set_num_threads); default: torch's choice (all cores; a sweep worker: its share)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of storing them: less memory, about a third more compute."""
    trust_remote_code: bool = False
    """Allow a Hub model's own Python code to run (off by default: it is arbitrary code)."""
    allow_pickle: bool = False
    """Allow loading pickle (.bin) adapters, which can run arbitrary code."""
    instruction_fields: str = "instruction,input,output"
    """For --task json: the prompt, optional input and response field names of a JSON/JSONL file."""
    train_file: str | None = None
    """For --task json: the training JSON/JSONL file."""
    eval_file: str | None = None
    """For --task json: the evaluation JSON/JSONL file (default: a held-out 10% of --train-file)."""
    eval_before: bool = False
    """Also evaluate the untrained model before fine-tuning (the papers' "before" row; always on for gsm8k)."""
    eval_every: int | None = None
    """Evaluate after every N epochs, and always after the last; 0: only after the last. Default 1; gsm8k: 0 (generation costs about an epoch)."""
    max_new_tokens: int = 256
    """Generation length limit for GSM8K evaluation."""
    log_every: int = 10
    """Log training loss and learning rate every N steps (see --report-to)."""
    report_to: str = "tensorboard"
    """Experiment tracking through Accelerate's trackers: tensorboard (<run>/tb), wandb, mlflow (their package installed; online, their account) or none."""

    def __post_init__(self):
        MethodConfig.__post_init__(self)
        from peftlab.methods.table import METHODS

        method = METHODS[self.method]
        if self.lr is None:
            self.lr = method.default_lr
        if self.head_lr is None:  # one rule for every method: --head-lr, else the method's default head lr
            self.head_lr = method.default_head_lr
        OptimConfig.__post_init__(self)
        from peftlab.errors import unknown
        from peftlab.models.pooling import POOLINGS
        from peftlab.tasks.table import TASKS

        self.task = str(self.task).lower()
        if self.task not in TASKS:
            raise unknown("task", self.task, TASKS, where="--task")
        task = TASKS[self.task]
        if self.max_length is None:  # per-task defaults: a GSM8K worked answer needs ~350 tokens, GLUE 128
            self.max_length = task.default_max_length or 128
        if self.batch_size is None:
            # 16, not the papers' 32: on small GLUE sets (RTE: 2,490) 3 epochs of 32 are only 234 steps, and
            # MiniLM-L6 + LoRA did not leave the majority class in them (docs/RESULTS.md, RTE).
            self.batch_size = task.default_batch_size or 16
        if self.eval_every is None:
            self.eval_every = 1 if task.default_eval_every is None else task.default_eval_every
        if self.pooling not in POOLINGS:
            raise unknown("pooling", self.pooling, POOLINGS, where="--pooling")
        for flag in ("epochs", "batch_size", "eval_batch_size", "max_length", "checkpoint_every", "log_every",
                     "max_new_tokens", "eval_every", "eval_seed", "threads", "grad_accum", "max_steps"):
            _require_count(getattr(self, flag), flag, zero_ok=flag in ("epochs", "checkpoint_every", "eval_every",
                                                                       "eval_seed"),
                           none_ok=flag in ("checkpoint_every", "threads", "max_steps"))
        for flag in ("max_train_samples", "max_eval_samples"):
            _require_count(getattr(self, flag), flag, none_ok=True)
        for flag in ("warmup_ratio", "max_grad_norm"):
            value = getattr(self, flag)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise PeftlabError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value!r}")
        if self.warmup_ratio >= 1:
            raise PeftlabError(f"--warmup-ratio must be < 1, got {self.warmup_ratio}")
        if self.report_to not in REPORT_TO:
            raise unknown("--report-to", self.report_to, REPORT_TO, where="--report-to")
        if self.scheduler not in SCHEDULERS:
            raise unknown("--scheduler", self.scheduler, SCHEDULERS, where="--scheduler")
        if self.save not in ("best", "last"):
            raise unknown("--save value", self.save, ("best", "last"), where="--save")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise PeftlabError(f"unknown --mixed-precision '{self.mixed_precision}'", fix="use auto, no, bf16 or fp16")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["targets"] = ",".join(self.targets)
        return out


# --------------------------------------------------------------------------- field docs -> --help


def field_docs(cls) -> dict[str, str]:
    """The string literal under each field of ``cls`` and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, following in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant):
                    docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def _base_type(annotation) -> type:
    hints = annotation if not isinstance(annotation, str) else eval(annotation, vars(typing))  # noqa: S307
    args = [a for a in typing.get_args(hints) if a is not type(None)]
    origin = typing.get_origin(hints)
    if origin is tuple:
        return tuple
    if args and origin is not None:
        return _base_type(args[0]) if not isinstance(args[0], str) else str
    return hints if isinstance(hints, type) else str


@functools.lru_cache(maxsize=None)  # resolving annotations costs ~1 ms; sweeps coerce thousands of values
def _type_hints(cls) -> dict[str, Any]:
    hints = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            mod = inspect.getmodule(klass)
            hints.update(typing.get_type_hints(klass, vars(mod)))
    return hints


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, *, skip: tuple[str, ...] = ()) -> None:
    """One kebab-case flag per field, grouped by the dataclass that declares it; defaults are None so that
    only the flags given override YAML."""
    docs = field_docs(cls)
    hints = _type_hints(cls)
    by_name = {f.name: f for f in fields(cls)}
    done: set[str] = set()  # a field redeclared in a subclass (e.g. lr) gets the subclass's flag only
    for klass in [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]:
        title = (klass.__doc__ or klass.__name__).strip().splitlines()[0]
        group = parser.add_argument_group(title)
        for name in klass.__dict__.get("__annotations__", {}):
            if name in skip or name not in by_name or name in done:
                continue
            done.add(name)
            f = by_name[name]
            kind = _base_type(hints[name])
            flag = "--" + name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else None
            shown = ",".join(default) if isinstance(default, tuple) else default
            help_text = docs.get(name, "") + (f" (default: {shown})" if shown is not None else "")
            help_text = help_text.replace("%", "%%")  # argparse %-formats help strings
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                group.add_argument(flag, type=str, default=None, metavar=name.upper(), help=help_text, dest=name)


def _coerce(cls, name: str, value: Any, where: str) -> Any:
    """Turn a flag string or YAML value into the field's type; one-line error when it can't."""
    if value is None:
        return None
    kind = _base_type(_type_hints(cls)[name])
    flag = "--" + name.replace("_", "-")
    try:
        if kind is tuple:
            return tuple(value.split(",")) if isinstance(value, str) else tuple(value)
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "yes", "1"):
                return True
            if str(value).lower() in ("false", "no", "0"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, bool):
                raise ValueError
            return int(str(value))
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise PeftlabError(f"{flag} must be {kind.__name__}, got {value!r}", where=where) from None


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise PeftlabError(f"config file not found: {path}", fix="check the --config path")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise PeftlabError(f"invalid YAML: {getattr(err, 'problem', err)}", where=where) from None
    if not isinstance(data, dict):
        raise PeftlabError("a config file must be a mapping of keys to values", where=str(path))
    return data


def normalise_keys(cls, data: dict[str, Any], where: str) -> dict[str, Any]:
    names = [f.name for f in fields(cls)]
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in names:
            raise PeftlabError(f"unknown config key '{key}'{closest(name, names)}", where=where,
                               fix="remove it or use a key from `peftlab train --help`")
        out[name] = _coerce(cls, name, value, where)
    return out


def build_config(cls, *, yaml_path: str | None = None, overrides: dict[str, Any] | None = None,
                 flag_values: dict[str, Any] | None = None, check_explicit: bool = False):
    """defaults < YAML file < ``overrides`` (already typed, e.g. a sweep cell) < command-line flags.

    ``check_explicit`` (``peftlab train``): an option set in the YAML or by a flag that the run would ignore
    (e.g. ``--alpha`` with VeRA) is an error (:func:`peftlab.methods.table.check_explicit_options`)."""
    values: dict[str, Any] = {}
    explicit: set[str] = set()
    if yaml_path:
        from_yaml = normalise_keys(cls, load_yaml(yaml_path), str(yaml_path))
        values.update(from_yaml)
        explicit.update(k for k, v in from_yaml.items() if v is not None)
    if overrides:
        values.update(normalise_keys(cls, overrides, "sweep spec"))
    for name, value in (flag_values or {}).items():
        if value is not None:
            values[name] = _coerce(cls, name, value, "command line")
            explicit.add(name)
    cfg = cls(**values)
    if check_explicit:
        from peftlab.methods.table import check_explicit_options

        check_explicit_options(cfg, explicit)
    return cfg


def save_config(cfg, path: str | Path) -> None:
    data = cfg.to_dict() if hasattr(cfg, "to_dict") else dataclasses.asdict(cfg)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
