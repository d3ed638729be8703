"""``peftlab bench``: what each method costs, and what peftlab's data path saves.

Two benchmarks, each writing ``<name>.json`` and ``<name>.md`` into ``--out-dir``:

* **micro** (default): for one model, sequence length and batch size, every method in
  :data:`peftlab.methods.table.METHODS` (plus the plain ``base`` model, no adapter, head trained) on every target
  set: adapter init time (``apply_method``: the SVD of PiSSA/MiLoRA/KaSA, CorDA's calibration), the median
  train step (forward + ``extra_loss`` + backward + AdamW over :func:`peftlab.methods.optim_groups.param_groups`), examples/s,
  peak memory, and inference latency unmerged and merged (:func:`peftlab.methods.saving.merged`). All
  configurations are built once and then measured **round-robin** (repeat r visits every configuration, in
  an order rotated by r), so slow drift of a shared machine hits all of them alike; ratios against LoRA
  (same targets) and against the base model are medians of per-round *paired* ratios.
* **e2e** (``--e2e``): ``peftlab.training.loop.train`` run twice per task and seed, with peftlab's default data
  path (dynamic padding, length-grouped batches, cached tokenisation) and with the papers' setup
  (``--pad-to-max``, T = ``--seq-len`` = 128): train seconds per epoch and the final dev metric of each.

Timing: ``time.perf_counter`` on CPU; on CUDA ``torch.cuda.Event`` pairs around ``--inner`` steps, in bf16
autocast (``--precision auto``). Memory: the configuration's standalone resident size (every parameter and
buffer, counted as if the model were loaded alone, plus AdamW state) plus the transient peak of one train
step above what was allocated before it. The transient peak is ``torch.cuda.max_memory_allocated`` on
CUDA; on CPU it is the peak of the torch CPU allocator's live bytes, read from ``torch.profiler``'s memory
events (``profile_memory=True``; no tracemalloc, which does not see torch's allocations), with the step's
RSS high-water-mark delta (``/proc/self/clear_refs`` + ``VmHWM``, after ``malloc_trim``) reported beside it.

To keep many configurations resident at once, every configuration shares the frozen parameters that no
method touches (embeddings, MLPs, norms) with one base model; only the attention projections that some
target set adapts and the task head are copied per configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from peftlab.errors import USER_ERROR_EXIT, PeftlabError

DEFAULT_TARGETS = ("q,v", "q,k,v")
# --compare-kasa-peft adds this row: KaSA trained with peft's per-module regulariser (the path peftlab used
# before kasa.regulariser was batched), so the optimisation is measured in the same interleaved run.
KASA_PEFT, KASA_PEFT_BASE = "kasa-peft", "kasa"
BENCH_LR = 1e-4  # one small learning rate for every method: step time does not depend on it, and it keeps
# many steps on a fixed random batch from diverging (NaN/denormal arithmetic would distort timings)


# --------------------------------------------------------------------------- statistics


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples: list[float]) -> dict[str, Any]:
    """Median, quartiles, IQR and MAD (median absolute deviation) of ``samples``, which are kept."""
    values = sorted(float(x) for x in samples if x is not None and math.isfinite(x))
    if not values:
        return {"n": 0, "median": None, "q25": None, "q75": None, "iqr": None, "mad": None, "min": None,
                "samples": []}
    median = statistics.median(values)
    return {
        "n": len(values),
        "median": median,
        "q25": _quantile(values, 0.25),
        "q75": _quantile(values, 0.75),
        "iqr": _quantile(values, 0.75) - _quantile(values, 0.25),
        "mad": statistics.median(abs(v - median) for v in values),
        "min": values[0],
        "samples": [float(x) for x in samples],
    }


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict[str, Any] | None:
    """Per-round ratios ``numerator[r] / denominator[r]`` (measured in the same round), summarised."""
    if not numerator or not denominator or len(numerator) != len(denominator):
        return None
    ratios = [a / b for a, b in zip(numerator, denominator) if b and a is not None]
    out = summarize(ratios)
    return {k: out[k] for k in ("n", "median", "q25", "q75", "iqr", "mad")}


# --------------------------------------------------------------------------- environment


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict[str, Any]:
    import peft
    import transformers

    import peftlab

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "peftlab": peftlab.__version__,
        "device": str(device),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "niceness": os.nice(0) if hasattr(os, "nice") else None,
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return env


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PeftlabError("--device cuda asked for, but torch sees no CUDA device",
                           fix="run on a machine with a CUDA GPU, or use --device cpu")
    return device


def autocast_for(device: torch.device, precision: str):
    """bf16 autocast on CUDA (``auto``/``bf16``); fp32 otherwise. Returns a context-manager factory."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


# --------------------------------------------------------------------------- timing and memory


