"""The micro benchmark: what each method costs on one model, sequence length and batch size.

Every method in :data:`peftlab.methods.table.METHODS` (plus the plain ``base`` model, no adapter, head trained)
on every target set: adapter init time (``apply_method``: the SVD of PiSSA/MiLoRA/KaSA, CorDA's calibration),
the median train step (forward + the method's extra loss + backward + AdamW over
:func:`peftlab.methods.optim_groups.param_groups`), examples/s, peak memory (:mod:`peftlab.bench.memory`), and
inference latency unmerged and merged (:func:`peftlab.methods.saving.merged`), each measured round-robin
(:mod:`peftlab.bench.timing`). Ratios against LoRA (same targets) and against the base model are medians of
per-round paired ratios. Model FLOP utilisation: each configuration's train-step FLOPs counted from its architecture
(:mod:`peftlab.bench.flops`) over its median step time, against the GEMM peak measured in the same process at the
same dtype and thread count (:mod:`peftlab.bench.peak`).
"""

from __future__ import annotations

import copy
import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from peftlab.bench.machine import (
    autocast_for, environment, loadavg, method_list, precision_name, resolve_device, write_result)
from peftlab.bench.flops import step_flops
from peftlab.bench.memory import cpu_tensor_peak_mb, cuda_step_peak_mb, memory_method, resident_mb, rss_step_delta_mb
from peftlab.bench.models import load_bench_model, make_batch, shared_frozen
from peftlab.bench.peak import gemm_peak, utilisation
from peftlab.bench.render import KASA_PEFT, markdown_micro, slug
from peftlab.bench.timing import Clock, first_line, paired_ratio, rotated, round_robin, summarize

DEFAULT_TARGETS = ("q,v", "q,k,v")
# --compare-kasa-peft adds the KASA_PEFT row: KaSA trained with peft's per-module regulariser (the path peftlab
# used before kasa.regulariser was batched), so the optimisation is measured in the same interleaved run.
KASA_PEFT_BASE = "kasa"
BENCH_LR = 1e-4  # one small learning rate for every method: step time does not depend on it, and it keeps
# many steps on a fixed random batch from diverging (NaN/denormal arithmetic would distort timings)


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
    extra_loss: Callable | None = None  # model -> the method's extra loss (AppliedMethod.extra_loss; kasa-peft: peft's)
    init: list = field(default_factory=list)
    calibration: list = field(default_factory=list)
    train: list = field(default_factory=list)
    infer: list = field(default_factory=list)
    infer_merged: list = field(default_factory=list)
    merge_seconds: float | None = None
    merge_max_abs_diff: float | None = None
    memory: dict = field(default_factory=dict)
    trainable: dict = field(default_factory=dict)
    flops: dict | None = None  # peftlab.bench.flops.StepFlops of one train step, as a dict
    flops_unavailable: str | None = None  # why the architecture's FLOPs are not counted

    @property
    def label(self) -> str:
        return "base" if self.method == "base" else f"{self.method}[{self.targets}]"


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
    from peftlab.config import FourierFTOptions
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
        default = FourierFTOptions.n_frequency
        if smallest < default:
            extra["fourierft"] = FourierFTOptions(n_frequency=smallest)
            row.note = f"n_frequency {smallest} (default {default} exceeds in*out)"
    real = KASA_PEFT_BASE if row.method == KASA_PEFT else row.method
    cfg = MethodConfig(method=real, targets=row.targets, rank=args.rank, alpha=args.alpha, **extra)
    method = METHODS[real]
    kwargs = {}
    if getattr(method, "needs_calibration", False):
        kwargs["calibration"] = _calibration(model, batch, args.calibration_samples)
    clock.sync()
    start = time.perf_counter()
    applied = apply_method(model, cfg, train_head=True, task_type="SEQ_CLS", **kwargs)
    clock.sync()
    row.init.append(time.perf_counter() - start)
    calibration = applied.init_stats.calibration_seconds
    if calibration is not None:
        row.calibration.append(calibration)
    row.model, row.targets_resolved, row.heads = applied.model, applied.targets, applied.heads
    row.extra_loss = peft_kasa_regulariser if row.method == KASA_PEFT else applied.extra_loss


def peft_kasa_regulariser(model, cfg=None) -> torch.Tensor:
    """KaSA's regulariser as peftlab computed it before the batched :func:`peftlab.methods.kasa.regulariser`: peft's
    per-module ``LoraModel._get_kasa_loss`` plus a second walk over all modules to count them (``mean``)."""
    from peftlab.methods.kasa import kasa_modules

    return model.base_model._get_kasa_loss() / max(1, len(kasa_modules(model)))


