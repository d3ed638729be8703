"""fit: epochs of optimizer steps under Accelerate, an evaluation and a checkpoint after each epoch.

The learning curve (``LoopState.curve``: every evaluation during training, the ``--eval-steps`` ones and the
epoch-end ones) lives in the loop state, so a checkpoint carries it and ``curve.jsonl`` is rewritten whole from
it: after a kill and ``--resume`` it has neither a duplicate nor a missing point. An evaluation runs before the
checkpoint of its step."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from tqdm.auto import tqdm

from peftlab.io_utils import atomic_write_text
from peftlab.tasks.prepare import BEFORE_TAG, epoch_tag, merge_extras, step_tag
from peftlab.training import run_folder as runfiles
from peftlab.training.checkpoint import save_checkpoint, trainable_tensors
from peftlab.training.guards import better, check_collapse, early_stop_reason
from peftlab.training.schedule import checkpoint_interval, evaluates_epoch, planned_epoch_count, reached_max_steps
from peftlab.training.setup import Run
from peftlab.training.state import EpochEnd
from peftlab.training.step import StepResult, log_step, train_step


@dataclass(frozen=True)
class Plan:
    """What the loop fixes before its first step."""

    steps_per_epoch: int  # batches per epoch, per process under DDP
    epochs: int  # epochs the loop runs: --epochs, or as many (the last maybe partial) as --max-steps needs
    checkpoint_every: int  # optimizer steps between mid-epoch checkpoints (0: at epoch ends only)
    trainable: list  # the parameters that train: clipped and norm-checked at each optimizer step


def fit(run: Run, on_epoch_end=None) -> None:
    """Epochs of steps; stops early on divergence, or when ``on_epoch_end`` (:func:`peftlab.training.loop.train`)
    says so."""
    evaluate_before(run)
    plan = make_plan(run)
    run.model.train()
    while run.state.epoch < plan.epochs and not run.state.early_stopped:  # (a resumed early-stopped run ends)
        if not run_epoch(run, plan):
            return  # diverged: the epoch never ends, and no checkpoint is written after it
        if end_epoch(run, plan, on_epoch_end):
            return


def evaluate_before(run: Run) -> None:
    cfg, state = run.cfg, run.state
    if state.before is None and (cfg.epochs == 0 or cfg.eval_before or run.pipeline.task.eval_before):
        state.before = evaluate(run, BEFORE_TAG)
        if run.main:
            print("before fine-tuning: " + format_metrics(state.before))


def make_plan(run: Run) -> Plan:
    steps = len(run.train_loader)
    return Plan(steps, planned_epoch_count(run.cfg, steps), checkpoint_interval(run.cfg, steps),
                [p for p in run.model.parameters() if p.requires_grad])


def run_epoch(run: Run, plan: Plan) -> bool:
    """The current epoch's batches (when resuming mid-epoch: those not done yet); False when it diverged."""
    state = run.state
    run.sampler.epoch = state.epoch
    loader = run.train_loader
    if state.step_in_epoch:  # resuming mid-epoch: the same batches, minus those already done
        loader = run.accelerator.skip_first_batches(run.train_loader, state.step_in_epoch)
    start = time.perf_counter()  # the epoch's wall time: steps plus batch loading and collation
    state.in_epoch = True  # until the epoch's end: a divergence or failure mid-epoch counts it in epochs_run
    # The bar on a terminal only (disable=None): in a log (CI, nohup, a sweep's worker) the epoch's one printed line
    # is its progress, not thousands of redrawn frames.
    with tqdm(total=plan.steps_per_epoch, initial=state.step_in_epoch, desc=f"epoch {state.epoch + 1}/{plan.epochs}",
              dynamic_ncols=True, leave=False, disable=None if run.main else True) as progress:
        for batch in loader:
            result = train_step(run, batch, plan.trainable)
            if result is None:
                return False
            if after_step(run, plan, result, progress):  # --max-steps: this (maybe partial) epoch is the last
                break
    state.add_time("train_s", time.perf_counter() - start)
    return True


def after_step(run: Run, plan: Plan, result: StepResult, progress) -> bool:
    """Count and log the batch; at an optimizer step the --eval-steps evaluation and the checkpoint. True at
    --max-steps."""
    state, cfg = run.state, run.cfg
    state.count_batch(result)
    progress.update(1)
    if not progress.disable:
        progress.set_postfix(loss=f"{result.loss:.4f}", lr=f"{run.scheduler.get_last_lr()[0]:.2e}",
                             ex_s=f"{result.examples / result.seconds:.1f}")
    log_step(run, result)
    done = reached_max_steps(cfg, state)
    # not when the epoch-end evaluation follows at this very step (it is the curve's point there)
    if (result.stepped and cfg.eval_steps and state.optimizer_steps % cfg.eval_steps == 0
            and not epoch_end_evaluates_here(run, plan, done)):
        evaluate_step(run, plan.steps_per_epoch)
    # Checkpoints only at an optimizer step: no half-accumulated gradient is ever lost or doubled.
    if result.stepped and plan.checkpoint_every and state.optimizer_steps % plan.checkpoint_every == 0 and not done:
        checkpoint(run)
    return done


def epoch_end_evaluates_here(run: Run, plan: Plan, done: bool) -> bool:
    """Whether this batch ends the epoch and an epoch-end evaluation follows it at this very step."""
    state = run.state
    if not (done or state.step_in_epoch == plan.steps_per_epoch):
        return False
    return evaluates_epoch(run.cfg, state.epoch + 1, last=done or state.epoch + 1 == plan.epochs)


