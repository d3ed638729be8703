"""``peftlab train``: one fine-tuning run, an explicit loop on Accelerate that reads top to bottom.

setup (model, method, data, optimizer) -> fit (epochs of steps, evaluation each epoch, checkpoints)
-> finish (adapter, result.json). Accelerate supplies the device, mixed precision (bf16 on CUDA, fp32 on
CPU), DDP under ``accelerate launch`` and gradient clipping; nothing else is hidden.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from peftlab.training import run_folder as runfiles
from peftlab.config import SCHEDULERS, TrainConfig, add_dataclass_flags, build_config, save_config
from peftlab.errors import PeftlabError
from peftlab.tasks.metrics import LOWER_IS_BETTER  # best epoch: smaller eval_loss is better

# Test seam for the divergence guard: make the loss NaN at this global step (documented in RELIABILITY.md).
FAULT_NAN_STEP_ENV = "PEFTLAB_FAULT_NAN_AT_STEP"
# A metric "clearly above" chance is this far above it (metrics are in [0, 1] or [-1, 1]).
CLEARLY_ABOVE_CHANCE = 0.05


class LengthGroupedBatchSampler:
    """Batches of similar length (little padding), reshuffled each epoch; set ``epoch`` before iterating."""

    def __init__(self, lengths, batch_size: int, seed: int, grouped: bool):
        self.lengths, self.batch_size, self.seed, self.grouped = list(lengths), batch_size, seed, grouped
        self.epoch = 0

    def _batches(self):
        from peftlab.tasks.data_files import length_grouped_batches

        if self.grouped:
            return length_grouped_batches(self.lengths, self.batch_size, self.seed, self.epoch)
        order = torch.randperm(len(self.lengths), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return [order[i:i + self.batch_size].tolist() for i in range(0, len(order), self.batch_size)]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return math.ceil(len(self.lengths) / self.batch_size)


# `--mixed-precision auto` on a CPU: bf16 autocast from this many parameters up. Measured on this project's
# CPU (AMX, avx512_bf16; docs/RESULTS.md, "bf16 autocast on the CPU"): MPNet-base (109M) trained 1.7-1.9x faster
# at the same SST-2 accuracy; MiniLM-L6 (22.7M) only 1.16-1.26x, so small models stay fp32.
BF16_CPU_MIN_PARAMS = 100_000_000


def cpu_has_native_bf16() -> bool:
    """AMX or AVX-512 BF16 (Linux /proc/cpuinfo flags): without them bf16 autocast is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def resolve_precision(requested: str, n_params: int, cuda: bool | None = None) -> tuple[str, str]:
    """The precision a run uses (no, bf16, fp16) and why, for the start-up line and result.json."""
    if requested != "auto":
        return requested, f"--mixed-precision {requested}"
    if torch.cuda.is_available() if cuda is None else cuda:
        return "bf16", "auto: CUDA"
    size = f"{n_params / 1e6:.1f}M parameters"
    if not cpu_has_native_bf16():
        return "no", "auto: CPU without native bf16 (AMX/avx512_bf16)"
    if n_params < BF16_CPU_MIN_PARAMS:
        return "no", f"auto: CPU, {size} < {BF16_CPU_MIN_PARAMS / 1e6:.0f}M (bf16 gains little on small models)"
    return "bf16", f"auto: CPU with native bf16, {size} >= {BF16_CPU_MIN_PARAMS / 1e6:.0f}M"


def position_limit(model) -> int | None:
    """How many tokens the model can take: its position table (RoBERTa/MPNet reserve padding_idx + 1 rows)."""
    config = model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is None:
        return None
    if config.model_type in ("roberta", "mpnet", "xlm-roberta", "camembert", "longformer"):
        limit -= (getattr(config, "pad_token_id", 1) or 1) + 1
    return int(limit)


