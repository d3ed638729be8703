"""One run of a sweep or a tune, and the executors that train runs, whatever the backend.

:func:`run_one` trains a claimed run and records its outcome (a finished result.json adopted, a checkpoint resumed,
anything else replaced) into the store, or into an :class:`Outcome` where it trains away from the store (another
process, a Ray worker) and the claiming process records what comes back (:func:`record`). Every executor has
the same calls (:class:`Executor`): :class:`InProcess` trains here, one run at a time; :class:`Detached` claims
each run here and trains it elsewhere (:mod:`peftlab.lab.sweep_workers`, :mod:`peftlab.lab.ray_backend`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import importlib
import inspect
import os
import sqlite3
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Protocol

from peftlab.errors import PeftlabError
from peftlab.lab.store import Store, StoreWriteError, config_key, short_key
from peftlab.lab.store_schema import (
    FINISHED, RESULT_STATUSES, effective_status, epochs_run, is_pruned_result, move_run_folder, pruned_dir)

DEFAULT_TRAIN = "peftlab.training.loop:train"
OUT_OF_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}  # a full disk, a file-size limit, a quota
DISK_FIX = ("free disk space (or raise the quota or file-size limit), then rerun the same command: unfinished "
            "runs are pending again and resume from their last checkpoint; finished runs are kept")


# --------------------------------------------------------------------------- the train function


def resolve_train_fn(train_fn: Callable | str | None) -> Callable:
    if callable(train_fn):
        return train_fn
    module_name, _, attr = (train_fn or DEFAULT_TRAIN).partition(":")
    return getattr(importlib.import_module(module_name), attr)


def train_fn_name(train_fn: Callable | str | None) -> str:
    """``module:attr`` of a train function, for a process that imports it again (a worker, a Ray task)."""
    if train_fn is None or isinstance(train_fn, str):
        return train_fn or DEFAULT_TRAIN
    name = f"{train_fn.__module__}:{train_fn.__qualname__}"
    if train_fn.__module__ == "__main__" or "<" in train_fn.__qualname__:
        raise ValueError(f"--workers needs an importable train function, got {name}")
    return name


def with_epoch_hook(train_fn: Callable, hook: Callable | None) -> Callable:
    """``train_fn`` with ``on_epoch_end=hook`` when it takes one (peftlab's loop does; a test double may not)."""
    if hook is None:
        return train_fn
    try:
        takes_hook = "on_epoch_end" in inspect.signature(train_fn).parameters
    except (TypeError, ValueError):
        takes_hook = False
    return functools.partial(train_fn, on_epoch_end=hook) if takes_hook else train_fn


# --------------------------------------------------------------------------- one run


def _dir_config_key(out: Path) -> str | None:
    """The key of the config an existing run folder was started with, or None."""
    import yaml

    try:
        data = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return config_key(data) if isinstance(data, dict) else None


def run_one(run_config: dict, key: str, train_fn: Callable, store, *, adopt_pruned: bool = False) -> str:
    """Run a claimed run and record its outcome into ``store`` (a :class:`Store` or an :class:`Outcome`); returns
    the status. A pruned result in its folder is adopted only with ``adopt_pruned`` (a tune trial killed before it
    was recorded); a sweep's cell needs the complete run, so that folder is renamed aside and the run trains afresh.
    """
    from peftlab.resolve import resolved_from_dict
    from peftlab.training import run_folder as runfiles

    out = Path(run_config["output_dir"])
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
        resume = out.is_dir() and _dir_config_key(out) == key and runfiles.has_checkpoint(out)
        overwrite = out.is_dir() and not resume
        # the config its spec resolved (store row): the run is not resolved again
        cfg = resolved_from_dict({**run_config, "resume": resume, "overwrite": overwrite})
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
def output_to(path: Path | None):
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
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def log_path(log_dir: Path | None, key: str) -> Path | None:
    """``<log_dir>/<short key>.log``: where a run's output goes (None: left on the console)."""
    return Path(log_dir) / f"{short_key(key)}.log" if log_dir is not None else None


def attempt(run: dict, store: Store, train_fn: Callable, log: Path | None, *,
            adopt_pruned: bool = False, wait_if_held: bool = True, poll_seconds: float = 1.0) -> str | None:
    """Claim ``run`` and run it here (:func:`run_one`); None when it was not claimable. With ``wait_if_held`` (a
    tune's run, whose outcome the caller reads next) a run another live process holds is waited for, and claimed
    here should its holder stop; a sweep passes False and waits for such runs after every other run."""
    row = store.claim(run["key"])
    while row is None and wait_if_held and held_by_another(store, run["key"]):
        time.sleep(poll_seconds)
        store.prepare([run["key"]])  # a holder that died meanwhile: pending again
        row = store.claim(run["key"])
    if row is None:
        return None
    try:
        with output_to(log):
            if log is not None:
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


def no_space_error(why: str, key: str) -> PeftlabError:
    return PeftlabError(f"no space left for run {short_key(key)}: {why}", fix=DISK_FIX)


def held_by_another(store: Store, key: str) -> bool:
    """Whether another live process (its heartbeat in the store is fresh; any machine) holds ``key`` running."""
    row = store.get(key)
    return bool(row) and row["status"] == "running" and row["owner"] != store.owner and store.holder_alive(row["owner"])


# --------------------------------------------------------------------------- a run away from the store


def limit_threads(threads: int) -> None:
    """A worker's share of the CPU threads, and no tokenizer threads of its own."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        torch.set_num_threads(max(1, threads))
    except ImportError:  # pragma: no cover - a test double of the train function
        pass


class Outcome:
    """Stands in for the Store where a run trains away from it: :func:`run_one` records into it, and the
    process that claimed the run writes the store (:func:`record`)."""

    def __init__(self):
        self.result: dict | None = None
        self.error: str | None = None

    def finish(self, key: str, result: dict) -> bool:
        self.result = result
        return True

    def fail(self, key: str, error: str) -> bool:
        self.error = error
        return True


def run_detached(run: dict, train_fn: Callable, log: Path | None, *, where: str, adopt_pruned: bool) -> dict:
    """Train a run claimed by another process; returns ``{"result"|"error", "pid"}`` for it to record.
    A full disk comes back as ``{"stop": message}``: the claimer hands the run back and stops."""
    outcome = Outcome()
    try:
        with output_to(log):
            print(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} run {short_key(run['key'])} {where} "
                  f"(pid {os.getpid()}, host {os.uname().nodename})", flush=True)
            run_one(run["config"], run["key"], train_fn, outcome, adopt_pruned=adopt_pruned)
    except PeftlabError as err:  # a full disk: not the run's fault, never recorded failed
        return {"stop": str(err), "pid": os.getpid()}
    except OSError as err:  # the log itself could not be written
        full = out_of_space(err)
        if full is None:
            raise
        return {"stop": str(no_space_error(full, run["key"])), "pid": os.getpid()}
    return {"result": outcome.result, "error": outcome.error, "pid": os.getpid()}


def record(store, key: str, outcome: dict) -> str:
    """Write a detached run's outcome into the claimer's store; returns the status recorded. A pruned trial's
    row moves to its pruned key and its folder is renamed (``Store.finish``; the folder must be visible here,
    as every run folder is on a cluster's shared file system); ``store.find(key)`` reads it back."""
    result = outcome.get("result")
    if result is not None:
        store.finish(key, result)
        return effective_status(result["status"], result)
    store.fail(key, outcome.get("error") or "the run returned no result")
    return "failed"


# --------------------------------------------------------------------------- executors


class Executor(Protocol):
    """How a sweep or a tune trains its runs; ``reporter`` (a tune trial's) has ``hook()``, the run's
    ``on_epoch_end``."""

    slots: int  # runs it trains at once

    def __len__(self) -> int: ...  # runs submitted whose outcome wait() has not handed back yet

    def submit(self, run: dict, reporter=None) -> bool: ...  # False: another live process holds the run

    def wait(self, timeout: float) -> list[str]: ...  # keys whose outcome is now in the store

    def abort(self) -> None: ...  # hand back every run in flight (pending again: the rerun resumes them)

    def close(self) -> None: ...  # after the last run (or abort)


class InProcess:
    """Trains one run at a time in this process (claimed when its turn comes), its output in its log.
    ``wait_if_held``: a run another live process holds is waited for (see :func:`attempt`)."""

    slots = 1

    def __init__(self, store: Store, train_fn: Callable | str | None, log_dir: Path | None, *,
                 wait_if_held: bool = True):
        self.store, self.log_dir, self.wait_if_held = store, log_dir, wait_if_held
        self.train_fn = resolve_train_fn(train_fn)
        self.queue: list[tuple[dict, object]] = []

    def __len__(self) -> int:
        return len(self.queue)

    def submit(self, run: dict, reporter=None) -> bool:
        self.queue.append((run, reporter))
        return True

    def wait(self, timeout: float) -> list[str]:
        run, reporter = self.queue.pop(0)
        fn = with_epoch_hook(self.train_fn, reporter.hook() if reporter is not None else None)
        # claims, runs and records (released again on Ctrl-C); a trial's own pruned result.json, left by a kill
        # before it was recorded, is its outcome (adopted), never that of a plain re-run
        attempt(run, self.store, fn, log_path(self.log_dir, run["key"]), adopt_pruned=reporter is not None,
                wait_if_held=self.wait_if_held)
        return [run["key"]]

    def abort(self) -> None:
        self.queue.clear()

    def close(self) -> None:
        pass


class Detached:
    """Claims each run in this process (the only writer of the store) and trains it elsewhere; records what
    comes back. A backend supplies ``start(run, reporter)`` and ``finished(timeout) -> [(key, outcome)]``,
    and ``cancel()`` (stop everything in flight)."""

    slots = 1

    def __init__(self, store: Store):
        self.store = store
        self.claimed: set[str] = set()
        self.stopped: str | None = None  # the first full-disk message a run came back with

    def __len__(self) -> int:
        return len(self.claimed)

    def submit(self, run: dict, reporter=None) -> bool:
        if self.store.claim(run["key"]) is None:
            return False
        self.claimed.add(run["key"])
        try:
            self.start(run, reporter)
        except BaseException:
            self.claimed.discard(run["key"])
            self.store.release(run["key"])
            raise
        return True

    def wait(self, timeout: float) -> list[str]:
        done = self._record(self.finished(timeout))
        while self.stopped and self.claimed:  # stopping: the runs in flight end (and are recorded) first
            done += self._record(self.finished(timeout))
        if self.stopped:
            raise PeftlabError(self.stopped)
        return done

    def _record(self, outcomes: list[tuple[str, dict[str, Any]]]) -> list[str]:
        for key, outcome in outcomes:
            self.claimed.discard(key)
            if "stop" in outcome:  # handed back, never recorded failed; the caller stops with the message
                self.store.release(key)
                self.stopped = self.stopped or outcome["stop"]
            else:
                record(self.store, key, outcome)
        return [key for key, _ in outcomes]

    def abort(self) -> None:
        self.cancel()
        for key in self.claimed:  # handed back: the rerun resumes their checkpoints
            with contextlib.suppress(PeftlabError):
                self.store.release(key)
        self.claimed.clear()

    def close(self) -> None:
        pass

    # a backend's part
    def start(self, run: dict, reporter) -> None:
        raise NotImplementedError

    def finished(self, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError
