"""finish: the trained weights saved (the best epoch's with ``--save best``) and result.json
(schemas/result.schema.json) written last, atomically: its presence with a final status marks a finished run."""

from __future__ import annotations

import time

from peftlab.training import run_folder as runfiles
from peftlab.training.guards import above_majority, final_status, plateau_record
from peftlab.training.setup import Run


def finish(run: Run) -> dict:
    """Save the adapter and write result.json (last: its presence marks the run finished)."""
    from peftlab.methods.saving import save_trained

    finish_start = time.perf_counter()
    unwrapped = run.accelerator.unwrap_model(run.model)
    saved_epoch = restore_best(run, unwrapped)  # --save best: adapter/ (and kasa_sigma) are the best epoch's
    test = evaluate_test(run, saved_epoch)
    result = result_record(run, unwrapped, saved_epoch)
    result["test"] = test
    timings = result["timings"]
    timings["result_s"] = time.perf_counter() - finish_start
    if run.main:
        save_start = time.perf_counter()
        save_trained(unwrapped, run.out / "adapter", base_model=run.cfg.model, applied=run.applied)
        timings["save_s"] = time.perf_counter() - save_start
        timings["finished_unix"] = time.time()
        runfiles.write_json(run.out / "result.json", result)
        runfiles.remove_checkpoint(run.out)  # the run is finished; its adapter and result are what count
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()
    return result


def result_record(run: Run, unwrapped, saved_epoch: int | None) -> dict:
    """result.json (schemas/result.schema.json) from the config, the loop state and the pipeline."""
    from peftlab.methods.table import InitStats

    cfg, state, accelerator = run.cfg, run.state, run.accelerator
    init_stats = run.applied.init_stats if run.applied is not None else InitStats()
    before = state.before
    status, status_reason = final_status(state, run.pipeline)
    result = {
        "schema_version": 1,
        "status": status,
        "status_reason": status_reason,
        "task": cfg.task, "model": cfg.model, "method": cfg.method, "targets": ",".join(cfg.targets),
        "rank": cfg.rank, "alpha": cfg.alpha, "lr": cfg.optim.lr, "lr_ratio": cfg.optim.lr_ratio,
        "head_lr": cfg.optim.head_lr,
        "group_lrs": {g["name"]: g["lr"] for g in run.groups}, "seed": cfg.seed, "epochs": cfg.epochs,
        "config": cfg.to_dict(),
        "trainable_params": run.params,
        "primary_metric": run.pipeline.primary_metric,
        "majority_baseline": run.pipeline.chance,
        "mixed_precision": accelerator.mixed_precision,  # --mixed-precision as resolved (auto: by device, size)
        "compile": run.compiled.record() if run.compiled is not None else None,  # --compile: choice, fallback, graphs
        "eval_seed": cfg.eval_seed,  # the --max-eval-samples draw; the same for every training seed
        "above_majority": above_majority(state, before, run.pipeline),
        "saved_epoch": saved_epoch,  # the epoch whose weights adapter/ holds (--save best|last)
        "num_eval_examples": run.pipeline.num_eval_examples or None,
        "epochs_log": state.epochs_log,
        "before": {"metrics": before} if before is not None else None,
        "best": state.best or {"epoch": 0, "metrics": before or {}},
        "final": {"metrics": state.epochs_log[-1]["metrics"] if state.epochs_log else (before or {})},
        "train_examples": state.train_examples,
        "skipped_steps": state.skipped_steps,  # fp16: steps the GradScaler skipped on overflow
        "stopped_early": state.stopped_early,  # an on_epoch_end hook (peftlab tune's pruner) stopped it
        "early_stopped": state.early_stopped,  # --early-stop-patience ended it (it stays ok)
        "plateau": plateau_record(state, cfg.early_stop_patience, cfg.early_stop_min_delta),
        "choice_metric": run.pipeline.choice_metric,  # what chose the best epoch (selection_<metric> or the dev's)
        "epochs_run": state.epochs_run,  # < epochs when pruned or diverged
        "curve": state.curve,  # every dev evaluation during training: --eval-steps and epoch ends
        "optimizer_steps": state.optimizer_steps,  # batches / --grad-accum
        "train_seconds": state.train_seconds,
        "train_examples_per_second": state.train_examples / state.train_seconds if state.train_seconds else None,
        "init_seconds": run.init_seconds,
        "pooling": run.pooling,  # --pooling resolved (peftlab.models.pooling)
        "calibration_seconds": init_stats.calibration_seconds,  # CorDA's forward passes
        "peak_memory_mb": runfiles.peak_memory_mb(accelerator.device),
        "device": str(accelerator.device),
        "num_processes": accelerator.num_processes,
        "versions": runfiles.versions(),
        "git_commit": runfiles.git_commit(),
        "code": runfiles.code_record(),  # commit, dirty, version, source_digest
        "train_examples_digest": run.pipeline.train_examples_digest,  # the raw training examples drawn
        **run.pipeline.extras,
        **state.eval_extras,  # what the evaluations added (e.g. the generation files they wrote)
    }
    result.update(kasa_record(state, unwrapped))
    # Per-phase wall times (setup_s, model_load_s, data_s, init_s, train_s, eval_s, checkpoint_s, save_s,
    # result_s: versions, git commit, peak memory); benchmarks/sweep_overhead.py reads them.
    result["timings"] = dict(state.timings)
    return result


def evaluate_test(run: Run, saved_epoch: int | None) -> dict | None:
    """--selection-samples: the test split's one evaluation, on the weights the run saves (the selection-best
    epoch's with --save best). Its metrics join that epoch's record (``best``, and ``final`` when it is the last
    epoch), so that a report reads them where it reads any run's; None without a selection split or an epoch."""
    from peftlab.tasks.prepare import TEST_TAG
    from peftlab.training.fit import evaluate

    state = run.state
    if run.pipeline.choice_metric == run.pipeline.primary_metric or saved_epoch is None or state.best is None:
        return None
    metrics = evaluate(run, TEST_TAG)
    if state.best.get("epoch") == saved_epoch:
        state.best = {**state.best, "metrics": {**state.best["metrics"], **metrics}}
    if state.epochs_log and state.epochs_log[-1]["epoch"] == saved_epoch:
        state.epochs_log[-1] = {**state.epochs_log[-1], "metrics": {**state.epochs_log[-1]["metrics"], **metrics}}
    return {"epoch": saved_epoch, "metrics": metrics}


def kasa_record(state, model) -> dict:
    """KaSA's learned singular values (the saved epoch's) and their values before any step; {} otherwise."""
    from peftlab.methods.kasa import singular_values

    sigma = singular_values(model)
    if not sigma:
        return {}
    if not state.kasa_sigma_init:  # absent only in a checkpoint written by an older peftlab
        return {"kasa_sigma": sigma}
    return {"kasa_sigma": sigma, "kasa_sigma_init": state.kasa_sigma_init}


def restore_best(run: Run, model) -> int | None:
    """--save best: put the best epoch's weights back before saving; returns the epoch adapter/ holds."""
    state = run.state
    last = state.epochs_log[-1]["epoch"] if state.epochs_log else None
    best = (state.best or {}).get("epoch")
    if run.cfg.save != "best" or run.best_weights is None or best is None or best == last:
        return last
    unexpected = model.load_state_dict(run.best_weights, strict=False).unexpected_keys  # the trainable tensors only
    assert not unexpected, f"the best epoch's tensors are not this model's: {unexpected[:3]}"  # never a silent no-op
    return best