def _capped_max_length(cfg: TrainConfig, model) -> TrainConfig:
    """--max-length beyond the position table: an error with --pad-to-max (every batch would have that many
    tokens), else the data is tokenised at the model's limit, with a note. Checked before any file exists;
    ``cfg`` itself (config.yaml, the run's key) keeps the value the user gave."""
    import dataclasses

    limit = position_limit(model)
    if limit is None or cfg.max_length <= limit:
        return cfg
    if cfg.pad_to_max:
        raise PeftlabError(f"--max-length {cfg.max_length} with --pad-to-max exceeds the {limit} positions of "
                           f"model '{cfg.model}'", fix=f"use --max-length {limit} or less")
    print(f"--max-length {cfg.max_length} is capped at {limit}, the positions of model '{cfg.model}'")
    return dataclasses.replace(cfg, max_length=limit)


def _enable_gradient_checkpointing(model) -> None:
    """transformers' activation checkpointing on the (peft-wrapped) model; non-reentrant, so frozen inputs
    need no requires_grad trick and dropout's random stream is replayed exactly."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise PeftlabError(f"{type(base).__name__} does not support --gradient-checkpointing",
                           fix="drop --gradient-checkpointing for this model")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def uses_grad_scaler(accelerator) -> bool:
    """fp16 training: Accelerate's GradScaler skips overflowing steps itself."""
    return getattr(accelerator, "scaler", None) is not None


