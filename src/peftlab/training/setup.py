"""setup: everything a run needs before its first step (model, method, data, optimizer, run folder).

Bad input found here (a data file, a rank) is raised before the run folder is created, so nothing
half-made is left behind; on ``--resume`` the checkpoint is restored on top of the rebuilt run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from peftlab.config import SCHEDULERS, TrainConfig, save_config
from peftlab.errors import PeftlabError
from peftlab.training import run_folder as runfiles
from peftlab.training.devices import make_accelerator, resolve_precision
from peftlab.training.guards import capped_max_length
from peftlab.training.schedule import LengthGroupedBatchSampler, optimizer_step_count

if TYPE_CHECKING:
    from peftlab.methods.table import AppliedMethod


@dataclass
class Run:
    """Everything :func:`fit` and :func:`finish` need, built by :func:`setup`."""

    cfg: TrainConfig
    accelerator: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_loader: object
    sampler: LengthGroupedBatchSampler
    pipeline: object
    groups: list
    params: dict
    init_seconds: float
    out: Path
    state: dict = field(default_factory=dict)
    tracking: bool = False  # --report-to: Accelerate's trackers are initialised
    best_weights: dict | None = None  # --save best: trainable tensors of the best epoch so far (CPU copies)
    applied: AppliedMethod | None = None  # what apply_method built: targets, heads, init stats (for saving)
    pooling: str | None = None  # --pooling as the model loader resolved it

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def enable_gradient_checkpointing(model) -> None:
    """transformers' activation checkpointing on the (peft-wrapped) model; non-reentrant, so frozen inputs
    need no requires_grad trick and dropout's random stream is replayed exactly."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise PeftlabError(f"{type(base).__name__} does not support --gradient-checkpointing",
                           fix="drop --gradient-checkpointing for this model")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def setup(cfg: TrainConfig, mode: str) -> Run:
    """Model, method, data and optimizer; restores the checkpoint when resuming."""
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    from peftlab.methods.corda import calibration_runner
    from peftlab.methods.optim_groups import adamw, count_trainable, param_groups
    from peftlab.methods.table import apply_method
    from peftlab.models.registry import load_model_with_pooling
    from peftlab.tasks.prepare import build_pipeline
    from peftlab.tasks.table import TASKS

    out = Path(cfg.output_dir)
    # Per-phase wall times for result.json's `timings` (peftlab bench --sweep-overhead sums them over a sweep).
    setup_start, started_unix = time.perf_counter(), time.time()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    set_seed(cfg.seed)
    task = TASKS[cfg.task]
    load_start = time.perf_counter()
    loaded = load_model_with_pooling(cfg.model, head=task.head, num_labels=task.num_labels, seed=cfg.seed,
                                     trust_remote_code=cfg.trust_remote_code, pooling=cfg.pooling)
    model, tokenizer = loaded.model, loaded.tokenizer
    model_load_s = time.perf_counter() - load_start
    data_cfg = capped_max_length(cfg, model)  # the pipeline tokenises at most the model's positions
    # After the model: --mixed-precision auto depends on its size on a CPU.
    precision, why = resolve_precision(cfg.mixed_precision, sum(p.numel() for p in model.parameters()))
    accelerator = make_accelerator(precision, cfg.grad_accum, cfg.report_to, str(out))
    if accelerator.is_main_process:
        print(f"mixed precision: {precision} ({why})")
    if accelerator.is_main_process and task.head != "causal-lm":
        print(f"pooling: {loaded.pooling} (--pooling {cfg.pooling})")
    data_start = time.perf_counter()
    pipeline = build_pipeline(data_cfg, tokenizer, model)  # data files, subsets, tokenisation (or its cache)
    data_s = time.perf_counter() - data_start
    task_type = "CAUSAL_LM" if task.head == "causal-lm" else "SEQ_CLS"
    init_start = time.perf_counter()
    # CorDA's calibration: --corda-samples training inputs, one per forward (other methods never call it)
    applied = apply_method(model, cfg, train_head=task.head != "causal-lm", task_type=task_type,
                           calibration=calibration_runner(model, pipeline.train_dataset, pipeline.collate,
                                                          cfg.corda.samples))
    init_seconds = time.perf_counter() - init_start
    model, targets, heads = applied.model, applied.targets, applied.heads
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    groups = param_groups(model, targets, heads, cfg, verbose=accelerator.is_main_process)
    optimizer = adamw(groups)
    params = count_trainable(model, targets, heads)

    sampler = LengthGroupedBatchSampler(pipeline.train_dataset["length"], cfg.batch_size, cfg.seed,
                                        grouped=not cfg.pad_to_max)
    # A private generator: creating a DataLoader iterator draws a seed from it. From the global RNG, that
    # draw would shift dropout's random stream whenever an epoch's iterator is re-created (e.g. on resume).
    train_loader = torch.utils.data.DataLoader(pipeline.train_dataset.remove_columns(["length"]),
                                               batch_sampler=sampler, collate_fn=pipeline.collate,
                                               generator=torch.Generator().manual_seed(cfg.seed))
    total_steps = optimizer_step_count(cfg, len(sampler))
    scheduler = get_scheduler(SCHEDULERS[cfg.scheduler], optimizer,
                              num_warmup_steps=int(cfg.warmup_ratio * total_steps), num_training_steps=max(1, total_steps))
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)

    run = Run(cfg, accelerator, model, optimizer, scheduler, train_loader, sampler, pipeline, groups, params,
              init_seconds, out, applied=applied, pooling=loaded.pooling)
    run.state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "epochs_log": [], "best": None,
                 "before": None, "status": "ok", "status_reason": None, "train_seconds": 0.0,
                 "train_examples": 0, "clearly_above_chance": False, "epoch_loss_sum": 0.0,
                 "epoch_loss_count": 0, "eval_extras": {},
                 # KaSA's singular-value vectors before any step: the figure shows what training changed.
                 "kasa_sigma_init": applied.init_stats.kasa_sigma}
    if run.main:
        runfiles.init_output_dir(out, mode)
        save_config(cfg, out / "config.yaml")
    accelerator.wait_for_everyone()
    if mode == "resume":
        run.state = runfiles.load_checkpoint(out, accelerator.unwrap_model(model), optimizer, scheduler)
        run.best_weights = runfiles.load_best_weights(out)
        runfiles.set_rng_state(run.state.pop("rng"))
        if run.main:
            print(f"resuming at epoch {run.state['epoch'] + 1}, step {run.state['step_in_epoch']}")
    if cfg.report_to != "none":  # only now: the run folder exists (TensorBoard writes into <run>/tb)
        hparams = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("tb" if cfg.report_to == "tensorboard" else out.name, config=hparams)
        run.tracking = True
    # Accumulated over resumed attempts (a checkpoint carries the state, timings included).
    timings = run.state.setdefault("timings", {})
    for key, seconds in (("model_load_s", model_load_s), ("data_s", data_s), ("init_s", init_seconds),
                         ("setup_s", time.perf_counter() - setup_start)):
        timings[key] = timings.get(key, 0.0) + seconds
    timings.setdefault("started_unix", started_unix)
    return run
