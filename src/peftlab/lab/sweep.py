"""``peftlab sweep SPEC.yaml``: run each run of a spec once, recording every run in a results store.

The spec (base config, grid, zip groups) and how it expands into runs, keys and output folders:
:mod:`peftlab.lab.spec`. Re-running a spec (or a spec that overlaps it) skips finished runs (ok, diverged,
collapsed, no_learning), reruns unfinished ones (resuming from their checkpoint) and, with ``--retry-failed``,
failed ones. A run that raises is recorded as failed and the sweep goes on. A pruned tune trial of the same
config is never a finished cell: it is stored under another key (:func:`peftlab.lab.store.pruned_key`), and a
pruned run's folder found where the cell's run goes is renamed aside (:func:`peftlab.lab.store.pruned_dir`)
before the cell trains afresh.

Runs execute in this process (default) or in ``--workers N`` spawned processes that claim runs from the
store (``BEGIN IMMEDIATE``; :mod:`peftlab.lab.sweep_workers`); a worker that dies marks its run failed and is
replaced. Another process training runs of the same spec (a second sweep, a tune) is waited for, so a sweep
returns when every run it sees is settled. A full disk is the machine's fault, not the run's: the run is handed
back (pending, resumed next time) and the sweep stops with one line; so does a write the store refuses. Each run's output
(stdout/stderr, also of C code) goes to ``<output_dir>/logs/<short key>.log``.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib
import os
import sqlite3
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from peftlab.errors import PeftlabError
from peftlab.lab.spec import Sweep, add_output_flags, load_spec
from peftlab.lab.store import (
    FINISHED, RESULT_STATUSES, Store, StoreWriteError, config_key, epochs_run, is_pruned_result, move_run_folder,
    pruned_dir, short_key)

DEFAULT_TRAIN = "peftlab.training.loop:train"
OUT_OF_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}  # a full disk, a file-size limit, a quota


# --------------------------------------------------------------------------- one run


def resolve_train_fn(train_fn: Callable | str | None) -> Callable:
    if callable(train_fn):
        return train_fn
    module_name, _, attr = (train_fn or DEFAULT_TRAIN).partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _train_fn_name(train_fn: Callable | str | None) -> str:
    if train_fn is None or isinstance(train_fn, str):
        return train_fn or DEFAULT_TRAIN
    name = f"{train_fn.__module__}:{train_fn.__qualname__}"
    if train_fn.__module__ == "__main__" or "<" in train_fn.__qualname__:
        raise ValueError(f"--workers needs an importable train function, got {name}")
    return name


def _dir_config_key(out: Path) -> str | None:
    """The key of the config an existing run folder was started with, or None."""
    import yaml

    try:
        data = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return config_key(data) if isinstance(data, dict) else None


def run_one(run_config: dict, key: str, train_fn: Callable, store: Store, *, adopt_pruned: bool = False) -> str:
    """Run a claimed run (already marked running by this process) and record its outcome; returns the status.

    An output folder from an earlier attempt is reused: a finished result.json is adopted, a checkpoint
    is resumed, anything else (or a folder of another config) is replaced. A pruned result there is adopted
    only with ``adopt_pruned`` (a tune trial killed before it was recorded); otherwise (a sweep's cell: it
    needs the complete run) that folder is renamed aside to its pruned name and the run trains afresh.
    """
    from peftlab.training import run_folder as runfiles
    from peftlab.config import TrainConfig, build_config

    out = Path(run_config["output_dir"])
    overrides = {k: v for k, v in run_config.items() if k not in ("resume", "overwrite")}
    try:
        existing = runfiles.read_result(out)
        same_run = bool(existing) and config_key(existing.get("config") or {}) == key
        if same_run and is_pruned_result(existing) and not adopt_pruned:
            aside = pruned_dir(out, epochs_run(existing))
            move_run_folder(out, aside)
            print(f"{out} held a pruned trial of this config (moved to {aside}): training the complete run")
        elif same_run and existing.get("status") in FINISHED:
            print(f"adopting the finished result in {out}")
            store.finish(key, existing)
            return existing["status"]
        same_config = _dir_config_key(out) == key
        resume = out.is_dir() and same_config and runfiles.has_checkpoint(out)
        overwrite = out.is_dir() and not resume
        cfg = build_config(TrainConfig, overrides={**overrides, "resume": resume, "overwrite": overwrite})
        if resume:
            print(f"resuming {out} from its checkpoint")
        result = train_fn(cfg)
        if not isinstance(result, dict) or result.get("status") not in RESULT_STATUSES:
            raise RuntimeError(f"the train function returned no valid result (status "
                               f"{result.get('status') if isinstance(result, dict) else type(result).__name__})")
        if result["status"] == "failed" and not result.get("status_reason"):
            result = {**result, "status_reason": "the run reported status failed"}
        store.finish(key, result)
        return result["status"]
    except StoreWriteError:
        raise  # the store refused a write: nothing more can be recorded; the caller hands the run back
    except Exception as err:  # noqa: BLE001 - any failure of one run is recorded; the sweep goes on
        full = out_of_space(err)
        if full is not None:  # the machine's fault, not the run's: never recorded failed (the caller releases it)
            raise no_space_error(full, key) from None
        with contextlib.suppress(OSError):  # the log may be on the full disk too
            traceback.print_exc()
        message = str(err) if isinstance(err, PeftlabError) else f"{type(err).__name__}: {err}"
        store.fail(key, " ".join(message.split())[:2000] or type(err).__name__)
        return "failed"
    finally:
        gc.collect()


@contextlib.contextmanager
def _output_to(path: Path | None):
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C output too) to ``path``."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with open(path, "a", buffering=1) as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:  # Python-level streams too, in case they are not file descriptors 1/2 (pytest, notebooks)
                with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                    yield
            finally:
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _attempt(run: dict, store: Store, train_fn: Callable, log_path: Path | None, *,
             adopt_pruned: bool = False, wait_if_held: bool = True, poll_seconds: float = 1.0) -> str | None:
    """Claim ``run`` and run it (:func:`run_one`); None when it was not claimable: finished, failed, or held by
    another live process. With ``wait_if_held`` (a tune's trial or seed re-run, whose outcome the caller reads
    next) a run another process on this machine holds is waited for: then its outcome is in the store, or it
    is pending again (its holder died or gave it back) and is claimed here. A sweep's own rounds pass False
    and wait for such runs after every other run (:func:`_next_round`)."""
    row = store.claim(run["key"])
    while row is None and wait_if_held and _held_on_this_host(store, run["key"]):
        time.sleep(poll_seconds)
        store.prepare([run["key"]])  # a holder that died meanwhile: pending again
        row = store.claim(run["key"])
    if row is None:
        return None
    try:
        with _output_to(log_path):
            if log_path is not None:
                print(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} run {short_key(run['key'])} attempt "
                      f"{row['attempts'] + 1} (pid {os.getpid()})", flush=True)
            return run_one(run["config"], run["key"], train_fn, store, adopt_pruned=adopt_pruned)
    except BaseException as err:  # Ctrl-C, SystemExit, a full disk: hand the run back for the next sweep
        with contextlib.suppress(PeftlabError):  # if even that write fails, its dead owner frees it later
            store.release(run["key"])
        full = None if isinstance(err, PeftlabError) else out_of_space(err)
        if full is not None:  # e.g. the run's log could not be written
            raise no_space_error(full, run["key"]) from None
        raise


def out_of_space(err: BaseException | None) -> str | None:
    """What the full disk behind ``err`` says (no space, file too large, quota exceeded; or SQLite's disk error
    under any database layer, e.g. Optuna's SQLAlchemy), or None when ``err`` is not one."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in OUT_OF_SPACE:
            return (err.strerror or str(err)) + (f" ({err.filename})" if err.filename else "")
        if isinstance(err, sqlite3.OperationalError) and ("disk I/O error" in str(err) or "disk is full" in str(err)):
            return str(err)
        err = err.__cause__ or err.__context__
    return None


DISK_FIX = ("free disk space (or raise the quota or file-size limit), then rerun the same command: unfinished "
            "runs are pending again and resume from their last checkpoint; finished runs are kept")


def no_space_error(why: str, key: str) -> PeftlabError:
    return PeftlabError(f"no space left for run {short_key(key)}: {why}", fix=DISK_FIX)


def _held_on_this_host(store: Store, key: str) -> bool:
    import socket

    row = store.get(key)
    owner = (row or {}).get("owner") or ""
    return bool(row) and row["status"] == "running" and owner != store.owner and owner.startswith(
        socket.gethostname() + "|")


# --------------------------------------------------------------------------- the sweep


@dataclass
class SweepOutcome:
    total: int
    counts: dict[str, int]
    ran: int  # runs attempted by this invocation
    failed_keys: list[str]

    @property
    def all_finished(self) -> bool:
        return self.counts.get("pending", 0) == 0 and self.counts.get("running", 0) == 0


def run_sweep(sweep: Sweep, *, workers: int = 0, retry_failed: bool = False, train_fn: Callable | str | None = None,
              progress: bool = True, capture_output: bool = True, poll_seconds: float = 1.0) -> SweepOutcome:
    """Run every unfinished run of ``sweep``; the train function is injectable (callable or "module:attr")."""
    from tqdm.auto import tqdm

    sweep.output_root.mkdir(parents=True, exist_ok=True)
    store = Store(sweep.store_path)
    store.register((run.key, run.config, run.output_dir) for run in sweep.runs)
    reset = store.prepare(sweep.keys, retry_failed=retry_failed)
    keys = sweep.keys
    counts = store.counts(keys)
    done_before = sum(counts[s] for s in FINISHED) + counts["failed"]
    log_dir = sweep.log_dir if capture_output else None
    bar_file = os.fdopen(os.dup(2), "w") if progress else None
    bar = tqdm(total=len(keys), initial=done_before, desc="sweep", unit="run", file=bar_file, disable=not progress,
               dynamic_ncols=True, smoothing=0.1)

    def note(message: str) -> None:
        if progress:
            bar.write(message, file=bar_file)

    if reset["running"]:
        note(f"resuming {reset['running']} run(s) left unfinished by a killed sweep")
    if reset["failed"]:
        note(f"retrying {reset['failed']} failed run(s)")
    if counts["running"] - reset["running"] > 0:
        note(f"{counts['running'] - reset['running']} run(s) are running in another live process: left to it "
             "(this sweep waits for those on this machine)")
    by_key = {run.key: run for run in sweep.runs}
    to_run = {k for k, s in store.statuses().items() if s == "pending" and k in by_key}
    reported: set[str] = set()

    def refresh() -> dict[str, int]:
        now = store.counts(keys)
        bar.update(sum(now[s] for s in FINISHED) + now["failed"] - bar.n)
        bar.set_postfix({s: now[s] for s in ("ok", "diverged", "collapsed", "no_learning", "failed") if now[s]},
                        refresh=True)
        for row in store.rows(parse=False):
            if row["key"] not in to_run or row["key"] in reported or row["status"] not in (*FINISHED, "failed"):
                continue
            reported.add(row["key"])
            run = by_key[row["key"]]
            if row["status"] == "failed":
                log = f" (log: {log_dir / (short_key(row['key']) + '.log')})" if log_dir else ""
                note(f"run {short_key(row['key'])} ({run.describe()}) failed: {row['error']}{log}")
            else:
                note(f"run {short_key(row['key'])} ({run.describe()}): {row['status']}, {finished_summary(row)}")
        return now

    try:
        fn = resolve_train_fn(train_fn) if workers <= 0 else None
        round_keys: set[str] | None = set(to_run)
        while round_keys is not None:  # a round runs what is pending; then what others left (see _next_round)
            to_run |= round_keys
            payload = [{"key": run.key, "config": run.config} for run in sweep.runs if run.key in round_keys]
            if workers <= 0:
                for run in payload:
                    log = log_dir / f"{short_key(run['key'])}.log" if log_dir else None
                    _attempt(run, store, fn, log, wait_if_held=False)
                    refresh()
            elif payload:
                from peftlab.lab.sweep_workers import run_workers

                run_workers(sweep, store, payload, workers=min(workers, len(payload)),
                            train_fn_name=_train_fn_name(train_fn), log_dir=log_dir, refresh=refresh, note=note,
                            poll_seconds=poll_seconds)
            counts = refresh()
            round_keys = _next_round(sweep, store, note, poll_seconds=poll_seconds)
        counts = refresh()
        statuses = store.statuses()
    finally:
        bar.close()
        if bar_file is not None:
            bar_file.close()
        store.close()
    failed = [k for k in sweep.keys if k in to_run and statuses.get(k) == "failed"]
    return SweepOutcome(total=len(keys), counts=counts, ran=len(to_run), failed_keys=failed)


def _next_round(sweep: Sweep, store: Store, note, *, poll_seconds: float) -> set[str] | None:
    """After a round, what the sweep runs next; None when each of its runs is finished, failed or held on another
    machine. A run another live process on this machine holds (a second sweep, a tune) is waited for: if that
    process dies the run is pending again and this sweep resumes it; if it was a tune trial that the tune
    pruned, its row has moved to the trial's pruned key and the cell is registered again, to train the
    complete run. So a sweep returns only when every run it could see through is settled."""
    waited: set[str] = set()
    while True:
        statuses = store.statuses()
        gone = [run for run in sweep.runs if run.key not in statuses]
        if gone:
            note(f"{len(gone)} run(s) of this sweep were pruned tune trials of the same config: training the "
                 "complete run(s)")
            store.register((run.key, run.config, run.output_dir) for run in gone)
        store.prepare(sweep.keys)  # runs whose holder died since are pending again
        statuses = store.statuses()
        pending = {key for key in sweep.keys if statuses.get(key) == "pending"}
        if pending:
            return pending
        held = {key for key in sweep.keys if statuses.get(key) == "running" and _held_on_this_host(store, key)}
        if not held:
            return None
        if held - waited:
            note(f"waiting for {len(held)} run(s) of this sweep that another process on this machine is training")
            waited |= held
        time.sleep(poll_seconds)


def finished_summary(row: dict) -> str:
    """``accuracy best 0.8761 (epoch 2), final 0.8700`` from a store row's result JSON."""
    import json

    try:
        result = json.loads(row["result"]) if isinstance(row.get("result"), str) else (row.get("result") or {})
    except ValueError:
        return "result unreadable"
    name = result.get("primary_metric")
    if int((result.get("config") or {}).get("epochs") or 0) == 0:
        value = ((result.get("before") or result.get("final") or {}).get("metrics") or {}).get(name)
        return f"{name} {value:.4f} before fine-tuning" if isinstance(value, (int, float)) else f"{name} missing"
    best = (result.get("best") or {})
    value = (best.get("metrics") or {}).get(name)
    final = ((result.get("final") or {}).get("metrics") or {}).get(name)
    if not isinstance(value, (int, float)):
        return f"{name} missing"
    text = f"{name} best {value:.4f} (epoch {best.get('epoch')})"
    return text + (f", final {final:.4f}" if isinstance(final, (int, float)) else "")


# --------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "sweep", help="run a grid of fine-tuning runs into a results store",
        description="Expand SPEC.yaml (base: config keys, grid: key -> list, zip: groups of keys varying together) "
                    "and run each run once, recording it in an SQLite results store. Re-running skips finished "
                    "runs and resumes unfinished ones.")
    parser.add_argument("spec", metavar="SPEC.yaml", help="sweep spec (see configs/sweeps/)")
    parser.add_argument("--workers", type=int, default=0, metavar="N",
                        help="run in N worker processes (default 0: one run at a time in this process)")
    parser.add_argument("--retry-failed", action="store_true", help="run failed runs again")
    parser.add_argument("--dry-run", action="store_true", help="print the grid (one line per run) and its size")
    add_output_flags(parser)
    from peftlab.lab.ray_backend import add_backend_flags  # --backend ray: each run a Ray task

    add_backend_flags(parser)
    parser.set_defaults(func=run_cli)