def optimizer_step_count(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """Optimizer steps the run takes: --max-steps, else --epochs x ceil(batches / --grad-accum)."""
    if cfg.max_steps and cfg.epochs > 0:
        return cfg.max_steps
    return math.ceil(batches_per_epoch / cfg.grad_accum) * cfg.epochs


DEFAULT_CHECKPOINT_EVERY = 200  # optimizer steps; a mid-epoch checkpoint of an adapter costs milliseconds


def checkpoint_interval(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """--checkpoint-every, else every DEFAULT_CHECKPOINT_EVERY steps when an epoch is longer (0: epoch ends only)."""
    if cfg.checkpoint_every is not None:
        return cfg.checkpoint_every
    steps = math.ceil(batches_per_epoch / cfg.grad_accum)
    return DEFAULT_CHECKPOINT_EVERY if steps > DEFAULT_CHECKPOINT_EVERY else 0


def _reached_max_steps(cfg: TrainConfig, state: dict) -> bool:
    return bool(cfg.max_steps) and state.get("optimizer_steps", 0) >= cfg.max_steps


def planned_epoch_count(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """Epochs the loop runs: --epochs, or as many (the last maybe partial) as --max-steps needs (--epochs 0,
    the before-fine-tuning row, trains nothing whatever --max-steps says)."""
    if cfg.max_steps and cfg.epochs > 0:
        return math.ceil(cfg.max_steps / max(1, math.ceil(batches_per_epoch / cfg.grad_accum)))
    return cfg.epochs


def make_accelerator(precision: str, grad_accum: int = 1, report_to: str = "none", project_dir: str | None = None):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, DistributedType

    if report_to in ("wandb", "mlflow"):
        import importlib.util

        if importlib.util.find_spec(report_to) is None:
            raise PeftlabError(f"--report-to {report_to} needs the '{report_to}' package, which is not installed",
                               fix=f"pip install {report_to}, or use --report-to tensorboard")

    # Accelerate keeps one state per process, and its mixed precision cannot change once set. A sweep worker
    # runs many runs in one process, so a run with another precision resets it: only in a single process
    # (never under `accelerate launch`, where the state also holds the process group).
    if (AcceleratorState._shared_state and AcceleratorState().initialized
            and AcceleratorState().distributed_type == DistributedType.NO
            and AcceleratorState().mixed_precision != precision):
        AcceleratorState._reset_state()
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=grad_accum,
                       log_with=None if report_to == "none" else report_to, project_dir=project_dir)


def _kasa_sigma(model) -> dict[str, list[float]] | None:
    """KaSA's learned singular values per adapted module (for KaSA Figure 4-style plots)."""
    out = {}
    for name, module in model.named_modules():
        diag = getattr(module, "lora_diag", None)
        if diag is not None and "default" in diag:
            out[name.removeprefix("base_model.model.")] = diag["default"].detach().float().cpu().tolist()
    return out or None


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

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) one fine-tuning run into ``cfg.output_dir``; returns the result dict."""
    out = Path(cfg.output_dir)
    # Decide what to do with --output-dir first (cheap), but create nothing until setup has succeeded:
    # bad input found during setup (a data file, a rank) must not leave a half-made run folder behind.
    mode = runfiles.inspect_output_dir(out, overwrite=cfg.overwrite, resume=cfg.resume)
    if mode in ("resume", "finished", "restart"):  # restart: killed before its first checkpoint, same rule
        _check_same_config(cfg, out)
    if mode == "finished":
        return runfiles.read_result(out)
    run = setup(cfg, mode)
    try:
        fit(run)
    except Exception as err:  # OOM, full disk, a bug: say so in result.json; the checkpoint stays for --resume
        if run.main:
            runfiles.write_json(out / "result.json", {
                "schema_version": 1, "status": "failed", "status_reason": f"{type(err).__name__}: {err}"[:2000],
                "config": cfg.to_dict(), "epochs_log": run.state.get("epochs_log", [])})
        raise
    return finish(run)


def setup(cfg: TrainConfig, mode: str) -> Run:
    """Model, method, data and optimizer; restores the checkpoint when resuming."""
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    from peftlab.methods.table import apply_method
    from peftlab.models.registry import load_model
    from peftlab.methods.optim_groups import adamw, count_trainable, param_groups
    from peftlab.tasks.prepare import build_pipeline
    from peftlab.tasks.table import TASKS

    out = Path(cfg.output_dir)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    set_seed(cfg.seed)
    task = TASKS[cfg.task]
    model, tokenizer = load_model(cfg.model, head=task.head, num_labels=task.num_labels, seed=cfg.seed,
                                  trust_remote_code=cfg.trust_remote_code, pooling=cfg.pooling)
    data_cfg = _capped_max_length(cfg, model)  # the pipeline tokenises at most the model's positions
    # After the model: --mixed-precision auto depends on its size on a CPU.
    precision, why = resolve_precision(cfg.mixed_precision, sum(p.numel() for p in model.parameters()))
    accelerator = make_accelerator(precision, cfg.grad_accum, cfg.report_to, str(out))
    if accelerator.is_main_process:
        print(f"mixed precision: {precision} ({why})")
    if accelerator.is_main_process and task.head != "causal-lm":
        print(f"pooling: {model.peftlab_pooling} (--pooling {cfg.pooling})")
    pipeline = build_pipeline(data_cfg, tokenizer, model)
    task_type = "CAUSAL_LM" if task.head == "causal-lm" else "SEQ_CLS"
    init_start = time.perf_counter()
    from peftlab.methods.corda import calibration_runner  # CorDA: --corda-samples training inputs, one per forward

    model, targets, heads = apply_method(model, cfg, train_head=task.head != "causal-lm", task_type=task_type,
                                         calibration=calibration_runner(model, pipeline.train_dataset,
                                                                        pipeline.collate, cfg.corda_samples))
    init_seconds = time.perf_counter() - init_start
    if cfg.gradient_checkpointing:
        _enable_gradient_checkpointing(model)
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
              init_seconds, out)
    run.state = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "epochs_log": [], "best": None,
                 "before": None, "status": "ok", "status_reason": None, "train_seconds": 0.0,
                 "train_examples": 0, "clearly_above_chance": False, "epoch_loss_sum": 0.0,
                 "epoch_loss_count": 0,
                 # KaSA's singular-value vectors before any step: the figure shows what training changed.
                 "kasa_sigma_init": _kasa_sigma(accelerator.unwrap_model(model))}
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
    return run


def fit(run: Run) -> None:
    """Epochs of steps; evaluation and a checkpoint after each epoch. Stops early only on divergence."""
    from peftlab.methods.table import extra_loss
    from peftlab.tasks.table import TASKS

    cfg, accelerator, model, state = run.cfg, run.accelerator, run.model, run.state
    optimizer, scheduler, pipeline = run.optimizer, run.scheduler, run.pipeline
    if state["before"] is None and (cfg.epochs == 0 or cfg.eval_before or TASKS[cfg.task].eval_before):
        state["before"] = pipeline.evaluate(model, accelerator)
        if run.main:
            print("before fine-tuning: " + _fmt_metrics(state["before"]))

    fault_step = int(os.environ.get(FAULT_NAN_STEP_ENV, "-1"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    steps_per_epoch = len(run.train_loader)  # batches per epoch, per process under DDP
    planned_epochs = planned_epoch_count(cfg, steps_per_epoch)
    checkpoint_every = checkpoint_interval(cfg, steps_per_epoch)
    model.train()
    while state["epoch"] < planned_epochs:
        epoch = state["epoch"]
        run.sampler.epoch = epoch
        loader = run.train_loader
        if state["step_in_epoch"]:  # resuming mid-epoch: the same batches, minus those already done
            loader = accelerator.skip_first_batches(run.train_loader, state["step_in_epoch"])
        progress = _progress(run.main, steps_per_epoch, state["step_in_epoch"], f"epoch {epoch + 1}/{planned_epochs}")
        for batch in loader:
            step_start = time.perf_counter()
            with accelerator.accumulate(model):  # --grad-accum: the optimizer steps every N batches
                loss = model(**batch).loss
                aux = extra_loss(accelerator.unwrap_model(model))  # the method's hook, e.g. KaSA's regulariser
                total = loss if aux is None else loss + aux
                if state["global_step"] == fault_step:
                    total = total * float("nan")
                accelerator.backward(total)  # divides by --grad-accum itself
                finite_loss = bool(torch.isfinite(total.detach()))
                finite_grad = True
                if accelerator.sync_gradients:  # gradients are complete only at the last batch of a step
                    if cfg.max_grad_norm > 0:
                        grad_norm = accelerator.clip_grad_norm_(trainable, cfg.max_grad_norm)
                    else:
                        grad_norm = torch.linalg.vector_norm(torch.stack(
                            [p.grad.norm() for p in trainable if p.grad is not None]))
                    finite_grad = bool(torch.isfinite(torch.as_tensor(grad_norm)))
                # fp16: an overflowing gradient is the GradScaler's business (it skips the step and lowers the
                # scale), not a divergence; Accelerate says afterwards whether the step was skipped.
                scaled = uses_grad_scaler(accelerator)
                if not finite_loss or (not finite_grad and not scaled):
                    what = "loss" if not finite_loss else "gradient norm"
                    state["status"] = "diverged"
                    state["status_reason"] = f"non-finite {what} at step {state['global_step']} (epoch {epoch + 1})"
                    if progress is not None:
                        progress.close()
                    return
                stepped = accelerator.sync_gradients
                optimizer.step()  # prepared by Accelerate: a no-op between accumulation boundaries
                if stepped and accelerator.optimizer_step_was_skipped:
                    state["skipped_steps"] = state.get("skipped_steps", 0) + 1
                elif stepped:
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            examples = batch["input_ids"].shape[0] * accelerator.num_processes
            seconds = time.perf_counter() - step_start
            state["global_step"] += 1
            state["step_in_epoch"] += 1
            if stepped:
                state["optimizer_steps"] = state.get("optimizer_steps", 0) + 1
            state["train_examples"] += examples
            state["train_seconds"] += seconds
            state["epoch_train_seconds"] = state.get("epoch_train_seconds", 0.0) + seconds
            state["epoch_loss_sum"] += loss.item()
            state["epoch_loss_count"] += 1
            if aux is not None:  # logged apart from the task loss, so the curves show what was optimised
                state["epoch_aux_sum"] = state.get("epoch_aux_sum", 0.0) + aux.item()
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{loss.item():.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}",
                                     ex_s=f"{examples / seconds:.1f}")
            if run.tracking and state["global_step"] % cfg.log_every == 0:
                values = {"train/loss": loss.item()}
                if aux is not None:
                    values.update({"train/regulariser": aux.item(), "train/objective": total.item()})
                # one entry per group name: the decay and no-decay halves of a group share its lr
                values.update({f"lr/{g.get('name', 'group')}": g["lr"] for g in optimizer.param_groups})
                accelerator.log(values, step=state["global_step"])
            done = _reached_max_steps(cfg, state)
            # Checkpoints only at an optimizer step: no half-accumulated gradient is ever lost or doubled.
            if stepped and checkpoint_every and state["optimizer_steps"] % checkpoint_every == 0 and not done:
                _checkpoint(run)
            if done:  # --max-steps: this (possibly partial) epoch is the last
                break
        if progress is not None:
            progress.close()

        last = epoch + 1 == planned_epochs or _reached_max_steps(cfg, state)
        evaluated = last or (cfg.eval_every > 0 and (epoch + 1) % cfg.eval_every == 0)
        metrics = pipeline.evaluate(model, accelerator) if evaluated else {}  # {}: skipped by --eval-every
        record = {"epoch": epoch + 1, "train_loss": state["epoch_loss_sum"] / max(1, state["epoch_loss_count"]),
                  "metrics": metrics, "seconds": state.get("epoch_train_seconds", 0.0)}
        if "epoch_aux_sum" in state:  # the method's extra loss (KaSA's regulariser), mean per step
            record["train_regulariser"] = state["epoch_aux_sum"] / max(1, state["epoch_loss_count"])
        state["epochs_log"].append(record)
        primary = metrics.get(pipeline.primary_metric)
        best = state["best"]
        if evaluated and (best is None or (primary is not None and _better(
                primary, best["metrics"].get(pipeline.primary_metric), pipeline.primary_metric))):
            state["best"] = {"epoch": epoch + 1, "metrics": metrics}
            if cfg.save == "best":  # a CPU copy of what trains (adapter + head): small next to the model
                run.best_weights = _trainable_copy(accelerator.unwrap_model(model))
        _check_collapse(state, primary, pipeline.chance, epoch + 1, pipeline.primary_metric)
        if run.main:
            # Rewritten whole (atomically) rather than appended: a kill between this and the checkpoint
            # must not leave a duplicate line after --resume.
            runfiles.atomic_write_text(run.out / "epochs.jsonl",
                                       "".join(json.dumps(r) + "\n" for r in state["epochs_log"]))
            if run.tracking and metrics:
                accelerator.log({f"eval/{key}": value for key, value in metrics.items()}, step=epoch + 1)
            print(f"epoch {epoch + 1}: train_loss={record['train_loss']:.4f} "
                  + (_fmt_metrics(metrics) if evaluated else "(not evaluated: --eval-every)"))
        state.update(epoch=epoch + 1, step_in_epoch=0, epoch_loss_sum=0.0, epoch_loss_count=0,
                     epoch_train_seconds=0.0)
        state.pop("epoch_aux_sum", None)
        _checkpoint(run)


def finish(run: Run) -> dict:
    """Save the adapter and write result.json (last: its presence marks the run finished)."""
    from peftlab.methods.saving import save_trained
    from peftlab.methods.optim_groups import lr_by_group

    cfg, state, accelerator = run.cfg, run.state, run.accelerator
    unwrapped = accelerator.unwrap_model(run.model)
    saved_epoch = _restore_best(run, unwrapped)  # --save best: adapter/ (and kasa_sigma) are the best epoch's
    before = state["before"]
    final_metrics = state["epochs_log"][-1]["metrics"] if state["epochs_log"] else (before or {})
    result = {
        "schema_version": 1,
        "status": state["status"],
        "status_reason": state["status_reason"],
        "task": cfg.task, "model": cfg.model, "method": cfg.method, "targets": ",".join(cfg.targets),
        "rank": cfg.rank, "alpha": cfg.alpha, "lr": cfg.lr, "lr_ratio": cfg.lr_ratio, "head_lr": cfg.head_lr,
        "group_lrs": lr_by_group(run.groups), "seed": cfg.seed, "epochs": cfg.epochs,
        "config": cfg.to_dict(),
        "trainable_params": run.params,
        "primary_metric": run.pipeline.primary_metric,
        "majority_baseline": run.pipeline.chance,
        "mixed_precision": accelerator.mixed_precision,  # --mixed-precision as resolved (auto: by device, size)
        "eval_seed": cfg.eval_seed,  # the --max-eval-samples draw; the same for every training seed
        "above_majority": _above_majority(state, before, run.pipeline),
        "saved_epoch": saved_epoch,  # the epoch whose weights adapter/ holds (--save best|last)
        "num_eval_examples": run.pipeline.num_eval_examples or None,
        "epochs_log": state["epochs_log"],
        "before": {"metrics": before} if before is not None else None,
        "best": state["best"] or {"epoch": 0, "metrics": before or {}},
        "final": {"metrics": final_metrics},
        "train_examples": state["train_examples"],
        "skipped_steps": state.get("skipped_steps", 0),
        "optimizer_steps": state.get("optimizer_steps", state["global_step"]),  # batches / --grad-accum  # fp16: steps the GradScaler skipped on overflow
        "train_seconds": state["train_seconds"],
        "train_examples_per_second": (state["train_examples"] / state["train_seconds"]
                                      if state["train_seconds"] else None),
        "init_seconds": run.init_seconds,
        "pooling": getattr(unwrapped, "peftlab_pooling", None),  # --pooling resolved (peftlab.models.pooling)
        "calibration_seconds": getattr(unwrapped, "peftlab_calibration_seconds", None),  # CorDA's forward passes
        "peak_memory_mb": runfiles.peak_memory_mb(accelerator.device),
        "device": str(accelerator.device),
        "num_processes": accelerator.num_processes,
        "versions": runfiles.versions(),
        "git_commit": runfiles.git_commit(),
        **run.pipeline.extras,
    }
    sigma = _kasa_sigma(unwrapped)
    if sigma:
        result["kasa_sigma"] = sigma
        if state.get("kasa_sigma_init"):  # absent only in a checkpoint written by an older peftlab
            result["kasa_sigma_init"] = state["kasa_sigma_init"]
    if run.main:
        save_trained(unwrapped, run.out / "adapter", base_model=cfg.model)
        runfiles.write_json(run.out / "result.json", result)
        runfiles.remove_checkpoint(run.out)  # the run is finished; its adapter and result are what count
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


# Keys that may change between a run and its resumption without changing what is computed.
RESUME_FREE_KEYS = {"resume", "overwrite", "output_dir", "checkpoint_every", "log_every", "threads", "report_to"}


def _check_same_config(cfg: TrainConfig, out: Path) -> None:
    import yaml

    saved_file = out / "config.yaml"
    if not saved_file.is_file():
        return
    saved = yaml.safe_load(saved_file.read_text()) or {}
    current = cfg.to_dict()
    # Keys missing from an older config.yaml (added to peftlab since) are not a change.
    changed = sorted(k for k in current if k not in RESUME_FREE_KEYS and k in saved and saved[k] != current[k])
    if changed:
        key = changed[0]
        raise PeftlabError(f"--resume with a different config: {key} was {saved.get(key)!r}, now {current[key]!r}"
                           + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""),
                           where=str(saved_file),
                           fix="resume with the run's own config, or use --overwrite / another --output-dir")


def _above_majority(state: dict, before: dict | None, pipeline) -> bool | None:
    """Whether the best dev metric beats always predicting the dev set's majority class (None: no such bar,
    e.g. eval_loss of instruction tasks)."""
    name = pipeline.primary_metric
    if name in LOWER_IS_BETTER:
        return None
    metrics = (state["best"] or {}).get("metrics") or before or {}
    value = metrics.get(name)
    return None if value is None else bool(value > pipeline.chance)


def _better(value: float, incumbent: float | None, metric: str) -> bool:
    if incumbent is None:
        return True
    return value < incumbent if metric in LOWER_IS_BETTER else value > incumbent


def _check_collapse(state: dict, primary, chance: float, epoch: int, name: str) -> None:
    """Label (never hide) a run whose dev metric fell to chance after having been clearly above it."""
    if primary is None:
        return
    if primary > chance + CLEARLY_ABOVE_CHANCE:
        state["clearly_above_chance"] = True
    elif state["clearly_above_chance"] and primary <= chance and state["status"] == "ok":
        state["status"] = "collapsed"
        state["status_reason"] = f"{name} fell to {primary:.4f} <= chance {chance:.4f} at epoch {epoch}"


def _trainable_copy(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def _restore_best(run: Run, model) -> int | None:
    """--save best: put the best epoch's weights back before saving; returns the epoch adapter/ holds."""
    state = run.state
    last = state["epochs_log"][-1]["epoch"] if state["epochs_log"] else None
    best = (state["best"] or {}).get("epoch")
    if run.cfg.save != "best" or run.best_weights is None or best is None or best == last:
        return last
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in run.best_weights.items():
            params[name].copy_(value)
    return best


