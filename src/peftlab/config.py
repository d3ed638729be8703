"""The config schema: every option of a run declared once (:func:`peftlab.config_roles.option`; the docstring
under a field is its ``--help``). :class:`TrainConfig` = :class:`MethodConfig` (each method's group nested as in
peft, ``cfg.kasa.beta``) + ``cfg.optim`` + the run's own fields; outside Python every option has one flat name
(``--kasa-beta`` / ``kasa_beta``; YAML may nest ``kasa: {beta: ..}``). A leaf: the method's and task's defaults
are :func:`peftlab.resolve.resolve_config`'s.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Literal

from peftlab.config_cli import (
    add_dataclass_flags, build_config, coerce, config_yaml, field_docs, field_types, load_yaml, normalise_keys,
    save_config)
from peftlab.config_roles import (
    POSITIVE, SEED, File, Folder, OptionGroup, Range, Text, check_fields, flat_dict, from_flat, option, option_defaults,
    option_names, role_sets)
from peftlab.errors import PeftlabError
from peftlab.methods.registry import (  # the rows' names and option groups (re-exported: peftlab.config.KasaOptions)
    METHOD_GROUPS, METHOD_NAMES, METHODS, CordaOptions, FourierFTOptions, KasaOptions, VeraOptions)
from peftlab.tasks.table import TASK_NAMES

# The --method and --task choices, read off their registrations (torch-free leaves: tests/test_layout.py
# CONFIG_READS), so that every entry point checks them before anything is loaded.
MethodName = Literal[METHOD_NAMES]
OPTIONS_READ = {name: row.options for name, row in METHODS.items()}  # the lab's: the options each method reads
TaskName = Literal[TASK_NAMES]
Projection = Literal["q", "k", "v", "o", "gate", "up", "down"]  # attention, then the MLP's (they train at --lr)
Pooling = Literal["auto", "native", "mean"]
ReportTo = Literal["auto", "tensorboard", "wandb", "mlflow", "none"]  # Accelerate's trackers, or none
REPORT_TO = typing.get_args(ReportTo)
HEAD_ONLY = "head"  # the one method that adapts no projection: its config holds no targets and no layers
# --scheduler -> transformers' get_scheduler name (each after --warmup-ratio's linear warm-up).
SCHEDULERS = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup"}


MAX_LAYERS = 10_000  # more transformer blocks than any model has (a range is expanded: 0-10**12 would not end)


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """``"6-11"``, ``"0,2,4"`` or ``"0-3,8"`` -> sorted layer indices; None (all layers) for None/""."""
    if text is None or not str(text).strip():
        return None
    out: set[int] = set()
    for piece in str(text).split(","):
        piece = piece.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if not match or (match.group(2) is not None and int(match.group(2)) < int(match.group(1))):
            raise PeftlabError(f"--layers '{text}': '{piece}' is not a layer index or range",
                               fix="use indices and ranges from 0, e.g. --layers 6-11 or --layers 0,2,4")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if high >= MAX_LAYERS:
            raise PeftlabError(f"--layers '{text}': block {high} is beyond any model's ({MAX_LAYERS} blocks at most)",
                               fix="use the model's block indices, from 0")
        out.update(range(low, high + 1))
    return tuple(sorted(out))


def _canonical_layers(text: str) -> str | None:
    """--layers canonical (``6-8`` -> ``6,7,8``; blank: all layers, None), so the run key does not depend on
    how the blocks were spelled."""
    return ",".join(map(str, parse_layers(text) or ())) or None


# --------------------------------------------------------------------------- option groups


@dataclass(frozen=True)
class OptimConfig(OptionGroup):
    """Optimizer: per-projection learning rates (Yao et al.) and AdamW"""

    PREFIX = ""  # flat names are the options' own: --lr, lr_ratio
    lr: float | None = option(None, POSITIVE, key_v1=True, training_only=True, label=6)
    """Learning rate of q and k (eta_QK); default: the method's usual rate (`peftlab methods`)."""
    lr_ratio: float = option(1.0, POSITIVE, key_v1=True, training_only=True, label=7)
    """lambda = eta_V / eta_QK (Yao et al. use 2, 4, 8); v's learning rate is lr_ratio * lr."""
    head_lr: float | None = option(None, POSITIVE, key_v1=True, training_only=True, label=8)
    """Learning rate of the task head; default: the method's head rate (`peftlab methods`), whatever --lr is."""
    weight_decay: float = option(0.0, Range(0), key_v1=True, training_only=True, label=12)
    """AdamW weight decay for matrices (tensors of 2+ dimensions); vectors (biases, norms, DoRA magnitudes, KaSA singular values, VeRA/FourierFT vectors) never decay."""

    def lr_of(self, group: str) -> float:
        """The learning rate of a parameter group (None lr: resolve the config first, peftlab.resolve)."""
        if self.lr is None:
            raise PeftlabError("OptimConfig.lr is not set", fix="give lr=..., or resolve the run's config first "
                                                                "(peftlab.resolve.resolve_config: the method's rate)")
        if group == "v":
            return self.lr * self.lr_ratio
        if group == "head":
            return self.head_lr if self.head_lr is not None else self.lr
        return self.lr


