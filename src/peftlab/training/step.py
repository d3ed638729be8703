"""step: one batch of training under Accelerate, and the divergence guard.

At the last batch of an accumulation window: clip (--max-grad-norm), the guard, the optimizer step and, unless
fp16's GradScaler skipped it, the scheduler step. A non-finite loss, or a non-finite gradient norm without a
GradScaler, ends the run as ``diverged``."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from peftlab.tasks.batching import examples_in_batch  # a --packing row holds several examples
from peftlab.training.compile import guarded_step, training_module
from peftlab.training.devices import uses_grad_scaler


@dataclass(frozen=True)
class Objective:
    """What one batch's backward pass minimises."""

    loss: torch.Tensor  # the task loss
    aux: torch.Tensor | None  # the method's extra loss (KaSA's regulariser); None for most methods
    total: torch.Tensor  # loss + aux


@dataclass(frozen=True)
class StepResult:
    """One batch trained: its numbers for the loop state, the progress bar and the trackers."""

    loss: float
    aux: float | None
    total: float
    stepped: bool  # the optimizer stepped (the last batch of an accumulation window)
    examples: int  # this batch's examples, all processes together
    seconds: float  # forward, backward and optimizer step


def forward_loss(run, batch) -> Objective:
    """The batch's objective. (Tests wrap this function to inject a fault, e.g. a NaN at one step.)"""
    model = training_module(run.compiled, run.model)  # --compile: the compiled view, while it works
    return objective(model, batch, run.cfg, method_model=run.accelerator.unwrap_model(run.model))


def objective(model, batch, cfg, method_model=None) -> Objective:
    """``model(**batch).loss`` plus the method's extra loss on ``method_model`` (default: ``model``)."""
    from peftlab.methods.table import extra_loss

    loss = model(**batch).loss
    aux = extra_loss(model if method_model is None else method_model, cfg)
    return Objective(loss, aux, loss if aux is None else loss + aux)


def train_step(run, batch, trainable: list) -> StepResult | None:
    """Train on one batch; None when the run diverged (``run.state`` then has its status and reason)."""
    accelerator, state = run.accelerator, run.state
    start = time.perf_counter()
    with accelerator.accumulate(run.model):  # --grad-accum: the optimizer steps every N batches
        # --compile: a step that fails to compile is undone and run eagerly (peftlab.training.compile)
        objective = guarded_step(run.compiled, lambda: forward_backward(run, batch), trainable,
                                 clear=lambda: run.optimizer.zero_grad(set_to_none=True),
                                 say=print if run.main else (lambda line: None))
        what = non_finite(run, objective.total, trainable)
        if what is not None:
            state.status = "diverged"
            state.status_reason = f"non-finite {what} at step {state.global_step} (epoch {state.epoch + 1})"
            return None
        stepped = optimizer_step(run)
    seconds = time.perf_counter() - start
    aux = None if objective.aux is None else objective.aux.item()
    return StepResult(objective.loss.item(), aux, objective.total.item(), stepped,
                      examples_in_batch(batch) * accelerator.num_processes, seconds)


def forward_backward(run, batch) -> Objective:
    objective = forward_loss(run, batch)
    run.accelerator.backward(objective.total)  # divides by --grad-accum itself
    return objective


def non_finite(run, total: torch.Tensor, trainable: list) -> str | None:
    """'loss' or 'gradient norm' when it is not finite (a divergence), else None. At the end of an
    accumulation window the gradients are clipped here (--max-grad-norm; 0: their norm is only measured)."""
    accelerator = run.accelerator
    if not bool(torch.isfinite(total.detach())):
        return "loss"
    if not accelerator.sync_gradients:  # gradients are complete only at the last batch of a window
        return None
    if run.cfg.max_grad_norm > 0:
        norm = accelerator.clip_grad_norm_(trainable, run.cfg.max_grad_norm)
    else:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainable if p.grad is not None]))
    # fp16: an overflowing gradient is the GradScaler's business (it skips the step and lowers the scale)
    if not bool(torch.isfinite(torch.as_tensor(norm))) and not uses_grad_scaler(accelerator):
        return "gradient norm"
    return None


def optimizer_step(run) -> bool:
    """The optimizer step (prepared by Accelerate: a no-op inside an accumulation window) and the scheduler's
    after it; True at the end of a window. Accelerate says afterwards whether fp16's scaler skipped it."""
    accelerator = run.accelerator
    stepped = accelerator.sync_gradients
    run.optimizer.step()
    if stepped and accelerator.optimizer_step_was_skipped:
        run.state.skipped_steps += 1
    elif stepped:
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    return stepped


def log_step(run, result: StepResult) -> None:
    """--report-to: the batch's losses and each parameter group's lr, every --log-every batches."""
    if not run.tracking or run.state.global_step % run.cfg.log_every:
        return
    values = {"train/loss": result.loss}
    if result.aux is not None:
        values.update({"train/regulariser": result.aux, "train/objective": result.total})
    # one entry per group name: the decay and no-decay halves of a group share its lr
    values.update({f"lr/{group.get('name', 'group')}": group["lr"] for group in run.optimizer.param_groups})
    run.accelerator.log(values, step=run.state.global_step)