def _train_step_fn(row: Row, batch: dict, autocast) -> Callable[[], None]:
    model, optimizer = row.model, row.optimizer
    aux_loss = row.extra_loss or (lambda model: None)  # the base row: no method, no extra loss

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


def run_micro(args) -> dict[str, Any]:
    from peftlab.methods.table import METHODS, MethodConfig
    from peftlab.methods.optim_groups import OptimConfig, adamw, count_trainable, param_groups
    from peftlab.methods.targets import head_module_names, parse_targets, resolve_targets

    started = time.monotonic()
    device = resolve_device(args.device)
    autocast = autocast_for(device, args.precision)
    clock = Clock(device)
    say = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)) if not args.quiet else (lambda msg: None)
    methods = method_list(args.methods, METHODS, extra=(KASA_PEFT,))
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
            "init_repeats": args.init_repeats, "precision": precision_name(device, args.precision),
            "seed": args.seed, "lr": BENCH_LR, "calibration_samples": args.calibration_samples,
        },
        "memory_method": memory_method(device),
        "timing_method": ("torch.cuda.Event around --inner steps, after torch.cuda.synchronize" if device.type == "cuda"
                          else "time.perf_counter around --inner steps"),
        "order": "round-robin: every repeat visits every configuration, starting one later each repeat",
        "rows": [],
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"micro-{slug(args.model)}-s{seq_len}-b{batch_size}-{device.type}"

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
        for row in rotated(rows, r):
            if row.error is not None:
                continue
            row.model = None
            gc.collect()
            try:
                _build(row, fresh, args, batch, clock)
            except Exception as err:  # e.g. a method this model or peft version cannot build: keep the others
                row.error = f"{type(err).__name__}: {first_line(err)}"
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
    rounds["train"] = round_robin(rows, lambda row: _train_step_fn(row, batch, autocast), "train", args.repeats,
                                   args.warmup, clock, args.inner, say, deadline)
    for row in rows:  # model FLOPs of a step on this batch (no padding: every token is real)
        if row.error is None:
            counted, row.flops_unavailable = step_flops(row.model, [seq_len] * batch_size)
            row.flops = counted.to_dict() if counted else None
            if counted and counted.notes:  # e.g. DoRA's weight norm: the table's notes say what is left out
                row.note = "; ".join(filter(None, [row.note, *(f"model FLOPs: {n}" for n in counted.notes)]))
    say("GEMM peak probe")  # right after the train rounds: the same threads, dtype and machine state
    result["gemm_peak"] = gemm_peak(peak_dtype(device, args.precision), device=device,
                                    sizes=GPU_PEAK_SIZES if device.type == "cuda" else CPU_PEAK_SIZES)
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
    rounds["infer"] = round_robin(rows, lambda row: _infer_fn(row.model, inputs, autocast), "infer", infer_rounds,
                                   args.warmup, clock, args.inner, say, deadline)
    _save(result, rows, out_dir, name, partial=True)
    for row in rows:
        if row.error is not None:
            continue
        try:
            _merge(row, inputs, clock)
        except Exception as err:
            row.error = f"merge: {type(err).__name__}: {first_line(err)}"
            say(f"{row.label}: {row.error}")
    deadline = time.monotonic() + 0.9 * remaining() if remaining else None
    rounds["infer_merged"] = round_robin(rows, lambda row: _infer_fn(row.model, inputs, autocast), "infer_merged",
                                          infer_rounds, args.warmup, clock, args.inner, say, deadline)
    result["environment"]["loadavg_end"] = loadavg()
    _save(result, rows, out_dir, name, partial=False)
    for row in rows:
        row.model = None
    gc.collect()
    return result


CPU_PEAK_SIZES = (512, 1024, 2048)
GPU_PEAK_SIZES = (2048, 4096, 8192)  # a GPU's peak needs larger products


def peak_dtype(device: torch.device, precision: str) -> torch.dtype:
    """The dtype the train step's matrix products run in: bf16 under bf16 autocast, else fp32."""
    return torch.bfloat16 if precision_name(device, precision).startswith("bf16") else torch.float32


def _row_dict(row: Row, rows: list[Row], batch_size: int, peak: dict | None = None) -> dict[str, Any]:
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
        "model_flops": row.flops,
        "model_flops_unavailable": row.flops_unavailable,
        "utilisation": utilisation((row.flops or {}).get("total"), train["median"], peak),
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
    result["rows"] = [_row_dict(row, rows, result["settings"]["batch_size"], result.get("gemm_peak"))
                      for row in rows]
    write_result(result, out_dir, name, markdown_micro)
