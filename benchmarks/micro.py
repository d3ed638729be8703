"""The micro benchmark: what each method costs on one model, sequence length and batch size.

    python benchmarks/micro.py --model roberta-base-random --seq-len 128 --batch-size 8

Every method in :data:`peftlab.methods.table.METHODS` (plus the plain ``base`` model, no adapter, head trained)
on every target set (:mod:`benchmarks.micro_rows`): adapter init time (``apply_method``: the SVD of
PiSSA/MiLoRA/KaSA, CorDA's calibration), the median train step (forward + the method's extra loss + backward +
AdamW over :func:`peftlab.methods.optim_groups.param_groups`), examples/s, peak memory (:mod:`benchmarks.memory`),
and inference latency unmerged and merged (:func:`peftlab.methods.saving.merged`), each measured round-robin
(:mod:`benchmarks.timing`). Ratios against LoRA (same targets) and against the base model are medians of
per-round paired ratios. Model FLOP utilisation: each configuration's train-step FLOPs (``FlopCounterMode`` on a
meta-device copy: :mod:`benchmarks.flops`) over its median step time, against the GEMM peak measured in the same
process at the same dtype and thread count (:mod:`benchmarks.peak`).

To keep many configurations resident at once, every configuration shares the frozen parameters that no method
touches (embeddings, MLPs, norms) with one base model; only the attention projections that some target set adapts
and the task head are copied per configuration. Timing: ``time.perf_counter`` on CPU; on CUDA ``torch.cuda.Event``
pairs around ``--inner`` steps, in bf16 autocast (``--precision auto``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repository root, not its own folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.cli import main, nonnegative_int, parser, positive_float, positive_int, progress
from benchmarks import flops
from benchmarks.machine import (
    autocast_for, environment, loadavg, method_list, precision_name, resolve_device, write_result)
from benchmarks.memory import cpu_tensor_peak_mb, cuda_step_peak_mb, memory_method, resident_mb, rss_step_delta_mb
from benchmarks.models import load_bench_model, make_batch, shared_frozen
from benchmarks.micro_rows import (BENCH_LR, KASA_PEFT_BASE, Row, build, infer_fn, merge, row_dict,
                                   train_step_fn)
from benchmarks.peak import gemm_peak
from benchmarks.render import KASA_PEFT, markdown_micro, slug
from benchmarks.timing import Clock, first_line, rotated, round_robin

DEFAULT_TARGETS = ("q,v", "q,k,v")


@dataclass
class Micro:
    """One run of the benchmark: its settings, the machine's clock and autocast, the batch, the rows, the result."""

    args: Any
    device: torch.device
    clock: Clock
    autocast: Callable
    say: Callable[[str], None]
    result: dict
    out_dir: Path
    name: str
    started: float = field(default_factory=time.monotonic)
    batch: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)

    @property
    def inputs(self) -> dict:
        return {k: v for k, v in self.batch.items() if k != "labels"}

    def save(self, *, partial: bool = True) -> None:
        _save(self.result, self.rows, self.out_dir, self.name, partial=partial)

    def deadline(self, share: float) -> float | None:
        """--max-seconds: when this phase, given ``share`` of what is left, must stop timing."""
        if not self.args.max_seconds:
            return None
        return time.monotonic() + share * (self.args.max_seconds - (time.monotonic() - self.started))

    def timed(self, fn_of: Callable, into: str, rounds: int, deadline: float | None) -> int:
        return round_robin(self.rows, fn_of, into, rounds, self.args.warmup, self.clock, self.args.inner, self.say,
                           deadline)


def chosen_methods(args) -> list[str]:
    from peftlab.methods.table import METHODS, MethodConfig

    methods = method_list(args.methods, METHODS, extra=(KASA_PEFT,))
    if args.compare_kasa_peft and KASA_PEFT not in methods:
        at = methods.index("kasa") + 1 if "kasa" in methods else len(methods)
        methods.insert(at, KASA_PEFT)
    for name in methods:  # validate rank etc. up front: one line, before minutes of model building
        MethodConfig(method=KASA_PEFT_BASE if name == KASA_PEFT else name, rank=args.rank, alpha=args.alpha)
    return methods