def dry_run(sweep: Sweep) -> None:
    statuses: dict[str, str] = {}
    if sweep.store_path.is_file():
        with Store(sweep.store_path, create=False) as store:
            statuses = store.statuses()
    width = len(str(len(sweep.runs)))
    for run in sweep.runs:
        status = statuses.get(run.key, "new")
        print(f"{run.index:>{width}}  {run.short}  {status:<11}  {run.describe()}")
    # "pruned" under a cell's own key is only ever read from an unmigrated (schema-1) store: the sweep migrates
    # it, which moves the trial off the key, and runs the cell
    finished = sum(1 for run in sweep.runs if statuses.get(run.key) in FINISHED and statuses[run.key] != "pruned")
    failed = sum(1 for run in sweep.runs if statuses.get(run.key) == "failed")
    extra = f" ({sweep.duplicates} duplicate grid cells dropped)" if sweep.duplicates else ""
    print(f"{len(sweep.runs)} runs{extra}: {finished} finished, {failed} failed, "
          f"{len(sweep.runs) - finished - failed} to run -> {sweep.output_root} (store {sweep.store_path})")


def run_cli(args) -> int:
    if args.workers < 0:
        raise PeftlabError(f"--workers must be >= 0, got {args.workers}")
    sweep = load_spec(args.spec, output_dir=args.output_dir, store=args.store)
    if args.dry_run:
        dry_run(sweep)
        return 0
    from peftlab.lab import ray_backend

    ray_backend.check_backend_args(args)
    if args.backend == "ray":
        if args.workers:
            raise PeftlabError("--workers is for the local backend", fix="with --backend ray use --cpus-per-run")
        outcome = ray_backend.run_sweep_ray(sweep, ray_backend.RayOptions.from_args(args),
                                            retry_failed=args.retry_failed, capture_output=not args.verbose)
    else:
        outcome = run_sweep(sweep, workers=args.workers, retry_failed=args.retry_failed,
                            capture_output=not args.verbose)
    counts = outcome.counts
    summary = ", ".join(f"{counts[s]} {s}" for s in ("ok", "diverged", "collapsed", "no_learning", "pruned", "failed",
                                                     "pending", "running") if counts[s])
    print(f"sweep {sweep.spec_path.name}: {outcome.total} runs: {summary or 'none'}; store {sweep.store_path}")
    if counts["failed"]:
        print(f"failed runs: see {sweep.log_dir}/<key>.log; rerun them with --retry-failed", file=sys.stderr)
    print(f"table: peftlab report {sweep.store_path}")
    return 1 if counts["failed"] else 0
