"""setup: everything a run needs before its first step (model, method, data, optimizer, run folder). Bad input found
here is raised before the run folder is created; on ``--resume`` the checkpoint is restored on the rebuilt run."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from peftlab.config import SCHEDULERS, TrainConfig, save_config
from peftlab.errors import PeftlabError
from peftlab.extras import tracker
from peftlab.training import run_folder as runfiles
from peftlab.training.checkpoint import load_checkpoint, save_only_trainable
from peftlab.training.compile import CompiledTraining, compile_for_training
from peftlab.training.devices import make_accelerator, resolve_precision
from peftlab.training.guards import capped_max_length
from peftlab.training.schedule import LengthGroupedBatchSampler, optimizer_step_count
from peftlab.training.state import LoopState

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
    state: LoopState = field(default_factory=LoopState)  # everything the loop knows (checkpointed)
    tracking: bool = False  # --report-to: Accelerate's trackers are initialised
    best_weights: dict | None = None  # --save best: trainable tensors of the best epoch so far (CPU copies)
    applied: AppliedMethod | None = None  # what apply_method built: targets, heads, init stats (for saving)
    pooling: str | None = None  # --pooling as the model loader resolved it
    compiled: CompiledTraining | None = None  # --compile: the train step's compiled view of the model

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
    """Model, method, data and optimizer; restores the checkpoint when resuming. ``cfg`` is the run's resolved
    config (:func:`peftlab.resolve.resolve_config`, once, at the run's entry)."""
    if not cfg.resolved:  # a bug, not input: setup never fills in defaults of its own
        raise TypeError("setup: the config is not resolved (resolve it once at the run's entry: "
                        "peftlab.resolve.resolve_config)")
    # Per-phase wall times for result.json's `timings` (benchmarks/sweep_overhead.py sums them over a sweep).
    setup_start, started_unix = time.perf_counter(), time.time()
    built, run = build_seeded(cfg)
    # KaSA's singular-value vectors before any step: the figure shows what training changed.
    run.state = LoopState(kasa_sigma_init=built.applied.init_stats.kasa_sigma)
    open_run_folder(run, mode)
    # Accumulated over resumed attempts (a checkpoint carries the loop state, timings included).
    for key, seconds in (*built.seconds.items(), ("setup_s", time.perf_counter() - setup_start)):
        run.state.add_time(key, seconds)
    run.state.timings.setdefault("started_unix", started_unix)
    return run


def build_seeded(cfg: TrainConfig) -> tuple[Built, Run]:
    """--threads and --seed set, then :func:`build` and :func:`prepare_training` (``peftlab train`` and probe)."""
    from accelerate.utils import set_seed

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    set_seed(cfg.seed)
    built = build(cfg, Path(cfg.output_dir))
    return built, prepare_training(cfg, built)


@dataclass(frozen=True)
class Built:
    """The model side of a run before Accelerate prepares it (what :func:`build` made)."""

    accelerator: object
    pipeline: object  # tasks.prepare.Pipeline: data, collate, evaluate
    applied: AppliedMethod  # the model with its method applied; targets, heads, init stats
    pooling: str  # --pooling as the model loader resolved it
    seconds: dict  # model_load_s, data_s, init_s


def build(cfg: TrainConfig, out: Path) -> Built:
    """The model, the Accelerator (its precision depends on the model), the task's data and the method."""
    from peftlab.methods.corda import calibration_runner
    from peftlab.methods.table import apply_method
    from peftlab.models.registry import load_model_with_pooling
    from peftlab.tasks.labelled_data import head_labels
    from peftlab.tasks.prepare import build_pipeline
    from peftlab.tasks.table import task as registered_task

    task = registered_task(cfg.task)  # resolved here once; the pipeline carries it on (Run.pipeline.task)
    labels = head_labels(cfg, task)  # a user task's classes come from its data: read and checked before anything loads
    load_start = time.perf_counter()
    if not sys.stderr.isatty():  # in a log, transformers' "Loading weights" bar is redrawn frames, not progress
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    loaded = load_model_with_pooling(cfg.model, head=task.head, num_labels=labels.num_labels, seed=cfg.seed,
                                     trust_remote_code=cfg.trust_remote_code, pooling=cfg.pooling)
    loaded.model.config.update(labels.config_values())  # id2label/label2id: the saved head names its classes
    model = loaded.model
    model_load_s = time.perf_counter() - load_start
    data_cfg = capped_max_length(cfg, model)  # the pipeline tokenises at most the model's positions
    # After the model: --mixed-precision auto depends on its size on a CPU.
    precision, why = resolve_precision(cfg.mixed_precision, sum(p.numel() for p in model.parameters()))
    accelerator = make_accelerator(precision, cfg.grad_accum, tracker(cfg.report_to), str(out))
    if accelerator.is_main_process:
        print(f"mixed precision: {precision} ({why})")
    if accelerator.is_main_process and task.head != "causal-lm":
        print(f"pooling: {loaded.pooling} (--pooling {cfg.pooling})")
    data_start = time.perf_counter()
    pipeline = build_pipeline(data_cfg, loaded.tokenizer, model, task)  # data files, subsets, tokenisation (or cache)
    if cfg.packing:  # packed examples must not attend to each other: set up and checked on every process
        from peftlab.tasks.batching import prepare_packed_attention

        packed = prepare_packed_attention(model)
        if accelerator.is_main_process:
            print(f"packing: {'attention over each example' if packed.per_example else 'a block-diagonal mask'} "
                  f"({packed.implementation}); packed vs alone logits within {packed.max_difference:.1e}")
    data_s = time.perf_counter() - data_start
    task_type = "CAUSAL_LM" if task.head == "causal-lm" else "SEQ_CLS"
    init_start = time.perf_counter()
    # CorDA's calibration: --corda-samples training inputs, one per forward (other methods never call it)
    applied = apply_method(model, cfg, train_head=task.head != "causal-lm", task_type=task_type,
                           calibration=calibration_runner(model, pipeline.train_dataset, pipeline.collate,
                                                          cfg.corda.samples))
    seconds = {"model_load_s": model_load_s, "data_s": data_s, "init_s": time.perf_counter() - init_start}
    return Built(accelerator, pipeline, applied, loaded.pooling, seconds)


def prepare_training(cfg: TrainConfig, built: Built) -> Run:
    """Parameter groups, AdamW, length-grouped batches and the scheduler, prepared by Accelerate."""
    from transformers import get_scheduler

    from peftlab.methods.optim_groups import adamw, count_trainable, param_groups

    accelerator, pipeline, applied = built.accelerator, built.pipeline, built.applied
    model = applied.model
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    groups = param_groups(model, applied.targets, applied.heads, cfg.optim, verbose=accelerator.is_main_process)
    optimizer = adamw(groups)
    params = count_trainable(model, applied.targets, applied.heads)
    sampler = LengthGroupedBatchSampler(pipeline.train_dataset["length"], cfg.batch_size, cfg.seed,
                                        grouped=not (cfg.pad_to_max or cfg.packing))  # packed rows: no padding to save
    # A private generator: creating a DataLoader iterator draws a seed from it. From the global RNG, that
    # draw would shift dropout's random stream whenever an epoch's iterator is re-created (e.g. on resume).
    train_loader = torch.utils.data.DataLoader(pipeline.train_dataset.remove_columns(["length"]),
                                               batch_sampler=sampler, collate_fn=pipeline.collate,
                                               generator=torch.Generator().manual_seed(cfg.seed))
    total_steps = optimizer_step_count(cfg, len(sampler))
    scheduler = get_scheduler(SCHEDULERS[cfg.scheduler], optimizer,
                              num_warmup_steps=int(cfg.warmup_ratio * total_steps), num_training_steps=max(1, total_steps))
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    save_only_trainable(accelerator)  # checkpoints: save_state / load_state keep the trainable tensors only
    # --compile: a compiled view of the prepared model for the train step only (peftlab.training.compile)
    compiled = compile_for_training(model, cfg.compile, accelerator.device.type, total_steps)
    if accelerator.is_main_process:
        print(f"compile: {'on' if compiled.active else 'off'} ({compiled.choice.reason})"
              + (f"; not compiled: {compiled.fallback}" if compiled.fallback else ""))
    return Run(cfg, accelerator, model, optimizer, scheduler, train_loader, sampler, pipeline, groups, params,
               built.seconds["init_s"], Path(cfg.output_dir), applied=applied, pooling=built.pooling,
               compiled=compiled)


def open_run_folder(run: Run, mode: str) -> None:
    """The run folder and its config.yaml (setup has succeeded); the checkpoint restored on --resume; trackers."""
    cfg, accelerator, out = run.cfg, run.accelerator, run.out
    if run.main:
        runfiles.init_output_dir(out, mode)
        save_config(cfg, out / "config.yaml")
    accelerator.wait_for_everyone()
    if mode == "resume":
        restored = load_checkpoint(run)  # model, optimizer, scheduler, RNG of this process: in place
        run.state, run.best_weights = restored.state, restored.best_weights
        if run.main:
            print(f"resuming at epoch {run.state.epoch + 1}, step {run.state.step_in_epoch}")
    if tracker(cfg.report_to) != "none":  # only now: the run folder exists (TensorBoard writes into <run>/tb)
        hparams = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool))}
        accelerator.init_trackers("tb" if tracker(cfg.report_to) == "tensorboard" else out.name, config=hparams)
        run.tracking = True
