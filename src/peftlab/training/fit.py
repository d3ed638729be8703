"""fit: epochs of optimizer steps under Accelerate, an evaluation and a checkpoint after each epoch.

Each step: ``loss = model(**batch).loss`` + the method's extra loss (KaSA's regulariser, logged apart),
backward, clip, the divergence guard (a non-finite loss or gradient norm stops the run as ``diverged``;
fp16 overflow is the GradScaler's skipped step), optimizer and scheduler steps; every ``--eval-steps``
optimizer steps a dev evaluation for the learning curve. Each epoch: the task's evaluation (told its tag), the
best epoch, the collapse label, epochs.jsonl, a checkpoint.

The learning curve (``state["curve"]``, result.json ``curve``, ``curve.jsonl`` with ``--eval-steps``) holds every
evaluation during training in order: the ``--eval-steps`` ones and the epoch-end ones. It lives in the loop
state, so a checkpoint carries it, and the file is rewritten whole from it: after a kill and ``--resume`` the
curve has neither a duplicate nor a missing point. An evaluation runs before the checkpoint of its step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from peftlab.io_utils import atomic_write_text
from peftlab.tasks.prepare import BEFORE_TAG, epoch_tag, merge_extras, step_tag
from peftlab.training import run_folder as runfiles
from peftlab.training.devices import uses_grad_scaler
from peftlab.training.guards import FAULT_NAN_STEP_ENV, better, check_collapse
from peftlab.training.schedule import checkpoint_interval, evaluates_epoch, planned_epoch_count, reached_max_steps
from peftlab.training.setup import Run


@dataclass(frozen=True)
class EpochEnd:
    """What an ``on_epoch_end`` hook of :func:`train` is told after each epoch's evaluation and checkpoint."""

    epoch: int  # 1-based
    metrics: dict  # the dev metrics ({} when --eval-every skipped this epoch)
    primary_metric: str
    status: str  # ok or collapsed (a diverged run stops before its epoch ends)


def fit(run: Run, on_epoch_end=None) -> None:
    """Epochs of steps; evaluation and a checkpoint after each epoch. Stops early on divergence, or when
    ``on_epoch_end`` (see :func:`peftlab.training.loop.train`) says so."""
    from peftlab.methods.table import extra_loss
    from peftlab.tasks.table import TASKS

    cfg, accelerator, model, state = run.cfg, run.accelerator, run.model, run.state
    optimizer, scheduler, pipeline = run.optimizer, run.scheduler, run.pipeline
    if state["before"] is None and (cfg.epochs == 0 or cfg.eval_before or TASKS[cfg.task].eval_before):
        state["before"] = evaluate(run, BEFORE_TAG)
        if run.main:
            print("before fine-tuning: " + format_metrics(state["before"]))

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
        progress = progress_bar(run.main, steps_per_epoch, state["step_in_epoch"], f"epoch {epoch + 1}/{planned_epochs}")
        epoch_start = time.perf_counter()  # the epoch's wall time: steps plus batch loading and collation
        state["in_epoch"] = True  # until the epoch's end: a divergence or failure mid-epoch counts it in epochs_run
        for batch in loader:
            step_start = time.perf_counter()
            with accelerator.accumulate(model):  # --grad-accum: the optimizer steps every N batches
                loss = model(**batch).loss
                aux = extra_loss(accelerator.unwrap_model(model), cfg)  # the method's hook, e.g. KaSA's regulariser
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
            done = reached_max_steps(cfg, state)
            if stepped and cfg.eval_steps and state["optimizer_steps"] % cfg.eval_steps == 0:
                # not when the epoch-end evaluation follows at this very step (it is the curve's point there)
                epoch_ends = done or state["step_in_epoch"] == steps_per_epoch
                if not (epoch_ends and evaluates_epoch(cfg, epoch + 1, last=done or epoch + 1 == planned_epochs)):
                    evaluate_step(run, steps_per_epoch)
            # Checkpoints only at an optimizer step: no half-accumulated gradient is ever lost or doubled.
            if stepped and checkpoint_every and state["optimizer_steps"] % checkpoint_every == 0 and not done:
                checkpoint(run)
            if done:  # --max-steps: this (possibly partial) epoch is the last
                break
        if progress is not None:
            progress.close()
        add_time(state, "train_s", time.perf_counter() - epoch_start)

        last = epoch + 1 == planned_epochs or reached_max_steps(cfg, state)
        evaluated = evaluates_epoch(cfg, epoch + 1, last=last)
        metrics = evaluate(run, epoch_tag(epoch + 1)) if evaluated else {}  # {}: skipped by --eval-every
        if evaluated:
            add_curve_point(run, metrics, steps_per_epoch, epoch_end=True)
        record = {"epoch": epoch + 1, "train_loss": state["epoch_loss_sum"] / max(1, state["epoch_loss_count"]),
                  "metrics": metrics, "seconds": state.get("epoch_train_seconds", 0.0)}
        if "epoch_aux_sum" in state:  # the method's extra loss (KaSA's regulariser), mean per step
            record["train_regulariser"] = state["epoch_aux_sum"] / max(1, state["epoch_loss_count"])
        state["epochs_log"].append(record)
        primary = metrics.get(pipeline.primary_metric)
        best = state["best"]
        if evaluated and (best is None or (primary is not None and better(
                primary, best["metrics"].get(pipeline.primary_metric), pipeline.primary_metric))):
            state["best"] = {"epoch": epoch + 1, "metrics": metrics}
            if cfg.save == "best":  # a CPU copy of what trains (adapter + head): small next to the model
                run.best_weights = trainable_copy(accelerator.unwrap_model(model))
        check_collapse(state, primary, pipeline.chance, epoch + 1, pipeline.primary_metric)
        if run.main:
            # Rewritten whole (atomically) rather than appended: a kill between this and the checkpoint
            # must not leave a duplicate line after --resume.
            lines = "".join(json.dumps(r) + "\n" for r in state["epochs_log"])
            atomic_write_text(run.out / "epochs.jsonl", lines)
            if run.tracking and metrics:
                accelerator.log({f"eval/{key}": value for key, value in metrics.items()}, step=epoch + 1)
            print(f"epoch {epoch + 1}: train_loss={record['train_loss']:.4f} "
                  + (format_metrics(metrics) if evaluated else "(not evaluated: --eval-every)"))
        state.update(epoch=epoch + 1, step_in_epoch=0, epoch_loss_sum=0.0, epoch_loss_count=0,
                     epoch_train_seconds=0.0, in_epoch=False)
        state.pop("epoch_aux_sum", None)
        checkpoint(run)
        stop = on_epoch_end(EpochEnd(epoch + 1, metrics, pipeline.primary_metric, state["status"])) \
            if on_epoch_end is not None else None
        if stop and not last:
            state["stopped_early"] = {"epoch": epoch + 1,
                                      "reason": stop if isinstance(stop, str) else "stopped by on_epoch_end"}
            break


