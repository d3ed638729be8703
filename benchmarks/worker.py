"""What both comparisons' workers share: one run per process (``python -m benchmarks.<worker> SPEC.json OUT.json``),
the Trainer side's collator counter, epoch clock and ``Trainer`` (a linear warm-up/decay schedule over the given
AdamW), and the record every run ends with (process seconds, CPU seconds, threads, allowed cores, peak RSS)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PadCounter:
    """Wraps a collator and counts the token slots and pad slots of the batches it builds (a mask sum), and keeps
    each batch's (rows, padded length)."""

    def __init__(self, inner):
        self.inner, self.slots, self.pads, self.batches, self.shapes = inner, 0, 0, 0, []

    def __call__(self, features):
        batch = self.inner(features)
        mask = batch["attention_mask"]
        self.slots += mask.numel()
        self.pads += int((mask == 0).sum())
        self.batches += 1
        self.shapes.append(tuple(int(n) for n in mask.shape))
        return batch


def epoch_clock():
    """A Trainer callback timing the epoch loops only (``seconds``) and keeping the logged losses: the Trainer
    side's own timer, as result.json's ``timings.train_s`` is peftlab's."""
    from transformers import TrainerCallback

    class EpochClock(TrainerCallback):
        def __init__(self):
            self.seconds, self.start, self.losses = 0.0, None, []

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_epoch_end(self, args, state, control, **kwargs):
            self.seconds += time.perf_counter() - self.start

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return EpochClock()


def make_trainer(spec: dict[str, Any], model, optimizer, train_ds, collator, *, sampling: str = "random",
                 arguments: dict | None = None, **trainer_kwargs):
    """``transformers.Trainer`` as the papers' scripts set it up: ``optimizer`` under a linear warm-up/decay
    schedule, the spec's batch size, epochs, clipping, seed and precision on the CPU, no evaluation or saving
    while training, losses logged every ``logging_steps``. Returns (trainer, its :func:`epoch_clock`)."""
    from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

    steps = math.ceil(len(train_ds) / spec["batch_size"]) * spec["epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(spec["warmup_ratio"] * steps), max(1, steps))
    clock = epoch_clock()
    args = TrainingArguments(
        output_dir=spec["run_dir"], per_device_train_batch_size=spec["batch_size"], num_train_epochs=spec["epochs"],
        max_grad_norm=spec["max_grad_norm"], seed=spec["seed"], use_cpu=True, bf16=spec["mixed_precision"] == "bf16",
        train_sampling_strategy=sampling, eval_strategy="no", save_strategy="no", report_to="none",
        disable_tqdm=True, logging_strategy="steps", logging_steps=spec["logging_steps"], dataloader_num_workers=0,
        **(arguments or {}))
    trainer = Trainer(model=model, args=args, train_dataset=train_ds, data_collator=collator,
                      optimizers=(optimizer, scheduler), callbacks=[clock], **trainer_kwargs)
    return trainer, clock


def measured(run: Callable[[dict], dict], spec: dict[str, Any]) -> dict[str, Any]:
    """``run(spec)`` with one torch thread, and the record every run ends with."""
    import torch

    torch.set_num_threads(1)
    start, cpu_start = time.perf_counter(), time.process_time()
    out = run(spec)
    out.setdefault("status", "ok")
    out["examples_per_s"] = out["examples"] / out["train_s"] if out["train_s"] else None
    out["in_process_s"] = time.perf_counter() - start
    out["cpu_s"] = time.process_time() - cpu_start
    out["peak_rss_mb"] = peak_rss_mb()
    out["torch_threads"] = torch.get_num_threads()
    out["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return out


def worker_main(run_spec: Callable[[dict], dict], worker: str, argv: list[str] | None = None) -> int:
    """``python -m benchmarks.<worker> SPEC.json OUT.json``: the spec's run, its record written to OUT.json."""
    from peftlab.io_utils import atomic_write_text

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(f"usage: python -m benchmarks.{worker} SPEC.json OUT.json", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_spec(json.loads(Path(argv[0]).read_text()))
    atomic_write_text(argv[1], json.dumps(result, indent=2))
    return 0