def _checkpoint(run: Run) -> None:
    if run.main:
        runfiles.save_checkpoint(run.out, run.accelerator.unwrap_model(run.model), run.optimizer, run.scheduler,
                                 run.state, best_weights=run.best_weights)
    run.accelerator.wait_for_everyone()


def _fmt_metrics(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


def _progress(enabled: bool, total: int, initial: int, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=False)


# --------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    parser = sub.add_parser("train", help="fine-tune one model on one task with one method",
                            description="One fine-tuning run. Every flag can also come from --config YAML; "
                                        "flags override it.")
    parser.add_argument("--config", help="YAML file of config keys (flags override it)")
    add_dataclass_flags(parser, TrainConfig)
    parser.set_defaults(func=run_cli)


def config_from_args(args) -> TrainConfig:
    values = {f.name: getattr(args, f.name, None) for f in fields(TrainConfig)}
    return build_config(TrainConfig, yaml_path=args.config, flag_values=values, check_explicit=True)


def run_cli(args) -> int:
    cfg = config_from_args(args)
    result = train(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # one summary per run under accelerate launch
        return 0 if result["status"] in ("ok", "collapsed") else 1
    best = result["best"]["metrics"].get(result["primary_metric"])
    final = result["final"]["metrics"].get(result["primary_metric"])
    print(f"status={result['status']} {result['primary_metric']}: best={_fmt(best)} "
          f"(epoch {result['best']['epoch']}) final={_fmt(final)} chance={_fmt(result['majority_baseline'])} "
          f"-> {Path(cfg.output_dir) / 'result.json'}")
    if result.get("above_majority") is False and cfg.epochs > 0:
        print(f"note: the best {result['primary_metric']} {_fmt(best)} is not above the majority class "
              f"{_fmt(result['majority_baseline'])} of the dev set: this run learned nothing measurable")
    if result["status_reason"]:
        print(f"reason: {result['status_reason']}")
    return 0 if result["status"] in ("ok", "collapsed") else 1


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"