# --------------------------------------------------------------------------- the method part


@dataclass
class MethodChoice:
    """Method: which attention projections to adapt, and how"""

    SECTION = "method"
    method: MethodName = option("lora", noun="method", lower=True, key_v1=True, label=2, adapter_identity=True)
    """Fine-tuning method (`peftlab methods` lists each with its default rates and limits): full fine-tuning, an adapter, or head (the task head alone, at --head-lr: no adapter, the base frozen)."""
    targets: tuple[Projection, ...] = option(("q", "v"), noun="projection", lower=True, key_v1=True, label=3,
                                             adapter_identity=True)
    """Projections to adapt, a comma list of q, k, v, o (Yao et al. tune q,v) and the MLP's gate, up, down (at --lr). Not used by --method head."""
    layers: str | None = option(None, normalise=_canonical_layers)
    """Adapt only these transformer blocks, e.g. 6-11 or 0,2,4 (0 = the first); default: all."""
    rank: int = option(8, Range(1), key_v1=True, label=4, adapter_identity=True)
    """Adapter rank r (LoRA family, KaSA, VeRA). Ignored by full and fourierft."""
    alpha: float = option(16.0, POSITIVE, key_v1=True, label=5)
    """LoRA scaling numerator: the update is scaled by alpha / rank."""
    dropout: float = option(0.0, Range(0, 1, high_open=True), key_v1=True, training_only=True, label=13)
    """Dropout on the adapter input (LoRA family)."""

    def __post_init__(self):
        if str(self.method).strip().lower() == HEAD_ONLY:  # it adapts no projection: whatever targets and layers
            self.targets, self.layers = (), None           # a sweep cell gave, the config (run key) holds none
        check_fields(self)  # every field, this class's and a subclass's: types, choices, ranges
        if not self.targets and self.method != HEAD_ONLY:
            raise PeftlabError("no attention projection selected", where="--targets",
                               fix="pass --targets with some of q,k,v,o (e.g. q,v)")

    @classmethod
    def from_dict(cls, data):
        """From flat keys (``kasa_beta``, ``lr``) or nested groups (``kasa={"beta": ...}``)."""
        return from_flat(cls, data)

    def to_dict(self) -> dict:
        """Flat, as config.yaml and result.json hold it: the run key's input."""
        return flat_dict(self)


# Each method's own options, nested like peft's LoraConfig(kasa_config=KasaConfig(...)): cfg.kasa.beta, one field
# per option group its row in methods/registry.py declares. Flags, YAML, config.yaml and run keys spell them flat,
# kasa_beta (the group's PREFIX).
MethodConfig = dataclasses.make_dataclass(
    "MethodConfig", [(name, group, field(default_factory=group)) for name, group in METHOD_GROUPS.items()],
    bases=(MethodChoice,), namespace={"__module__": __name__, "__doc__": MethodChoice.__doc__})


