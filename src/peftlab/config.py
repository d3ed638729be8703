"""Typed config schema (dataclasses) <-> command-line flags <-> YAML.

A run's config is one dataclass, :class:`TrainConfig`, built from the method part
(:class:`~peftlab.methods.table.MethodConfig`) and the optimizer part (:class:`~peftlab.methods.optim_groups.OptimConfig`) plus
the run's own fields. Each method's own options nest as in peft (``cfg.kasa.beta``: :mod:`peftlab.methods.options`);
flags, YAML, sweep specs and config.yaml name them flat (``--kasa-beta``, ``kasa_beta:``), a YAML file may nest
them too (``kasa: {beta: 0.01}``). The docstring under each field is its ``--help`` text; cross-field checks live in
``__post_init__``. Precedence: defaults < ``--config`` YAML < flags. Unknown YAML keys are an error that
names the closest valid key. The resolved config is written beside every result (``config.yaml``).
Flags, YAML and value checking are :mod:`peftlab.config_cli` (jsonargparse), re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from peftlab.errors import PeftlabError
# The dataclass <-> flags <-> YAML layer (on jsonargparse), re-exported: `from peftlab.config import build_config`.
from peftlab.config_cli import (  # noqa: F401
    add_dataclass_flags, build_config, coerce, config_yaml, field_docs, field_types, flat_dict, from_flat,
    load_yaml, normalise_keys, option_defaults, option_names, save_config)
from peftlab.methods.table import MethodConfig
from peftlab.methods.optim_groups import OptimConfig


# --scheduler -> transformers' get_scheduler name (each after --warmup-ratio's linear warm-up).
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}
REPORT_TO = ("tensorboard", "wandb", "mlflow", "none")  # Accelerate trackers, or none
_coerce = coerce  # the former name, until every caller says coerce


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
    """Task: a GLUE task (cola sst2 mrpc qqp stsb mnli qnli rte wnli) or an instruction task (gsm8k, alpaca, json, mt-bench), or a decoder task scored on generated text (commonsense, math, e2e), or your own labelled data: classify (class labels) or regress (numbers), from --train-file or --dataset."""
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
    pooling: str = "native"
    """Encoder classifiers: what feeds the head. native (default): the architecture's ([CLS] for BERT), which plain transformers + peft reproduce from the saved adapter; mean: masked mean of the tokens (peftlab's own: the adapter alone does not carry it); auto: the checkpoint's declared sentence-transformers pooling (mean for minilm-l6, mpnet-base), else native."""
    pad_to_max: bool = False
    """Pad every batch to --max-length (the papers' setup) instead of dynamic padding with length-grouped batches."""
    packing: bool = False
    """Decoder training (instruction tuning, commonsense, math, e2e, mt-bench): put each batch's examples into one row without padding (transformers' DataCollatorWithFlattening: position_ids restart per example, no example attends across a boundary, the prompt stays masked), batches drawn at random instead of length-grouped. --batch-size still counts examples, and the loss is the mean over the batch's response tokens, as when padded. Off by default: on a CPU, attention has no variable-length kernel, so a packed row's block-diagonal mask makes attention quadratic in the whole row, which costs more (about 7-28 % more model FLOPs on math/commonsense with SmolLM2 at batch 4-8) than the 1-2 % of padding that length-grouped batches leave (docs/BENCHMARKS.md)."""
    warmup_ratio: float = 0.06
    """Fraction of the optimizer steps with linear learning-rate warm-up."""
    scheduler: Literal["linear", "cosine", "constant"] = "linear"
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
    save: Literal["best", "last"] = "best"
    """What adapter/ holds: best (the weights of the epoch with the best dev metric, the number result.json reports as best, so `peftlab evaluate` reproduces it) or last (the final epoch's)."""
    checkpoint_every: int | None = None
    """Also checkpoint every N optimizer steps (atomic). Default: every 200 steps on epochs longer than that, so a kill loses at most 200 steps; 0: only at the end of each epoch."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
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
    """For --task json (and mt-bench, instead of Alpaca): the training JSON/JSONL file. For --task classify/regress: the labelled training file: CSV, TSV (tab-separated, no quoting), JSON, JSONL or Parquet (datasets' csv/json/parquet builders); the digest of its bytes is recorded (data_digest), so the run key changes with its content."""
    eval_file: str | None = None
    """For --task json: the evaluation JSON/JSONL file (default: a held-out 10% of --train-file). For --task classify/regress: the labelled evaluation file (same formats); default: a held-out 10% of the training data (stratified by class for classify), drawn with a fixed seed (0) that never moves with --seed, so every seed trains and is scored on the same split."""
    dataset: str | None = None
    """For --task classify/regress, instead of --train-file: a folder written by datasets' save_to_disk (offline), else a Hugging Face Hub dataset NAME[:CONFIG] (online only). Its train split trains; --eval-split evaluates."""
    eval_split: str | None = None
    """For --task classify/regress with --dataset: the split to evaluate on; default: validation when it has one, else a held-out 10% of train (as without --eval-file)."""
    text_fields: str | None = None
    """For --task classify/regress: the one or two text columns, A[,B] (two are encoded as a sentence pair); default: text."""
    label_field: str = "label"
    """For --task classify/regress: the label column. classify: strings or integers, mapped to class ids in sorted order (saved as the model's id2label); regress: numbers (one output, MSE)."""
    metric: str | None = None
    """For --task classify/regress: the primary metric (best epoch, reports, the chance bar). classify: accuracy (default), f1 (binary: the second of the two sorted classes is positive), f1_macro, matthews; regress: pearson (default), spearman. All of them are computed and recorded."""
    data_digest: str | None = None
    """Set by peftlab for --task classify/regress: sha256 of the bytes of --train-file/--eval-file (or of the --dataset folder's files), so a run's key changes when its data does. A run's config.yaml keeps it; evaluating that run on data that changed since is refused."""
    eval_sets: str | None = None
    """For --task commonsense or math: the test sets to evaluate, comma-separated (default: all seven; commonsense: boolq piqa social_i_qa winogrande ARC-Easy ARC-Challenge openbookqa; math: gsm8k AQuA AddSub MultiArith SVAMP SingleEq mawps). --max-eval-samples applies to each set."""
    train_sets: str | None = None
    """For --task commonsense: the training splits, comma-separated (default: the union of all four available: boolq ARC-Easy ARC-Challenge openbookqa; the papers' 170k mix is not available offline)."""
    eval_before: bool = False
    """Also evaluate the untrained model before fine-tuning (the papers' "before" row; always on for gsm8k)."""
    eval_every: int | None = None
    """Evaluate after every N epochs, and always after the last; 0: only after the last. Default 1; gsm8k: 0 (generation costs about an epoch)."""
    eval_steps: int = 0
    """Also evaluate on the dev set every N optimizer steps during training (learning curves: result.json "curve", <run>/curve.jsonl); 0: off. Each evaluation is a full pass over the dev set (on a generation task, a full generation run), so a run pays its optimizer steps / N extra dev passes. The best epoch (and --save best) is still chosen among the epoch-end evaluations only."""
    lm_eval: str | None = None
    """Decoder runs: after training, also score the saved weights with lm-evaluation-harness (pip install "peftlab[lm-eval]"), offline on the local data, on these tasks (comma-separated): gsm8k gsm8k_cot arc_easy arc_challenge openbookqa piqa social_iqa winogrande, or commonsense (the six multiple-choice sets; BoolQ's local copy has no passages). The harness's own prompts and metrics; multiple-choice sets by the log-likelihood of each choice. --max-eval-samples / --eval-seed draw the items (the same as the run's own evaluation), --eval-batch-size batches them. Results: result.json "lm_eval" (peftlab report --metric lm_eval/<task>/<metric>)."""
    max_new_tokens: int | None = None
    """Generation length limit; default 256 (gsm8k, math), 32 (commonsense, as LLM-Adapters), 64 (e2e). For GSM8K evaluation (and each MT-Bench answer; FastChat uses 1024)."""
    judge_url: str | None = None
    """For --task mt-bench: the judge's OpenAI-compatible base URL (e.g. https://api.openai.com/v1, or http://127.0.0.1:8000/v1 for a local server). Without it the answers are generated and saved, not judged."""
    judge_model: str = "gpt-4"
    """For --task mt-bench: the judge model's name at --judge-url (FastChat's MT-Bench judge is gpt-4; anything but a strong API model is labelled a weak judge)."""
    judge_api_key_env: str = "OPENAI_API_KEY"
    """For --task mt-bench: the environment variable holding the judge's API key (never the key itself: config.yaml is saved)."""
    judge_timeout: float = 120.0
    """For --task mt-bench: seconds per judge request; a request still unanswered is retried (--judge-retries), then recorded as unjudged."""
    judge_retries: int = 3
    """For --task mt-bench: retries of a failed judge request (timeouts, connection errors, HTTP 429/5xx), with exponential back-off."""
    judge_parallel: int = 4
    """For --task mt-bench: judge requests in flight at once."""
    log_every: int = 10
    """Log training loss and learning rate every N steps (see --report-to)."""
    report_to: Literal["tensorboard", "wandb", "mlflow", "none"] = "tensorboard"
    """Experiment tracking through Accelerate's trackers: tensorboard (<run>/tb), wandb, mlflow (their package installed; online, their account) or none."""

    def __post_init__(self):
        MethodConfig.__post_init__(self)
        from peftlab.methods.table import METHODS

        method = METHODS[self.method]
        if self.lr is None:
            self.lr = method.default_lr
        if self.head_lr is None:  # one rule for every method: --head-lr, else the method's default head lr
            self.head_lr = method.default_head_lr
        if not method.adapts_projections:
            # head-only: the head's rate is the only one (nothing trains at eta_QK or eta_V), and the config, the
            # run key and result.json say so; a sweep's lr / lr_ratio axis cannot make distinct keys of one run
            self.lr, self.lr_ratio = self.head_lr, 1.0
        OptimConfig.__post_init__(self)
        from peftlab.errors import unknown
        from peftlab.models.pooling import POOLINGS
        from peftlab.tasks.table import TASKS

        self.task = str(self.task).lower()
        if self.task not in TASKS:
            raise unknown("task", self.task, TASKS, where="--task")
        task = TASKS[self.task]
        if self.packing and task.head != "causal-lm":
            raise PeftlabError(f"--packing packs decoder training examples; task '{self.task}' trains an encoder head",
                               fix="drop --packing (encoder batches are length-grouped and dynamically padded)")
        if self.packing and self.pad_to_max:
            raise PeftlabError("--packing and --pad-to-max ask for opposite batches (no padding, padding to T)",
                               fix="pass one of them")
        if not method.adapts_projections and task.head == "causal-lm":
            raise PeftlabError(f"--method {self.method} trains only a task head, and task '{self.task}' has none (a "
                               "causal LM is scored through its own language-model head)",
                               fix=f"use an adapter method (e.g. --method lora) for --task {self.task}")
        if self.max_length is None:  # per-task defaults: a GSM8K worked answer needs ~350 tokens, GLUE 128
            self.max_length = task.default_max_length or 128
        if self.batch_size is None:
            # 16, not the papers' 32: on small GLUE sets (RTE: 2,490) 3 epochs of 32 are only 234 steps, and
            # MiniLM-L6 + LoRA did not leave the majority class in them (docs/RESULTS.md, RTE).
            self.batch_size = task.default_batch_size or 16
        if self.eval_every is None:
            self.eval_every = 1 if task.default_eval_every is None else task.default_eval_every
        if self.max_new_tokens is None:
            self.max_new_tokens = task.default_max_new_tokens or 256
        from peftlab.tasks.table import canonical_sets

        self.eval_sets = canonical_sets(self.eval_sets, self.task, "eval_sets")
        self.train_sets = canonical_sets(self.train_sets, self.task, "train_sets")
        if self.lm_eval is not None:  # names checked here; the harness and its data before training starts
            from peftlab.tasks.lm_eval_tasks import task_names

            if task.head != "causal-lm":
                raise PeftlabError(f"--lm-eval scores decoder runs; task '{self.task}' trains an encoder head",
                                   fix="use --lm-eval with a decoder task (commonsense, math, gsm8k, alpaca, json)")
            self.lm_eval = ",".join(task_names(self.lm_eval))
        from peftlab.tasks.labelled_data import resolve_options

        data = resolve_options(self)  # classify/regress: the data options checked, defaults and the data digest
        self.text_fields, self.metric, self.data_digest = data.text_fields, data.metric, data.data_digest
        if self.pooling not in POOLINGS:
            raise unknown("pooling", self.pooling, POOLINGS, where="--pooling")
        for flag in ("epochs", "batch_size", "eval_batch_size", "max_length", "checkpoint_every", "log_every",
                     "max_new_tokens", "eval_every", "eval_steps", "eval_seed", "threads", "grad_accum", "max_steps"):
            _require_count(getattr(self, flag), flag, zero_ok=flag in ("epochs", "checkpoint_every", "eval_every",
                                                                       "eval_steps", "eval_seed"),
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
        _require_count(self.judge_retries, "judge_retries", zero_ok=True)
        _require_count(self.judge_parallel, "judge_parallel")
        if not isinstance(self.judge_timeout, (int, float)) or not math.isfinite(self.judge_timeout) \
                or self.judge_timeout <= 0:
            raise PeftlabError(f"--judge-timeout must be a number of seconds > 0, got {self.judge_timeout!r}")
        if self.judge_url and self.task != "mt-bench":
            raise PeftlabError(f"--judge-url is set, but task '{self.task}' has no judge (it would be ignored)",
                               fix="remove --judge-url, or use --task mt-bench")

    def to_dict(self) -> dict[str, Any]:
        """Flat (``kasa_beta``, ``targets: q,v``): config.yaml, result.json's config and the run key; it reads
        back with ``TrainConfig.from_dict`` or ``build_config``."""
        return flat_dict(self)