def end_epoch(run: Run, plan: Plan, on_epoch_end) -> bool:
    """The epoch's evaluation, record, best epoch, labels, checkpoint and hook; True when the run stops."""
    state, cfg, pipeline = run.state, run.cfg, run.pipeline
    epoch = state.epoch + 1  # 1-based: the epoch now ending
    last = epoch == plan.epochs or reached_max_steps(cfg, state)
    evaluated = evaluates_epoch(cfg, epoch, last=last)
    metrics = evaluate(run, epoch_tag(epoch)) if evaluated else {}  # {}: skipped by --eval-every
    if evaluated:
        add_curve_point(run, metrics, plan.steps_per_epoch, epoch_end=True)
    record = state.epoch_record(metrics)
    state.epochs_log.append(record)
    name = pipeline.choice_metric  # the selection split's metric where there is one, else the dev set's
    chosen = metrics.get(name)
    if evaluated:
        keep_best(run, epoch, metrics, chosen)
    check_collapse(state, chosen, pipeline.choice_chance, f"epoch {epoch}", name)
    stop = early_stop_reason(state, chosen, epoch, cfg.early_stop_patience, cfg.early_stop_min_delta, name)
    report_epoch(run, record, evaluated)
    state.finish_epoch()
    if stop and not last:
        state.early_stopped = {"epoch": epoch, "reason": stop}
        if run.main:
            print(f"early stopping after epoch {epoch}: {stop}")
    checkpoint(run)
    if state.early_stopped:
        return True
    return stopped_by_hook(run, on_epoch_end, EpochEnd(epoch, metrics, name, state.status), last)


def keep_best(run: Run, epoch: int, metrics: dict, primary) -> None:
    """The best epoch so far (its metrics; with --save best a CPU copy of what trains: adapter + head)."""
    best, name = run.state.best, run.pipeline.choice_metric
    if best is None or (primary is not None and better(primary, best["metrics"].get(name), name)):
        run.state.best = {"epoch": epoch, "metrics": metrics}
        if run.cfg.save == "best":
            run.best_weights = trainable_tensors(run.accelerator.unwrap_model(run.model), copy=True)


def report_epoch(run: Run, record: dict, evaluated: bool) -> None:
    """epochs.jsonl, the trackers and the epoch's printed line (process 0)."""
    if not run.main:
        return
    # Rewritten whole (atomically) rather than appended: a kill between this and the checkpoint must not
    # leave a duplicate line after --resume.
    atomic_write_text(run.out / "epochs.jsonl", "".join(json.dumps(r) + "\n" for r in run.state.epochs_log))
    metrics = record["metrics"]
    if run.tracking and metrics:
        run.accelerator.log({f"eval/{key}": value for key, value in metrics.items()}, step=record["epoch"])
    print(f"epoch {record['epoch']}: train_loss={record['train_loss']:.4f} "
          + (format_metrics(metrics) if evaluated else "(not evaluated: --eval-every)"))


def stopped_by_hook(run: Run, on_epoch_end, end: EpochEnd, last: bool) -> bool:
    """Ask the on_epoch_end hook; a truthy answer before the last epoch stops the run (``stopped_early``)."""
    stop = on_epoch_end(end) if on_epoch_end is not None else None
    if not stop or last:
        return False
    reason = stop if isinstance(stop, str) else "stopped by on_epoch_end"
    run.state.stopped_early = {"epoch": end.epoch, "reason": reason}
    return True


def evaluate(run: Run, tag: str) -> dict:
    """The task's evaluation ``tag`` (``before``, ``epoch<N>``, ``step<N>``): its metrics; its extras (e.g. the
    generation file it wrote) go to the loop state. The model's train/eval mode is restored afterwards (training
    must go on with dropout)."""
    start = time.perf_counter()
    was_training = run.model.training
    evaluation = run.pipeline.evaluate(run.model, run.accelerator, tag)
    run.model.train(was_training)
    run.state.add_time("eval_s", time.perf_counter() - start)
    merge_extras(run.state.eval_extras, evaluation.extras)
    return evaluation.metrics


def evaluate_step(run: Run, steps_per_epoch: int) -> None:
    """An ``--eval-steps`` evaluation after the current optimizer step: a curve point (never a best epoch)."""
    metrics = evaluate(run, step_tag(run.state.optimizer_steps))
    point = add_curve_point(run, metrics, steps_per_epoch, epoch_end=False)
    name = run.pipeline.choice_metric  # a rise and fall between epoch ends is a collapse too
    check_collapse(run.state, metrics.get(name), run.pipeline.choice_chance, f"step {point['step']}", name)
    if run.main:
        print(f"step {point['step']} (epoch {point['epoch']:.2f}): {format_metrics(metrics)}")


def add_curve_point(run: Run, metrics: dict, steps_per_epoch: int, *, epoch_end: bool) -> dict:
    """Append one evaluation to the learning curve (``curve.jsonl`` rewritten whole with --eval-steps)."""
    state = run.state
    point = {"step": state.optimizer_steps, "epoch": state.epochs_done(steps_per_epoch), "metrics": metrics,
             "epoch_end": epoch_end}
    state.curve.append(point)
    if run.main:
        if run.cfg.eval_steps:
            atomic_write_text(run.out / runfiles.CURVE_FILE, "".join(json.dumps(p) + "\n" for p in state.curve))
        if run.tracking and metrics:
            run.accelerator.log({f"curve/{key}": value for key, value in metrics.items()}, step=state.global_step)
    return point


def checkpoint(run: Run) -> None:
    start = time.perf_counter()
    save_checkpoint(run)
    run.state.add_time("checkpoint_s", time.perf_counter() - start)  # (not in the checkpoint it times)


def format_metrics(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