def parse_targets(targets) -> tuple[str, ...]:
    """``"q,v"`` or ``["q", "v"]`` -> ``("q", "v")``, checked as ``--targets`` is."""
    return MethodConfig(targets=targets).targets


# --------------------------------------------------------------------------- the run


@dataclass
class TrainConfig(MethodConfig):
    """Run: task, model, data, training loop and output"""

    SECTION = "run"  # the --help section of a field declared without section=
    # --help's sections, in this order; the title says where a section's options apply.
    SECTIONS = {
        "run": "Run: task, model, output folder, devices",
        "optim": "Optimizer and schedule: per-projection learning rates (Yao et al.), AdamW, epochs, steps",
        "eval": "Evaluation (every task)", "data": "Data and batches (every task)",
        "method": "Method: which attention projections to adapt, and how",
        **{name: f"{group.__doc__} (--method {name} only)" for name, group in METHOD_GROUPS.items()},
        "files": "Data files (--task json, mt-bench, classify, regress)",
        "labelled": "Your own labelled data (--task classify|regress only)",
        "generation": "Generation (decoder tasks: gsm8k, alpaca, json, mt-bench, commonsense, math, e2e)",
        "judge": "MT-Bench judge (--task mt-bench only)"}

    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer's options (flat: --lr, --lr-ratio, --head-lr, --weight-decay)."""
    task: TaskName = option("rte", noun="task", lower=True, key_v1=True, searchable=False, report_row=False,
                            adapter_identity=True)
    """Task: a GLUE task (cola sst2 mrpc qqp stsb mnli qnli rte wnli) or an instruction task (gsm8k, alpaca, json, mt-bench), or a decoder task scored on generated text (commonsense, math, e2e), or your own labelled data: classify (class labels) or regress (numbers), from --train-file or --dataset."""
    model: str = option("minilm-l6", Text(), key_v1=True, label=1, adapter_identity=True)
    """Model: a registered name (`peftlab models`), a local folder or a Hugging Face id."""
    epochs: int = option(3, Range(0), key_v1=True, searchable=False, training_only=True, label=9, section="optim")
    """Training epochs; 0 evaluates the model before fine-tuning."""
    batch_size: int | None = option(None, Range(1), key_v1=True, training_only=True, label=10, section="optim")
    """Training examples per optimizer step (per process under accelerate launch); default 16 (GLUE), 8 for gsm8k/alpaca/json."""
    eval_batch_size: int = option(64, Range(1), key_v1=True, report_row=False, section="eval")
    """Examples per evaluation batch."""
    max_length: int | None = option(None, Range(1), key_v1=True, label=11, section="data")
    """Maximum tokens per example; longer inputs are truncated. Default 128 (the papers' T), 512 for gsm8k/alpaca/json."""
    pooling: Pooling = option("native", noun="pooling", key_v1=True, adapter_identity=True, section="data")
    """Encoder classifiers: what feeds the head. native (default): the architecture's ([CLS] for BERT), which plain transformers + peft reproduce from the saved adapter; mean: masked mean of the tokens (peftlab's own: the adapter alone does not carry it); auto: the checkpoint's declared sentence-transformers pooling (mean for minilm-l6, mpnet-base), else native."""
    pad_to_max: bool = option(False, key_v1=True, section="data")
    """Pad every batch to --max-length (the papers' setup) instead of dynamic padding with length-grouped batches."""
    packing: bool = option(False, section="data")
    """Decoder training (instruction tuning, commonsense, math, e2e, mt-bench): put each batch's examples into one row without padding (transformers' DataCollatorWithFlattening: position_ids restart per example, the prompt stays masked), batches drawn at random instead of length-grouped; on SDPA each example attends on its own (peftlab.models.packed_attention), else under a block-diagonal mask, and the model is checked to keep the examples apart before training. --batch-size still counts examples, and the loss is the mean over the batch's response tokens, as when padded. Off by default: runs recorded without this key trained padded, so a default must keep meaning that; and length-grouped padding already computes within 1-2 % of the real tokens' model FLOPs (SmolLM2-135M on math/commonsense, batch 4-8), which is all packing can save (peftlab bench --against trainer --task math measures both; docs/BENCHMARKS.md)."""
    warmup_ratio: float = option(0.06, Range(0, 1, high_open=True), key_v1=True, training_only=True, section="optim")
    """Fraction of the optimizer steps with linear learning-rate warm-up."""
    scheduler: Literal["linear", "cosine", "constant"] = option("linear", section="optim")
    """Learning-rate schedule after the warm-up (transformers' get_scheduler): linear (decay to 0, the papers'), cosine or constant."""
    grad_accum: int = option(1, Range(1), section="optim")
    """Accumulate gradients over N batches per optimizer step (Accelerate's gradient_accumulation_steps): an effective batch of N x --batch-size."""
    max_steps: int | None = option(None, Range(1), section="optim")
    """Stop after this many optimizer steps (the schedule's length; overrides --epochs, the last epoch may be partial)."""
    max_grad_norm: float = option(1.0, Range(0), key_v1=True, training_only=True, section="optim")
    """Gradient clipping norm (0 disables clipping)."""
    seed: int = option(0, SEED, key_v1=True, searchable=False, report_row=False)
    """Training seed: head init, adapter init, data order, dropout and the --max-train-samples draw. It never changes which dev examples are evaluated (--eval-seed does)."""
    max_train_samples: int | None = option(None, Range(1), key_v1=True, training_only=True, section="data")
    """Train on a deterministic subset of this many examples (the first after a shuffle seeded by --seed)."""
    max_eval_samples: int | None = option(None, Range(1), key_v1=True, section="eval")
    """Evaluate on a fixed subset of this many dev examples, drawn with --eval-seed: identical for every training seed, so seeds differ only in training."""
    eval_seed: int = option(0, SEED, key_v1=True, section="eval")
    """Seed of the --max-eval-samples draw (recorded in result.json). Keep it fixed across a study so every run is scored on the same examples."""
    selection_samples: int = option(0, Range(0), training_only=True, section="eval")
    """Carve this many examples out of the training split as a *selection* split (stratified by label, drawn with --eval-seed, so every seed shares it; no seed's training subset ever holds one of them): the best epoch, early stopping and the run's labels read it, and the dev set becomes the *test* split, read only for the reported numbers (result.json: "test" metrics at the selection-best epoch). 0: no selection split (the dev set chooses and reports). GLUE tasks only."""
    early_stop_patience: int = option(0, Range(0), training_only=True, section="optim")
    """Early stopping: end the run once the selection metric (the dev metric without --selection-samples) has not improved by more than --early-stop-min-delta for this many evaluated epochs; --epochs is then the cap (the schedule is laid out for the cap). result.json "plateau" says whether it stopped, flattened or was still improving. 0: off."""
    early_stop_min_delta: float = option(0.0, Range(0), training_only=True, section="optim")
    """Early stopping: the smallest gain of the selection metric that counts as an improvement (in the metric's units, e.g. 0.002 = 0.2 points of accuracy)."""
    data_dir: str | None = option(None, Folder(), key_v1=True, report_row=False, section="data")
    """Local data folder (GLUE `glue_data` layout); default $PEFTLAB_DATA_DIR, then ../shared/data, then the Hub."""
    output_dir: str = option("runs/latest", Folder(exists=False), key_v1=True, resumable=True, run_managed=True,
                             searchable=False, report_row=False)
    """Where result.json, config.yaml, the adapter, logs and checkpoints go."""
    overwrite: bool = option(False, key_v1=True, resumable=True, run_managed=True, searchable=False, report_row=False)
    """Replace a finished run already in --output-dir."""
    resume: bool = option(False, key_v1=True, resumable=True, run_managed=True, searchable=False, report_row=False)
    """Continue a killed run from the last checkpoint in --output-dir."""
    save: Literal["best", "last"] = option("best")
    """What adapter/ holds: best (the weights of the epoch with the best dev metric, the number result.json reports as best, so `peftlab evaluate` reproduces it) or last (the final epoch's)."""
    checkpoint_every: int | None = option(None, Range(0), key_v1=True, resumable=True, hashed_as=0, report_row=False)
    """Also checkpoint every N optimizer steps (atomic). Default: every 200 steps on epochs longer than that, so a kill loses at most 200 steps; 0: only at the end of each epoch."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = option("auto", key_v1=True)
    """auto, no, bf16 or fp16. auto: bf16 on CUDA; on a CPU with native bf16 (AMX/avx512_bf16) bf16 autocast for models of >= 100M parameters (measured 1.7-1.9x faster at the same accuracy on MPNet-base), else fp32. The choice is printed at start and recorded in result.json."""
    threads: int | None = option(None, Range(1, 2**31 - 1, why="torch.set_num_threads takes a C int"), resumable=True,
                                 report_row=False)
    """CPU threads for this run's tensor maths (torch.set_num_threads); default: torch's choice (all cores; a sweep worker: its share)."""
    gradient_checkpointing: bool = option(False)
    """Recompute activations in the backward pass instead of storing them: less memory, about a third more compute."""
    compile: Literal["auto", "on", "off"] = option("auto", noun="--compile choice", lower=True, resumable=True,
                                                   searchable=False, report_row=False)
    """torch.compile of the model for the train step (forward and backward; the optimizer, KaSA's regulariser, evaluation and generation stay eager), with dynamic shapes for length-grouped batches and dropout drawn as in eager, so a compiled run gives the eager run's losses within float tolerance. on, off, or auto: compile when the run's optimizer steps reach the break-even measured on this device type (peftlab.training.compile.AUTO_BREAK_EVEN_STEPS; on CPU a compiled step measured no faster than an eager one, so auto trains eagerly there, and on CUDA until it is measured). A method or model that does not compile falls back to eager at its first step, with one line. Printed at start; result.json "compile" records it."""
    trust_remote_code: bool = option(False, key_v1=True, report_row=False)
    """Allow a Hub model's own Python code to run (off by default: it is arbitrary code)."""
    allow_pickle: bool = option(False, key_v1=True, report_row=False)
    """Allow loading pickle (.bin) adapters, which can run arbitrary code."""
    instruction_fields: str = option("instruction,input,output", Text(), key_v1=True, section="files")
    """For --task json: the prompt, optional input and response field names of a JSON/JSONL file."""
    train_file: str | None = option(None, File(), key_v1=True, section="files")
    """For --task json (and mt-bench, instead of Alpaca): the training JSON/JSONL file. For --task classify/regress: the labelled training file: CSV, TSV (tab-separated, no quoting), JSON, JSONL or Parquet (datasets' csv/json/parquet builders); the digest of its bytes is recorded (data_digest), so the run key changes with its content."""
    eval_file: str | None = option(None, File(), key_v1=True, section="files")
    """For --task json: the evaluation JSON/JSONL file (default: a held-out 10% of --train-file). For --task classify/regress: the labelled evaluation file (same formats); default: a held-out 10% of the training data (stratified by class for classify), drawn with a fixed seed (0) that never moves with --seed, so every seed trains and is scored on the same split."""
    dataset: str | None = option(None, Text(), section="labelled")
    """For --task classify/regress, instead of --train-file: a folder written by datasets' save_to_disk (offline), else a Hugging Face Hub dataset NAME[:CONFIG] (online only). Its train split trains; --eval-split evaluates."""
    eval_split: str | None = option(None, Text(), section="labelled")
    """For --task classify/regress with --dataset: the split to evaluate on; default: validation when it has one, else a held-out 10% of train (as without --eval-file)."""
    text_fields: str | None = option(None, Text(), section="labelled")
    """For --task classify/regress: the one or two text columns, A[,B] (two are encoded as a sentence pair); default: text."""
    label_field: str = option("label", Text(), section="labelled")
    """For --task classify/regress: the label column. classify: strings or integers, mapped to class ids in sorted order (saved as the model's id2label); regress: numbers (one output, MSE)."""
    metric: str | None = option(None, Text(), section="labelled")
    """For --task classify/regress: the primary metric (best epoch, reports, the chance bar). classify: accuracy (default), f1 (binary: the second of the two sorted classes is positive), f1_macro, matthews; regress: pearson (default), spearman. All of them are computed and recorded."""
    data_digest: str | None = option(None, Text(r"[0-9a-f]{64}", "a sha256 digest (64 hex digits)"), section="labelled")
    """Set by peftlab for --task classify/regress: sha256 of the bytes of --train-file/--eval-file (or of the --dataset folder's files), so a run's key changes when its data does. A run's config.yaml keeps it; evaluating that run on data that changed since is refused."""
    eval_sets: str | None = option(None, Text(), section="generation")
    """For --task commonsense or math: the test sets to evaluate, comma-separated (default: all seven; commonsense: boolq piqa social_i_qa winogrande ARC-Easy ARC-Challenge openbookqa; math: gsm8k AQuA AddSub MultiArith SVAMP SingleEq mawps). --max-eval-samples applies to each set."""
    train_sets: str | None = option(None, Text(), section="generation")
    """For --task commonsense: the training splits, comma-separated (default: the union of all four available: boolq ARC-Easy ARC-Challenge openbookqa; the papers' 170k mix is not available offline)."""
    eval_before: bool = option(False, key_v1=True, section="eval")
    """Also evaluate the untrained model before fine-tuning (the papers' "before" row; always on for gsm8k)."""
    eval_every: int | None = option(None, Range(0), key_v1=True, section="eval")
    """Evaluate after every N epochs, and always after the last; 0: only after the last. Default 1; gsm8k: 0 (generation costs about an epoch)."""
    eval_steps: int = option(0, Range(0), section="eval")
    """Also evaluate on the dev set every N optimizer steps during training (learning curves: result.json "curve", <run>/curve.jsonl); 0: off. Each evaluation is a full pass over the dev set (on a generation task, a full generation run), so a run pays its optimizer steps / N extra dev passes. The best epoch (and --save best) is still chosen among the epoch-end evaluations only."""
    lm_eval: str | None = option(None, Text(), section="generation")
    """Decoder runs: after training, also score the saved weights with lm-evaluation-harness (pip install "peftlab[lm-eval]"), offline on the local data, on these tasks (comma-separated): gsm8k gsm8k_cot arc_easy arc_challenge openbookqa piqa social_iqa winogrande, or commonsense (the six multiple-choice sets; BoolQ's local copy has no passages). The harness's own prompts and metrics; multiple-choice sets by the log-likelihood of each choice. --max-eval-samples / --eval-seed draw the items (the same as the run's own evaluation), --eval-batch-size batches them. Results: result.json "lm_eval" (peftlab report --metric lm_eval/<task>/<metric>)."""
    max_new_tokens: int | None = option(None, Range(1), key_v1=True, section="generation")
    """Generation length limit; default 256 (gsm8k, math), 32 (commonsense, as LLM-Adapters), 64 (e2e). For GSM8K evaluation (and each MT-Bench answer; FastChat uses 1024)."""
    judge_url: str | None = option(None, Text(r"https?://\S+", "an http:// or https:// URL"), section="judge")
    """For --task mt-bench: the judge's OpenAI-compatible base URL (e.g. https://api.openai.com/v1, or http://127.0.0.1:8000/v1 for a local server). Without it the answers are generated and saved, not judged."""
    judge_model: str = option("gpt-4", Text(), section="judge")
    """For --task mt-bench: the judge model's name at --judge-url (FastChat's MT-Bench judge is gpt-4; anything but a strong API model is labelled a weak judge)."""
    judge_api_key_env: str = option("OPENAI_API_KEY", Text(r"[A-Za-z_][A-Za-z0-9_]*", "an environment variable's name"),
                                    report_row=False, section="judge")
    """For --task mt-bench: the environment variable holding the judge's API key (never the key itself: config.yaml is saved)."""
    judge_timeout: float = option(120.0, POSITIVE, resumable=True, report_row=False, section="judge")
    """For --task mt-bench: seconds per judge request; a request still unanswered is retried (--judge-retries), then recorded as unjudged, and the judge is given up on (the answers left are recorded unjudged; the preflight's one request before training waits at most 10 s)."""
    judge_retries: int = option(3, Range(0), resumable=True, report_row=False, section="judge")
    """For --task mt-bench: retries of a failed judge request (timeouts, connection errors, HTTP 429/5xx), with exponential back-off."""
    judge_parallel: int = option(4, Range(1), resumable=True, report_row=False, section="judge")
    """For --task mt-bench: judge requests in flight at once."""
    log_every: int = option(10, Range(1), key_v1=True, resumable=True, hashed_as=10, report_row=False)
    """Log training loss and learning rate every N steps (see --report-to)."""
    report_to: ReportTo = option("auto", resumable=True, report_row=False)
    """Experiment tracking through Accelerate's trackers: tensorboard (<run>/tb; the 'track' extra), wandb, mlflow (their package installed; online, their account) or none; auto: tensorboard when the 'track' extra is installed, else none."""

    def __post_init__(self):
        super().__post_init__()  # every field against its declaration, this class's too
        if self.packing and self.pad_to_max:
            raise PeftlabError("--packing and --pad-to-max ask for opposite batches (no padding, padding to T)",
                               fix="pass one of them")
        if self.judge_url and self.task != "mt-bench":
            raise PeftlabError(f"--judge-url is set, but task '{self.task}' has no judge (it would be ignored)",
                               fix="remove --judge-url, or use --task mt-bench")

    # peftlab.resolve marks the config it returns (resolved once per run). No field: outside to_dict(), the run
    # key and dataclasses.replace's copy (a changed copy is unresolved again); a pickled config keeps it.
    def mark_resolved(self) -> TrainConfig:
        self.__dict__["resolved_once"] = True
        return self

    @property
    def resolved(self) -> bool:
        return self.__dict__.get("resolved_once", False)


# Each consumer's list of options by role (run key, resume, tune, sweeps, reports, evaluate), derived once from
# the declarations above: lab/store, lab/records, lab/spec, lab/tune/spec, training/guards, training/evaluation.
ROLES = role_sets(TrainConfig)


# The config layer's public names: this module's, and those of config_cli (flags, YAML) and config_roles
# (declarations, roles) that callers reach through it, so that `from peftlab.config import ...` is its one path.
__all__ = [  # the schema; then config_cli's (flags, YAML); then config_roles' (declarations, roles)
    "TrainConfig", "MethodConfig", "OptimConfig", "OptionGroup", "KasaOptions", "CordaOptions", "VeraOptions",
    "FourierFTOptions", "MethodName", "TaskName", "Projection", "Pooling", "ReportTo", "REPORT_TO",
    "HEAD_ONLY", "SCHEDULERS", "SEED", "POSITIVE", "MAX_LAYERS", "ROLES",
    "parse_layers", "parse_targets", "add_dataclass_flags", "build_config", "coerce", "config_yaml", "field_docs",
    "field_types", "load_yaml", "normalise_keys", "save_config", "File", "Folder", "Range", "Text", "check_fields",
    "flat_dict", "from_flat", "option", "option_defaults", "option_names", "role_sets"]