def add_time(state: dict, key: str, seconds: float) -> None:
    """Accumulate a phase's wall time in ``state["timings"]`` (result.json's ``timings``)."""
    timings = state.setdefault("timings", {})
    timings[key] = timings.get(key, 0.0) + seconds


def evaluate(run: Run, tag: str) -> dict:
    """The task's evaluation ``tag`` (``before``, ``epoch<N>``, ``step<N>``): its metrics; its extras (e.g. the
    generation file it wrote) are kept in the loop state, checkpointed, and written to result.json at the end.
    The model's train/eval mode is restored afterwards, whatever the task's evaluation left it in (training
    must go on with dropout)."""
    start = time.perf_counter()
    was_training = run.model.training
    evaluation = run.pipeline.evaluate(run.model, run.accelerator, tag)
    run.model.train(was_training)
    add_time(run.state, "eval_s", time.perf_counter() - start)
    merge_extras(run.state.setdefault("eval_extras", {}), evaluation.extras)
    return evaluation.metrics


def evaluate_step(run: Run, steps_per_epoch: int) -> None:
    """An ``--eval-steps`` evaluation after the current optimizer step: a curve point (never a best epoch)."""
    state = run.state
    metrics = evaluate(run, step_tag(state["optimizer_steps"]))
    point = add_curve_point(run, metrics, steps_per_epoch, epoch_end=False)
    if run.main:
        print(f"step {point['step']} (epoch {point['epoch']:.2f}): {format_metrics(metrics)}")


def add_curve_point(run: Run, metrics: dict, steps_per_epoch: int, *, epoch_end: bool) -> dict:
    """Append one evaluation to the learning curve: ``step`` (optimizer steps so far), ``epoch`` (epochs done, a
    fraction of batches mid-epoch), ``metrics``, ``epoch_end``; with --eval-steps, ``curve.jsonl`` is rewritten
    whole (atomically) from the loop state, like epochs.jsonl."""
    state = run.state
    point = {"step": state.get("optimizer_steps", 0),
             "epoch": (state["epoch"] * steps_per_epoch + state["step_in_epoch"]) / max(1, steps_per_epoch),
             "metrics": metrics, "epoch_end": epoch_end}
    state.setdefault("curve", []).append(point)
    if run.main:
        if run.cfg.eval_steps:
            atomic_write_text(run.out / runfiles.CURVE_FILE, "".join(json.dumps(p) + "\n" for p in state["curve"]))
        if run.tracking and metrics:
            run.accelerator.log({f"curve/{key}": value for key, value in metrics.items()}, step=state["global_step"])
    return point


def trainable_copy(model) -> dict:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def checkpoint(run: Run) -> None:
    start = time.perf_counter()
    if run.main:
        runfiles.save_checkpoint(run.out, run.accelerator.unwrap_model(run.model), run.optimizer, run.scheduler,
                                 run.state, best_weights=run.best_weights)
    run.accelerator.wait_for_everyone()
    add_time(run.state, "checkpoint_s", time.perf_counter() - start)  # (not in the checkpoint it times)


def format_metrics(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())


def progress_bar(enabled: bool, total: int, initial: int, desc: str):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=False)