def start(args) -> Micro:
    from peftlab.methods.targets import parse_targets

    device = resolve_device(args.device)
    methods = chosen_methods(args)
    target_sets = [",".join(parse_targets(t)) for t in (args.targets or list(DEFAULT_TARGETS))]
    settings = {
        "model": args.model, "seq_len": args.seq_len, "batch_size": args.batch_size, "rank": args.rank,
        "alpha": args.alpha, "methods": methods, "targets": target_sets, "warmup": args.warmup,
        "repeats": args.repeats, "infer_repeats": args.infer_repeats or args.repeats, "inner": args.inner,
        "init_repeats": args.init_repeats, "precision": precision_name(device, args.precision),
        "seed": args.seed, "lr": BENCH_LR, "calibration_samples": args.calibration_samples,
    }
    result: dict[str, Any] = {
        "kind": "micro", "environment": environment(device), "settings": settings,
        "memory_method": memory_method(device), "flops_method": flops.METHOD,
        "timing_method": ("torch.cuda.Event around --inner steps, after torch.cuda.synchronize" if device.type == "cuda"
                          else "time.perf_counter around --inner steps"),
        "order": "round-robin: every repeat visits every configuration, starting one later each repeat",
        "rows": [],
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"micro-{slug(args.model)}-s{args.seq_len}-b{args.batch_size}-{device.type}"
    return Micro(args, device, Clock(device), autocast_for(device, args.precision), progress(args.quiet), result,
                 out_dir, name)


def build_rows(run: Micro) -> None:
    """Every configuration adapted from fresh copies of one base model, round-robin ``--init-repeats`` times
    (the last build is the one measured); then each row's trainable counts and AdamW."""
    from peftlab.methods.optim_groups import OptimConfig, adamw, count_trainable, param_groups
    from peftlab.methods.targets import head_module_names, resolve_targets

    args, settings = run.args, run.result["settings"]
    run.say(f"building {args.model} on {run.device}")
    base = load_bench_model(args.model, run.device, seed=args.seed)
    base.requires_grad_(False)
    heads = head_module_names(base)
    protected = {name for targets in settings["targets"] for name in resolve_targets(base, targets).all_modules}
    shared = shared_frozen(base, protected, heads)

    def fresh() -> torch.nn.Module:
        torch.manual_seed(args.seed)
        return copy.deepcopy(base, memo=dict(shared))

    run.batch = make_batch(base, args.batch_size, args.seq_len, run.device, seed=args.seed)
    run.rows = [Row("base", "")] + [Row(m, t) for t in settings["targets"] for m in settings["methods"]]
    for r in range(max(1, args.init_repeats)):
        for row in rotated(run.rows, r):
            if row.error is None:
                _trybuild(row, fresh, args, run.batch, run.clock, run.say)
        run.say(f"init: round {r + 1}/{max(1, args.init_repeats)}")
        run.save()  # a run killed later still has its init times
    for row in run.rows:
        if row.error is None:
            row.trainable = count_trainable(row.model, row.targets_resolved, row.heads)
            groups = param_groups(row.model, row.targets_resolved, row.heads, OptimConfig(lr=BENCH_LR), verbose=False)
            row.optimizer = adamw(groups)
            row.model.train()
    run.save()


def _trybuild(row: Row, fresh, args, batch, clock: Clock, say) -> None:
    row.model = None
    gc.collect()
    try:
        build(row, fresh, args, batch, clock)
    except Exception as err:  # e.g. a method this model or peft version cannot build: keep the others
        row.error = f"{type(err).__name__}: {first_line(err)}"
        row.model = None
        say(f"{row.label}: cannot build ({row.error})")


def measure_training(run: Micro) -> None:
    """Train steps round-robin (half of what --max-seconds leaves), each row's model FLOPs, the GEMM peak, memory."""
    args = run.args
    run.result["settings"]["rounds_timed"] = {"train": run.timed(
        lambda row: train_step_fn(row, run.batch, run.autocast), "train", args.repeats, run.deadline(0.5))}
    for row in run.rows:  # model FLOPs of a step on this batch (no padding: every token is real)
        if row.error is None:
            counted, row.flops_unavailable = flops.step_flops(row.model, args.batch_size, args.seq_len)
            row.flops = counted.to_dict() if counted else None
    run.say("GEMM peak probe")  # right after the train rounds: the same threads, dtype and machine state
    run.result["gemm_peak"] = gemm_peak(peak_dtype(run.device, args.precision), device=run.device,
                                        sizes=GPU_PEAK_SIZES if run.device.type == "cuda" else CPU_PEAK_SIZES)
    for row in run.rows:
        if row.error is None:
            row.memory = _step_memory(row, train_step_fn(row, run.batch, run.autocast), run.device)
            row.optimizer.zero_grad(set_to_none=True)
    for row in run.rows:
        row.optimizer = None  # AdamW state is not needed for inference
        if row.model is not None:
            row.model.eval()
    gc.collect()
    run.save()


def _step_memory(row: Row, step: Callable[[], None], device: torch.device) -> dict:
    memory = resident_mb(row.model, row.optimizer)
    if device.type == "cuda":
        memory["step_peak_mb"] = cuda_step_peak_mb(step, device)
    else:
        memory["rss_step_delta_mb"] = rss_step_delta_mb(step)
        memory["step_peak_mb"] = cpu_tensor_peak_mb(step)
    if memory["step_peak_mb"] is not None:
        memory["peak_mb"] = memory["weights_mb"] + memory["optimizer_state_mb"] + memory["step_peak_mb"]
    return memory


def measure_inference(run: Micro) -> None:
    """Inference round-robin unmerged, then each row merged (timed, checked) and again."""
    rounds = run.args.infer_repeats or run.args.repeats
    timed = run.result["settings"]["rounds_timed"]
    forward = lambda row: infer_fn(row.model, run.inputs, run.autocast)  # noqa: E731
    timed["infer"] = run.timed(forward, "infer", rounds, run.deadline(0.45))
    run.save()
    for row in run.rows:
        if row.error is not None:
            continue
        try:
            merge(row, run.inputs, run.clock)
        except Exception as err:
            row.error = f"merge: {type(err).__name__}: {first_line(err)}"
            run.say(f"{row.label}: {row.error}")
    timed["infer_merged"] = run.timed(forward, "infer_merged", rounds, run.deadline(0.9))


def run_micro(args) -> dict[str, Any]:
    run = start(args)
    build_rows(run)
    measure_training(run)
    measure_inference(run)
    run.result["environment"]["loadavg_end"] = loadavg()
    run.save(partial=False)
    for row in run.rows:
        row.model = None
    gc.collect()
    return run.result


CPU_PEAK_SIZES = (512, 1024, 2048)
GPU_PEAK_SIZES = (2048, 4096, 8192)  # a GPU's peak needs larger products


def peak_dtype(device: torch.device, precision: str) -> torch.dtype:
    """The dtype the train step's matrix products run in: bf16 under bf16 autocast, else fp32."""
    return torch.bfloat16 if precision_name(device, precision).startswith("bf16") else torch.float32


def _save(result: dict, rows: list[Row], out_dir: Path, name: str, *, partial: bool) -> None:
    result["partial"] = partial
    result["rows"] = [row_dict(row, rows, result["settings"]["batch_size"], result.get("gemm_peak"))
                      for row in rows]
    write_result(result, out_dir, name, markdown_micro)


def rerender(result: dict) -> str:
    return markdown_micro(result)


def make_parser() -> argparse.ArgumentParser:
    made = parser(__doc__, __file__)
    made.add_argument("--model", default="roberta-base-random", help="registered model or path")
    made.add_argument("--methods", default=None,
                      help="comma list of methods (default: every method in peftlab.methods.table.METHODS)")
    made.add_argument("--targets", action="append", default=None,
                      help="a target set such as q,v; repeat the flag for several (default: q,v and q,k,v)")
    made.add_argument("--rank", type=positive_int, default=8, help="adapter rank")
    made.add_argument("--alpha", type=positive_float, default=16.0, help="LoRA alpha")
    made.add_argument("--seq-len", type=positive_int, default=128, help="tokens per example")
    made.add_argument("--batch-size", type=positive_int, default=8, help="examples per step")
    made.add_argument("--warmup", type=nonnegative_int, default=2, help="untimed warm-up rounds")
    made.add_argument("--repeats", type=positive_int, default=7, help="timed rounds per configuration")
    made.add_argument("--infer-repeats", type=positive_int, default=None, help="timed inference rounds (default: --repeats)")
    made.add_argument("--inner", type=positive_int, default=1, help="back-to-back steps per timed sample (raise on GPU)")
    made.add_argument("--init-repeats", type=positive_int, default=3, help="adapter inits per configuration, round-robin")
    made.add_argument("--calibration-samples", type=positive_int, default=8,
                      help="CorDA calibration forwards during init (from the benchmark batch)")
    made.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda[:i]")
    made.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                      help="auto: bf16 autocast on CUDA, fp32 on CPU")
    made.add_argument("--compare-kasa-peft", action="store_true",
                      help="add a kasa-peft row: KaSA with peft's per-module regulariser (before peftlab batched it)")
    made.add_argument("--max-seconds", type=positive_float, default=None,
                      help="time budget: once spent, each timing phase stops after 3 timed rounds")
    made.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the random model, inputs and adapter init")
    return made


def cli_main(argv: list[str] | None = None) -> int:
    return main(make_parser(), run_micro, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
