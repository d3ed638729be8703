"""The micro benchmark's configurations: one :class:`Row` per method and target set (and the plain ``base``
model), built by ``apply_method`` on a fresh copy of the base model, the calls it times (a train step, a forward),
its merge, and its line of the result (summaries and per-round paired ratios against LoRA and the base model)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from benchmarks.peak import utilisation
from benchmarks.render import KASA_PEFT
from benchmarks.timing import Clock, paired_ratio, summarize

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
    flops: dict | None = None  # benchmarks.flops.StepFlops of one train step, as a dict
    flops_unavailable: str | None = None  # why the step's FLOPs could not be counted

    @property
    def label(self) -> str:
        return "base" if self.method == "base" else f"{self.method}[{self.targets}]"


def merge(row: "Row", inputs: dict, clock: "Clock") -> None:
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


def build(row: Row, fresh: Callable[[], torch.nn.Module], args, batch, clock: Clock) -> None:
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


def train_step_fn(row: Row, batch: dict, autocast) -> Callable[[], None]:
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


def infer_fn(model, inputs: dict, autocast) -> Callable[[], None]:
    def forward() -> None:
        with torch.no_grad(), autocast():
            model(**inputs)

    return forward


def row_dict(row: Row, rows: list[Row], batch_size: int, peak: dict | None = None) -> dict[str, Any]:
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