class Clock:
    """Seconds per call of ``fn`` over ``inner`` back-to-back calls: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any], inner: int = 1) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0 / inner
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - start) / inner


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_step_delta_mb(fn: Callable[[], Any]) -> float | None:
    """Peak RSS during ``fn`` minus RSS before it (Linux: reset VmHWM via /proc/self/clear_refs)."""
    gc.collect()
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return None
    before = _proc_status_kib("VmRSS")
    fn()
    peak = _proc_status_kib("VmHWM")
    if before is None or peak is None:
        return None
    return max(0.0, (peak - before) / 1024)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (kineto prints profiler_start/stop lines from C++)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cpu_tensor_peak_mb(fn: Callable[[], Any]) -> float | None:
    """Peak of the torch CPU allocator's live bytes during ``fn`` above the level before it.

    Read from ``torch.profiler``'s memory events (each allocation and free, in time order). None when this
    torch's profiler does not expose them.
    """
    from torch.profiler import ProfilerActivity, profile

    try:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        live = peak = 0
        for event in events:
            live += event.nbytes()
            peak = max(peak, live)
        return peak / 2**20
    except Exception:  # a private API: degrade to "not measured" rather than fail the benchmark
        return None


def cuda_step_peak_mb(fn: Callable[[], Any], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def resident_mb(model: torch.nn.Module, optimizer=None) -> dict[str, float]:
    """Standalone size: every distinct parameter and buffer (as if this model were loaded alone) + AdamW state."""
    seen: set[int] = set()
    weights = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        weights += tensor.numel() * tensor.element_size()
    state = 0
    if optimizer is not None:
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if torch.is_tensor(value):
                    state += value.numel() * value.element_size()
    return {"weights_mb": weights / 2**20, "optimizer_state_mb": state / 2**20}


# --------------------------------------------------------------------------- models and inputs


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


# --------------------------------------------------------------------------- one configuration


@dataclass
class Row:
    method: str  # a METHODS name, or "base" (no adapter: the frozen model with its head trained)
    targets: str  # "q,v"; "" for base
    model: Any = None
    optimizer: Any = None
    targets_resolved: Any = None
    heads: list = field(default_factory=list)
    error: str | None = None
    note: str | None = None
    extra_loss: Callable | None = None  # overrides peftlab.methods.table.extra_loss (the kasa-peft row)
    init: list = field(default_factory=list)
    calibration: list = field(default_factory=list)
    train: list = field(default_factory=list)
    infer: list = field(default_factory=list)
    infer_merged: list = field(default_factory=list)
    merge_seconds: float | None = None
    merge_max_abs_diff: float | None = None
    memory: dict = field(default_factory=dict)
    trainable: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return "base" if self.method == "base" else f"{self.method}[{self.targets}]"


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def _merge(row: "Row", inputs: dict, clock: "Clock") -> None:
    """:func:`peftlab.methods.saving.merged` (timed); records how far the merged model's logits are from the unmerged
    ones (fp32, eval mode, the benchmark batch)."""
    from peftlab.methods.saving import merged

    with torch.no_grad():
        before = row.model(**inputs).logits.float()
    clock.sync()
    start = time.perf_counter()
    with torch.no_grad():
        model = merged(row.model)
    clock.sync()
    row.merge_seconds = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        after = model(**inputs).logits.float()
    row.merge_max_abs_diff = float((before - after).abs().max())
    row.model = model


def _rotated(items: list, r: int) -> list:
    if not items:
        return items
    r %= len(items)
    return items[r:] + items[:r]


def _calibration(model, batch: dict, samples: int):
    """CorDA: one-example forwards over the first ``samples`` rows of the benchmark batch."""
    from peftlab.methods.corda import calibration_from_examples

    count = min(samples, batch["input_ids"].shape[0])

    def examples():
        for i in range(count):
            yield {k: v[i:i + 1] for k, v in batch.items() if k != "labels"}

    return calibration_from_examples(model, examples)


def _build(row: Row, fresh: Callable[[], torch.nn.Module], args, batch, clock: Clock) -> None:
    """Adapt a fresh copy of the base model as ``row`` says; record init (and calibration) seconds."""
    from peftlab.methods.table import METHODS, MethodConfig, apply_method
    from peftlab.methods.targets import head_module_names, resolve_targets

    model = fresh()
    if row.method == "base":
        heads = head_module_names(model)
        model.requires_grad_(False)
        for name in heads:
            model.get_submodule(name).requires_grad_(True)
        row.model, row.heads = model, heads
        row.targets_resolved = resolve_targets(model, "q")  # groups only; nothing in q is trainable
        return
    extra = {}
    if row.method == "fourierft":  # its default 1000 coefficients exceed a tiny model's matrices
        modules = dict(model.named_modules())
        smallest = min(modules[n].weight.numel() for n in resolve_targets(model, row.targets).all_modules)
        default = MethodConfig.fourierft_n_frequency
        if smallest < default:
            extra["fourierft_n_frequency"] = smallest
            row.note = f"n_frequency {smallest} (default {default} exceeds in*out)"
    real = KASA_PEFT_BASE if row.method == KASA_PEFT else row.method
    cfg = MethodConfig(method=real, targets=row.targets, rank=args.rank, alpha=args.alpha, **extra)
    method = METHODS[real]
    kwargs = {}
    if getattr(method, "needs_calibration", False):
        kwargs["calibration"] = _calibration(model, batch, args.calibration_samples)
    clock.sync()
    start = time.perf_counter()
    model, targets, heads = apply_method(model, cfg, train_head=True, task_type="SEQ_CLS", **kwargs)
    clock.sync()
    row.init.append(time.perf_counter() - start)
    calibration = getattr(model, "peftlab_calibration_seconds", None)
    if calibration is not None:
        row.calibration.append(calibration)
    row.model, row.targets_resolved, row.heads = model, targets, heads
    if row.method == KASA_PEFT:
        row.extra_loss = peft_kasa_regulariser


def peft_kasa_regulariser(model, cfg=None) -> torch.Tensor:
    """KaSA's regulariser as peftlab computed it before the batched :func:`peftlab.methods.kasa.regulariser`: peft's
    per-module ``LoraModel._get_kasa_loss`` plus a second walk over all modules to count them (``mean``)."""
    from peftlab.methods.kasa import kasa_modules

    return model.base_model._get_kasa_loss() / max(1, len(kasa_modules(model)))


def _train_step_fn(row: Row, batch: dict, autocast) -> Callable[[], None]:
    from peftlab.methods.table import extra_loss

    model, optimizer = row.model, row.optimizer
    aux_loss = row.extra_loss or extra_loss

    def step() -> None:
        with autocast():  # like Accelerate: autocast wraps the forward only; the extra loss runs outside it
            loss = model(**batch).loss
        aux = aux_loss(model)
        total = loss if aux is None else loss + aux
        total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _infer_fn(model, inputs: dict, autocast) -> Callable[[], None]:
    def forward() -> None:
        with torch.no_grad(), autocast():
            model(**inputs)

    return forward


MIN_ROUNDS_UNDER_DEADLINE = 3


def _round_robin(rows: list[Row], fn_of: Callable[[Row], Callable], into: str, rounds: int, warmup: int,
                 clock: Clock, inner: int, progress: Callable[[str], None], deadline: float | None = None) -> int:
    """Time every live row once per round, rows in an order rotated by the round; returns timed rounds.

    Past ``deadline`` (``time.monotonic()``), stops after at least MIN_ROUNDS_UNDER_DEADLINE timed rounds:
    every row of a round is measured together, so paired ratios stay valid with fewer rounds.
    """
    live = [row for row in rows if row.error is None]
    fns = {id(row): fn_of(row) for row in live}
    timed = 0
    for r in range(warmup + rounds):
        if deadline is not None and timed >= MIN_ROUNDS_UNDER_DEADLINE and time.monotonic() > deadline:
            progress(f"{into}: time budget spent, stopping after {timed} timed rounds")
            break
        for row in _rotated(live, r):
            try:
                seconds = clock(fns[id(row)], inner)
            except Exception as err:  # keep measuring the others; the row says what failed
                row.error = f"{into}: {type(err).__name__}: {_first_line(err)}"
                progress(f"{row.label}: {row.error}")
                continue
            if r >= warmup:
                getattr(row, into).append(seconds)
        live = [row for row in live if row.error is None]
        timed += r >= warmup
        progress(f"{into}: round {r + 1}/{warmup + rounds}" + (" (warm-up)" if r < warmup else ""))
    return timed


# --------------------------------------------------------------------------- micro benchmark


def run_micro(args) -> dict[str, Any]:
    from peftlab.methods.table import METHODS, MethodConfig
    from peftlab.methods.optim_groups import OptimConfig, adamw, count_trainable, param_groups
    from peftlab.methods.targets import head_module_names, parse_targets, resolve_targets

    started = time.monotonic()
    device = resolve_device(args.device)
    autocast = autocast_for(device, args.precision)
    clock = Clock(device)
    say = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)) if not args.quiet else (lambda msg: None)
    methods = _method_list(args.methods, METHODS, extra=(KASA_PEFT,))
    if args.compare_kasa_peft and KASA_PEFT not in methods:
        at = methods.index("kasa") + 1 if "kasa" in methods else len(methods)
        methods.insert(at, KASA_PEFT)
    target_sets = [",".join(parse_targets(t)) for t in (args.targets or list(DEFAULT_TARGETS))]
    seq_len = args.seq_len or 128
    batch_size = args.batch_size or 8
    for name in methods:  # validate rank etc. up front: one line, before minutes of model building
        MethodConfig(method=KASA_PEFT_BASE if name == KASA_PEFT else name, rank=args.rank, alpha=args.alpha)

    result: dict[str, Any] = {
        "kind": "micro",
        "environment": environment(device),
        "settings": {
            "model": args.model, "seq_len": seq_len, "batch_size": batch_size, "rank": args.rank,
            "alpha": args.alpha, "methods": methods, "targets": target_sets, "warmup": args.warmup,
            "repeats": args.repeats, "infer_repeats": args.infer_repeats or args.repeats, "inner": args.inner,
            "init_repeats": args.init_repeats, "precision": _precision_name(device, args.precision),
            "seed": args.seed, "lr": BENCH_LR, "calibration_samples": args.calibration_samples,
        },
        "memory_method": _memory_method(device),
        "timing_method": ("torch.cuda.Event around --inner steps, after torch.cuda.synchronize" if device.type == "cuda"
                          else "time.perf_counter around --inner steps"),
        "order": "round-robin: every repeat visits every configuration, starting one later each repeat",
        "rows": [],
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"micro-{_slug(args.model)}-s{seq_len}-b{batch_size}-{device.type}"

    say(f"building {args.model} on {device}")
    base = load_bench_model(args.model, device, seed=args.seed)
    base.requires_grad_(False)
    heads = head_module_names(base)
    protected: set[str] = set()
    for targets in target_sets:
        protected |= set(resolve_targets(base, targets).all_modules)
    shared = shared_frozen(base, protected, heads)

    def fresh() -> torch.nn.Module:
        torch.manual_seed(args.seed)
        return copy.deepcopy(base, memo=dict(shared))

    batch = make_batch(base, batch_size, seq_len, device, seed=args.seed)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    rows = [Row("base", "")] + [Row(m, t) for t in target_sets for m in methods]

    # ---- adapter init (round-robin over fresh copies; the last build is the one measured below) --------
    for r in range(max(1, args.init_repeats)):
        for row in _rotated(rows, r):
            if row.error is not None:
                continue
            row.model = None
            gc.collect()
            try:
                _build(row, fresh, args, batch, clock)
            except Exception as err:  # e.g. a method this model or peft version cannot build: keep the others
                row.error = f"{type(err).__name__}: {_first_line(err)}"
                row.model = None
                say(f"{row.label}: cannot build ({row.error})")
        say(f"init: round {r + 1}/{max(1, args.init_repeats)}")
        _save(result, rows, out_dir, name, partial=True)  # a run killed later still has its init times
    del base
    gc.collect()

    for row in rows:
        if row.error is not None:
            continue
        row.trainable = count_trainable(row.model, row.targets_resolved, row.heads)
        groups = param_groups(row.model, row.targets_resolved, row.heads, OptimConfig(lr=BENCH_LR), verbose=False)
        row.optimizer = adamw(groups)
        row.model.train()
    _save(result, rows, out_dir, name, partial=True)

    # ---- train steps ------------------------------------------------------------------------------------
    # --max-seconds: the train phase may use its share of what is left, the two inference phases the rest
    remaining = (lambda: args.max_seconds - (time.monotonic() - started)) if args.max_seconds else None
    deadline = time.monotonic() + 0.5 * remaining() if remaining else None
    rounds = result["settings"]["rounds_timed"] = {}
    rounds["train"] = _round_robin(rows, lambda row: _train_step_fn(row, batch, autocast), "train", args.repeats,
                                   args.warmup, clock, args.inner, say, deadline)
    for row in rows:
        if row.error is not None:
            continue
        step = _train_step_fn(row, batch, autocast)
        memory = resident_mb(row.model, row.optimizer)
        if device.type == "cuda":
            memory["step_peak_mb"] = cuda_step_peak_mb(step, device)
        else:
            memory["rss_step_delta_mb"] = rss_step_delta_mb(step)
            memory["step_peak_mb"] = cpu_tensor_peak_mb(step)
        if memory["step_peak_mb"] is not None:
            memory["peak_mb"] = memory["weights_mb"] + memory["optimizer_state_mb"] + memory["step_peak_mb"]
        row.memory = memory
        row.optimizer.zero_grad(set_to_none=True)
    for row in rows:
        row.optimizer = None  # AdamW state is not needed for inference
        if row.model is not None:
            row.model.eval()
    gc.collect()
    _save(result, rows, out_dir, name, partial=True)

    # ---- inference: unmerged, then merged -----------------------------------------------------------------
    infer_rounds = args.infer_repeats or args.repeats
    deadline = time.monotonic() + 0.45 * remaining() if remaining else None
    rounds["infer"] = _round_robin(rows, lambda row: _infer_fn(row.model, inputs, autocast), "infer", infer_rounds,
                                   args.warmup, clock, args.inner, say, deadline)
    _save(result, rows, out_dir, name, partial=True)
    for row in rows:
        if row.error is not None:
            continue
        try:
            _merge(row, inputs, clock)
        except Exception as err:
            row.error = f"merge: {type(err).__name__}: {_first_line(err)}"
            say(f"{row.label}: {row.error}")
    deadline = time.monotonic() + 0.9 * remaining() if remaining else None
    rounds["infer_merged"] = _round_robin(rows, lambda row: _infer_fn(row.model, inputs, autocast), "infer_merged",
                                          infer_rounds, args.warmup, clock, args.inner, say, deadline)
    result["environment"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    _save(result, rows, out_dir, name, partial=False)
    for row in rows:
        row.model = None
    gc.collect()
    return result


def _method_list(text: str | None, methods: dict, extra: tuple[str, ...] = ()) -> list[str]:
    from peftlab.errors import unknown

    if not text:
        return list(methods)
    names = [m.strip().lower() for m in text.split(",") if m.strip()]
    for name in names:
        if name not in methods and name not in extra:
            raise unknown("method", name, list(methods) + list(extra), where="--methods")
    return names


def _precision_name(device: torch.device, precision: str) -> str:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return "bf16 autocast (fp32 weights)"
    return "fp32"


def _memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return ("peak_mb = standalone weights + AdamW state + transient step peak "
                "(torch.cuda.max_memory_allocated during one train step minus memory_allocated before it)")
    return ("peak_mb = standalone weights + AdamW state + transient step peak (peak live bytes of the torch "
            "CPU allocator during one train step, from torch.profiler memory events; no tracemalloc); "
            "rss_step_delta_mb = VmHWM - VmRSS around one step after malloc_trim (process RSS, includes "
            "allocator slack)")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _row_dict(row: Row, rows: list[Row], batch_size: int) -> dict[str, Any]:
    lora = next((r for r in rows if r.method == "lora" and r.targets == row.targets and r.error is None), None)
    base = next((r for r in rows if r.method == "base" and r.error is None), None)
    train = summarize(row.train)
    out = {
        "label": row.label,
        "method": row.method,
        "targets": row.targets,
        "error": row.error,
        "note": row.note,
        "trainable_params": row.trainable or None,
        "init_s": summarize(row.init) if row.init else None,
        "calibration_s": summarize(row.calibration) if row.calibration else None,
        "train_step_s": train,
        "examples_per_s": batch_size / train["median"] if train["median"] else None,
        "infer_unmerged_s": summarize(row.infer),
        "infer_merged_s": summarize(row.infer_merged),
        "merge_s": row.merge_seconds,
        "merge_max_abs_logit_diff": row.merge_max_abs_diff,
        "memory": row.memory or None,
        "ratios": {
            "train_vs_lora": paired_ratio(row.train, lora.train) if lora else None,
            "train_vs_base": paired_ratio(row.train, base.train) if base else None,
            "infer_unmerged_vs_base": paired_ratio(row.infer, base.infer) if base else None,
            "infer_merged_vs_base": paired_ratio(row.infer_merged, base.infer_merged) if base else None,
            "infer_unmerged_vs_lora": paired_ratio(row.infer, lora.infer) if lora else None,
            "peak_memory_vs_lora": _plain_ratio((row.memory or {}).get("peak_mb"),
                                                (lora.memory or {}).get("peak_mb") if lora else None),
            "peak_memory_vs_base": _plain_ratio((row.memory or {}).get("peak_mb"),
                                                (base.memory or {}).get("peak_mb") if base else None),
        },
    }
    return out


def _plain_ratio(a, b):
    return a / b if a is not None and b else None


def _save(result: dict, rows: list[Row], out_dir: Path, name: str, *, partial: bool) -> None:
    result["partial"] = partial
    result["rows"] = [_row_dict(row, rows, result["settings"]["batch_size"]) for row in rows]
    _write(out_dir / f"{name}.json", json.dumps(result, indent=2))
    _write(out_dir / f"{name}.md", markdown_micro(result))
    result["files"] = {"json": str(out_dir / f"{name}.json"), "markdown": str(out_dir / f"{name}.md")}


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- markdown


def _ms(summary: dict | None) -> str:
    if not summary or summary.get("median") is None:
        return "-"
    return f"{summary['median'] * 1e3:.1f} ± {summary['iqr'] * 1e3:.1f}"


def _s(summary: dict | None) -> str:
    if not summary or summary.get("median") is None:
        return "-"
    value = summary["median"]
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _x(ratio: dict | None) -> str:
    if not ratio or ratio.get("median") is None:
        return "-"
    return f"{ratio['median']:.3f} [{ratio['q25']:.3f}, {ratio['q75']:.3f}]"


def _mb(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _rounds_text(settings: dict) -> str:
    timed = settings.get("rounds_timed") or {}
    if timed and len(set(timed.values())) == 1:
        return f"{next(iter(timed.values()))} timed rounds"
    if timed:
        return "timed rounds " + ", ".join(f"{k} {v}" for k, v in timed.items())
    return f"{settings['repeats']} timed rounds"


def markdown_micro(result: dict) -> str:
    s, env = result["settings"], result["environment"]
    lines = [
        f"## {s['model']}: seq {s['seq_len']}, batch {s['batch_size']}, rank {s['rank']}, {s['precision']}, "
        f"{env['device']}" + (" (partial)" if result.get("partial") else ""),
        "",
        f"{env.get('gpu') or env['cpu_model']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"peft {env['peft']}; {env['torch_threads']} threads; load average at start "
        f"{', '.join(f'{x:.1f}' for x in env['loadavg_start'] or [])}"
        + (f", at end {', '.join(f'{x:.1f}' for x in env['loadavg_end'])}" if env.get("loadavg_end") else "") + ".",
        f"{_rounds_text(s)} after {s['warmup']} warm-up rounds ({s['inner']} step(s) per sample), "
        f"round-robin over configurations; times are median ± IQR, ratios are medians of per-round paired "
        f"ratios [q25, q75].",
        "",
        "| config | trainable | init s | train step ms | ex/s | × LoRA | × base | peak MB | infer ms | "
        "infer × base | merged ms | merged × base |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        if row["error"]:
            lines.append(f"| {row['label']} | error: {row['error'][:80]} |" + " - |" * 11)
            continue
        ratios = row["ratios"]
        trainable = (row["trainable_params"] or {}).get("total")
        eps = row["examples_per_s"]
        lines.append(
            f"| {row['label']} | {'-' if trainable is None else f'{trainable:,}'} | {_s(row['init_s'])} | {_ms(row['train_step_s'])} | "
            f"{'-' if eps is None else f'{eps:.1f}'} | {_x(ratios['train_vs_lora'])} | {_x(ratios['train_vs_base'])} | "
            f"{_mb((row['memory'] or {}).get('peak_mb'))} | {_ms(row['infer_unmerged_s'])} | "
            f"{_x(ratios['infer_unmerged_vs_base'])} | {_ms(row['infer_merged_s'])} | "
            f"{_x(ratios['infer_merged_vs_base'])} |")
    lines += ["", f"Memory: {result['memory_method']}."]
    by_note: dict[str, list[str]] = {}
    for row in result["rows"]:
        for note in filter(None, (row.get("note") or "").split("; ")):
            by_note.setdefault(note, []).append(row["label"])
    notes = [f"{', '.join(labels)}: {note}" for note, labels in by_note.items()]
    if any(row["method"] == KASA_PEFT for row in result["rows"]):
        notes.append(f"{KASA_PEFT}: KaSA trained with peft's per-module `_get_kasa_loss` (+ a module walk), the "
                     "regulariser peftlab used before `peftlab.methods.kasa.regulariser` was batched")
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- end to end


SETUPS = (("dynamic", False), ("pad_to_max", True))


def _padding_stats(cfg) -> dict[str, Any] | None:
    """Token slots one epoch computes under each setup (from the cached tokenisation; no model run)."""
    try:
        from peftlab.tasks import data_files as data
        from peftlab.models.registry import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
        raw = data.subset(data.load_split(cfg.task, "train", cfg.data_dir), cfg.max_train_samples, cfg.seed)
        tokenised = data.tokenize(raw, tokenizer, cfg.max_length, task=cfg.task, cache_key=f"{cfg.model}-train")
        lengths = [int(x) for x in tokenised["length"]]
        batches = data.length_grouped_batches(lengths, cfg.batch_size, cfg.seed, 0)
        dynamic = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        padded = len(lengths) * cfg.max_length
        return {"examples": len(lengths), "real_tokens": sum(lengths), "mean_length": sum(lengths) / len(lengths),
                "dynamic_token_slots": dynamic, "pad_to_max_token_slots": padded,
                "slot_ratio": padded / dynamic if dynamic else None}
    except Exception as err:  # informative only
        return {"error": f"{type(err).__name__}: {err}"}


def run_e2e(args) -> dict[str, Any]:
    from peftlab.config import TrainConfig, build_config
    from peftlab.methods.table import METHODS
    from peftlab.tasks.table import TASKS
    from peftlab.training.loop import train

    say = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)) if not args.quiet else (lambda msg: None)
    tasks = [t.strip().lower() for t in (args.task or "cola").split(",") if t.strip()]
    for task in tasks:
        if task not in TASKS or TASKS[task].kind == "instruction":
            from peftlab.errors import unknown

            raise unknown("GLUE task", task, [n for n, t in TASKS.items() if t.kind != "instruction"], where="--task")
    methods = _method_list(args.methods or "lora", METHODS)
    targets = (args.targets or ["q,v"])[0]
    seeds = [int(s) for s in str(args.seeds).split(",") if s.strip()]
    model = args.model or "minilm-l6"
    seq_len = args.seq_len or 128
    batch_size = args.batch_size or 32
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"e2e-{_slug(model)}"
    device = resolve_device(args.device)
    result: dict[str, Any] = {
        "kind": "e2e",
        "environment": environment(device),
        "settings": {"model": model, "tasks": tasks, "methods": methods, "targets": targets, "rank": args.rank,
                     "seeds": seeds, "epochs": args.epochs, "batch_size": batch_size, "max_length": seq_len,
                     "max_train_samples": args.max_train_samples, "max_eval_samples": args.max_eval_samples,
                     "lr": args.lr},
        "setups": {"dynamic": "peftlab default: dynamic padding, length-grouped batches, cached tokenisation",
                   "pad_to_max": f"the papers' setup: every batch padded to T={seq_len} (--pad-to-max)"},
        "runs": [],
        "summary": [],
    }
    for task in tasks:
        for method in methods:
            for i, seed in enumerate(seeds):
                # alternate which setup goes first, so machine drift does not always favour one of them
                order = SETUPS if i % 2 == 0 else tuple(reversed(SETUPS))
                for setup, pad in order:
                    overrides = dict(task=task, model=model, method=method, targets=targets, rank=args.rank,
                                     epochs=args.epochs, batch_size=batch_size, max_length=seq_len, pad_to_max=pad,
                                     seed=seed, max_train_samples=args.max_train_samples,
                                     max_eval_samples=args.max_eval_samples, overwrite=True,
                                     output_dir=str(out_dir / "e2e-runs" / f"{task}-{method}-{setup}-seed{seed}"),
                                     data_dir=args.data_dir, log_every=10**6,
                                     mixed_precision="auto" if device.type == "cuda" else "no")
                    if args.lr is not None:
                        overrides["lr"] = args.lr
                    cfg = build_config(TrainConfig, overrides=overrides)
                    say(f"e2e {task} {method} seed {seed}: {setup}")
                    start, cpu_start = time.perf_counter(), time.process_time()
                    res = train(cfg)
                    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                    epochs_log = res.get("epochs_log") or []
                    metric = res["primary_metric"]
                    result["runs"].append({
                        "task": task, "method": method, "seed": seed, "setup": setup, "pad_to_max": pad,
                        "status": res["status"], "primary_metric": metric,
                        "final_metric": res["final"]["metrics"].get(metric),
                        "final_metrics": res["final"]["metrics"],
                        "train_seconds": res["train_seconds"],
                        "train_seconds_per_epoch": res["train_seconds"] / max(1, len(epochs_log)),
                        "wall_seconds": wall,
                        "wall_seconds_per_epoch": wall / max(1, len(epochs_log)),
                        # CPU time of this process: hardly moved by other jobs on a shared machine
                        "cpu_seconds": cpu,
                        "cpu_seconds_per_epoch": cpu / max(1, len(epochs_log)),
                        "train_examples": res["train_examples"],
                        "train_examples_per_second": res["train_examples_per_second"],
                        "output_dir": cfg.output_dir,
                    })
                    if setup == "dynamic" and i == 0:
                        result.setdefault("padding", {})[task] = _padding_stats(cfg)
                    _save_e2e(result, out_dir, name)
            result["summary"].append(_e2e_summary(result["runs"], task, method))
            _save_e2e(result, out_dir, name)
    result["environment"]["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    _save_e2e(result, out_dir, name)
    return result


def _e2e_summary(runs: list[dict], task: str, method: str) -> dict[str, Any]:
    def pick(setup, key):
        return [r[key] for r in runs if r["task"] == task and r["method"] == method and r["setup"] == setup
                and r.get(key) is not None]

    out: dict[str, Any] = {"task": task, "method": method}
    for setup, _ in SETUPS:
        per_epoch, metric, wall = pick(setup, "train_seconds_per_epoch"), pick(setup, "final_metric"), pick(
            setup, "wall_seconds_per_epoch")
        out[setup] = {
            "train_seconds_per_epoch": statistics.median(per_epoch) if per_epoch else None,
            "wall_seconds_per_epoch": statistics.median(wall) if wall else None,
            "metric_mean": statistics.mean(metric) if metric else None,
            "metric_std": statistics.stdev(metric) if len(metric) > 1 else None,
            "metrics": metric,
        }
    dyn, pad = out["dynamic"], out["pad_to_max"]
    # per-seed paired speed-ups (the two runs of a seed ran back to back)
    mine = [r for r in runs if r["task"] == task and r["method"] == method]
    by_seed = {seed: {r["setup"]: r for r in mine if r["seed"] == seed} for seed in sorted({r["seed"] for r in mine})}
    for name, key in (("train", "train_seconds_per_epoch"), ("cpu", "cpu_seconds")):
        paired = [by["pad_to_max"][key] / by["dynamic"][key] for by in by_seed.values()
                  if by.get("dynamic", {}).get(key) and by.get("pad_to_max", {}).get(key) is not None]
        out[f"speedup_{name}"] = statistics.median(paired) if paired else None
        out[f"speedup_{name}_per_seed"] = paired
    if dyn["wall_seconds_per_epoch"] and pad["wall_seconds_per_epoch"]:
        out["speedup_wall"] = pad["wall_seconds_per_epoch"] / dyn["wall_seconds_per_epoch"]
    if dyn["metric_mean"] is not None and pad["metric_mean"] is not None:
        out["metric_difference"] = dyn["metric_mean"] - pad["metric_mean"]
    return out


def _save_e2e(result: dict, out_dir: Path, name: str) -> None:
    _write(out_dir / f"{name}.json", json.dumps(result, indent=2))
    _write(out_dir / f"{name}.md", markdown_e2e(result))
    result["files"] = {"json": str(out_dir / f"{name}.json"), "markdown": str(out_dir / f"{name}.md")}


def _num(value, fmt=".3f") -> str:
    return "-" if value is None else format(value, fmt)


def _per_seed(values) -> str:
    return f"[{', '.join(f'{v:.2f}' for v in values)}] " if values and len(values) > 1 else ""


def markdown_e2e(result: dict) -> str:
    s = result["settings"]
    subset = f"{s['max_train_samples']} training examples" if s["max_train_samples"] else "the full training set"
    evals = f"{s['max_eval_samples']} dev examples" if s["max_eval_samples"] else "the full dev set"
    lines = [
        f"## End to end: {s['model']}, {', '.join(s['methods'])} on {s['targets']} (rank {s['rank']}), "
        f"{s['epochs']} epoch(s), batch {s['batch_size']}, seeds {', '.join(map(str, s['seeds']))}",
        "",
        f"{subset}, {evals}. dynamic = {result['setups']['dynamic']}; pad_to_max = {result['setups']['pad_to_max']}. "
        "Train s/epoch: the optimizer steps (forward, extra loss, backward, clipping, AdamW) as `peftlab train` "
        "times them; wall s/epoch: the whole `train()` call (model load, tokenisation or its cache, batching, "
        "dev evaluation each epoch, checkpoints) divided by the epochs. Speed-up = pad_to_max / dynamic train "
        "s/epoch (median over seeds of the runs of one seed, which ran back to back); per seed in brackets; CPU "
        "speed-up: the same for the process CPU time of the whole run, which other jobs on a shared machine "
        "hardly move. Metrics: mean ± sd over seeds.",
        "",
        f"| task | method | metric | dynamic train s/epoch | pad-{s['max_length']} train s/epoch | speed-up | "
        f"dynamic wall s/epoch | pad-{s['max_length']} wall s/epoch | wall speed-up | CPU speed-up | dynamic metric | "
        f"pad-{s['max_length']} metric | token slots pad/dyn |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    metric_names = {r["task"]: r["primary_metric"] for r in result["runs"]}
    for row in result["summary"]:
        dyn, pad = row["dynamic"], row["pad_to_max"]
        padding = (result.get("padding") or {}).get(row["task"]) or {}

        def metric(d):
            if d["metric_mean"] is None:
                return "-"
            return f"{d['metric_mean']:.4f}" + (f" ± {d['metric_std']:.4f}" if d["metric_std"] is not None else "")

        lines.append(
            f"| {row['task']} | {row['method']} | {metric_names.get(row['task'], '')} | "
            f"{_num(dyn['train_seconds_per_epoch'], '.1f')} | {_num(pad['train_seconds_per_epoch'], '.1f')} | "
            f"{_num(row.get('speedup_train'), '.2f')}× {_per_seed(row.get('speedup_train_per_seed'))}| "
            f"{_num(dyn['wall_seconds_per_epoch'], '.1f')} | "
            f"{_num(pad['wall_seconds_per_epoch'], '.1f')} | {_num(row.get('speedup_wall'), '.2f')}× | "
            f"{_num(row.get('speedup_cpu'), '.2f')}{'×' if row.get('speedup_cpu') else ''} | "
            f"{metric(dyn)} | {metric(pad)} | "
            f"{_num(padding.get('slot_ratio'), '.2f')} |")
    lines += ["", "Runs:", "",
              "| task | method | seed | setup | status | train s | wall s | CPU s | metric |",
              "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['task']} | {r['method']} | {r['seed']} | {r['setup']} | {r['status']} | "
                     f"{_num(r['train_seconds'], '.1f')} | {_num(r['wall_seconds'], '.1f')} | "
                     f"{_num(r.get('cpu_seconds'), '.1f')} | {_num(r['final_metric'], '.4f')} |")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got '{text}'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="registered model or path (default: roberta-base-random; with --e2e: minilm-l6)")
    parser.add_argument("--methods", default=None,
                        help="comma list of methods (default: every method in peftlab.methods.table.METHODS; "
                             "with --e2e: lora)")
    parser.add_argument("--targets", action="append", default=None,
                        help="a target set such as q,v; repeat the flag for several (default: q,v and q,k,v; "
                             "with --e2e only the first is used, default q,v)")
    parser.add_argument("--rank", type=_positive_int, default=8, help="adapter rank (default 8)")
    parser.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (default 16)")
    parser.add_argument("--seq-len", type=_positive_int, default=None,
                        help="tokens per example (default 128; with --e2e the max length T, default 128)")
    parser.add_argument("--batch-size", type=_positive_int, default=None,
                        help="examples per step (default 8; with --e2e 32)")
    parser.add_argument("--warmup", type=_nonnegative_int, default=2, help="untimed warm-up rounds (default 2)")
    parser.add_argument("--repeats", type=_positive_int, default=7, help="timed rounds per configuration (default 7)")
    parser.add_argument("--infer-repeats", type=_positive_int, default=None,
                        help="timed inference rounds (default: --repeats)")
    parser.add_argument("--inner", type=_positive_int, default=1,
                        help="back-to-back steps per timed sample (default 1; raise on GPU)")
    parser.add_argument("--init-repeats", type=_positive_int, default=3,
                        help="adapter inits per configuration, round-robin (default 3)")
    parser.add_argument("--calibration-samples", type=_positive_int, default=8,
                        help="CorDA calibration forwards during init (default 8, from the benchmark batch)")
    parser.add_argument("--threads", type=_positive_int, default=None,
                        help="torch CPU threads (default: torch's); 1 is far steadier on a shared machine")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda[:i]")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                        help="auto: bf16 autocast on CUDA, fp32 on CPU")
    parser.add_argument("--compare-kasa-peft", action="store_true",
                        help="add a kasa-peft row: KaSA with peft's per-module regulariser (before peftlab batched it)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="time budget: once spent, each timing phase stops after 3 timed rounds (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random model, inputs and adapter init")
    parser.add_argument("--out-dir", default="bench_out", help="where the JSON and Markdown go (default bench_out)")
    parser.add_argument("--name", default=None, help="file name stem (default: derived from the settings)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--render", metavar="JSON", default=None,
                        help="only re-render the Markdown beside a bench JSON (no benchmark is run)")
    e2e = parser.add_argument_group("end to end (--e2e)")
    e2e.add_argument("--e2e", action="store_true",
                     help="train on a real task twice: dynamic padding vs --pad-to-max (the papers' setup)")
    e2e.add_argument("--task", default=None, help="GLUE task(s), comma list (default cola)")
    e2e.add_argument("--epochs", type=_positive_int, default=1, help="epochs per run (default 1)")
    e2e.add_argument("--seeds", default="0", help="comma list of seeds; each runs both setups (default 0)")
    e2e.add_argument("--max-train-samples", type=_positive_int, default=None,
                     help="train on a seeded subset of this many examples (CPU sizing)")
    e2e.add_argument("--max-eval-samples", type=_positive_int, default=None, help="evaluate on a seeded subset")
    e2e.add_argument("--lr", type=float, default=None, help="learning rate (default: the method's)")
    e2e.add_argument("--data-dir", default=None, help="GLUE data root (default as in peftlab train)")


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="benchmark every method's cost, and the data path end to end",
                            description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.set_defaults(func=run_cli)


def render(path: str | Path) -> str:
    """Re-render the Markdown of a bench JSON (``--render``); an e2e summary is recomputed from its runs."""
    path = Path(path)
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise PeftlabError(f"cannot read bench results {path}: {err}", fix="pass a .json written by peftlab bench") from None
    if result.get("kind") == "e2e":
        for run in result["runs"]:
            if run.get("wall_seconds_per_epoch") is None and run.get("wall_seconds") is not None:
                run["wall_seconds_per_epoch"] = run["wall_seconds"] / max(1, result["settings"]["epochs"])
        pairs = dict.fromkeys((r["task"], r["method"]) for r in result["runs"])
        result["summary"] = [_e2e_summary(result["runs"], task, method) for task, method in pairs]
        text = markdown_e2e(result)
    elif result.get("kind") == "micro":
        text = markdown_micro(result)
    else:
        raise PeftlabError(f"{path} is not a peftlab bench result", fix="pass a .json written by peftlab bench")
    _write(path.with_suffix(".md"), text)
    return text


def run_cli(args) -> int:
    import warnings

    if args.render:
        print(render(args.render))
        return 0

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # peft -> transformers, every build
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.e2e:
            result = run_e2e(args)
        else:
            args.model = args.model or "roberta-base-random"
            result = run_micro(args)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting
    print(Path(result["files"]["markdown"]).read_text())
    print(f"wrote {result['files']['json']} and {result['files']['markdown']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m peftlab.bench.suite ...``: the same as ``peftlab bench`` without importing every subcommand."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(prog="peftlab bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_cli(args)
    except PeftlabError as err:
        print(f"peftlab: error: {err}", file=sys.stderr)
        return USER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
