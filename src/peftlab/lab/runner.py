"""One run of a sweep or a tune, and the executors that train runs, whatever the backend.

:func:`run_one` trains a claimed run and returns its outcome (a finished result.json adopted, a checkpoint resumed,
anything else replaced). An :class:`Executor` claims each run in this process (the only writer of the store), has
it trained (:class:`InProcess`: here, one at a time; :mod:`peftlab.lab.sweep_workers`: spawned processes;
:mod:`peftlab.lab.ray_backend`: Ray tasks) and records what comes back (:func:`record`); :func:`train_all` feeds
one, for a sweep and a tune alike (:func:`peftlab.lab.sweep.executor_for` picks the executor).
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any, Callable

from peftlab.errors import PeftlabError
from peftlab.lab.store import Store, config_key, short_key
from peftlab.lab.store_schema import (
    FINISHED, RESULT_STATUSES, effective_status, epochs_run, is_pruned_result, move_run_folder, pruned_dir)

DEFAULT_TRAIN = "peftlab.training.loop:train"
HELD_POLL_SECONDS = 1.0
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


def require_epoch_hook(train_fn: Callable | str | None) -> None:
    """A tune prunes through its train function's ``on_epoch_end``: one without it is refused before any trial."""
    fn = resolve_train_fn(train_fn)
    if not any(p.name == "on_epoch_end" or p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
        raise PeftlabError(f"the train function {fn.__qualname__} takes no on_epoch_end, through which a tune prunes "
                           "its trials", fix="give it an on_epoch_end=None keyword, called after each epoch")


def with_epoch_hook(train_fn: Callable, reporter) -> Callable:
    """``train_fn`` with ``on_epoch_end=reporter.hook()`` (a tune trial's; a tune's train function takes one)."""
    return train_fn if reporter is None else functools.partial(train_fn, on_epoch_end=reporter.hook())


# --------------------------------------------------------------------------- one run


def _dir_config_key(out: Path) -> str | None:
    """The key of the config an existing run folder was started with, or None."""
    import yaml

    try:
        data = yaml.safe_load((out / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return config_key(data) if isinstance(data, dict) else None


def run_one(run_config: dict, key: str, train_fn: Callable, *, adopt_pruned: bool = False) -> dict:
    """Run a claimed run; returns ``{"result": result}`` or ``{"error": why}`` for :func:`record`. A pruned result
    in its folder is adopted only with ``adopt_pruned`` (a tune trial killed before it was recorded); a sweep's
    cell needs the complete run, so that folder is renamed aside and the run trains afresh."""
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
            return {"result": existing}
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
        return {"result": result}
    except Exception as err:  # noqa: BLE001 - any failure of one run is recorded; the sweep goes on
        full = out_of_space(err)
        if full is not None:  # the machine's fault, not the run's: never recorded failed (the caller releases it)
            raise no_space_error(full, key) from None
        with contextlib.suppress(OSError):  # the log may be on the full disk too
            traceback.print_exc()
        message = str(err) if isinstance(err, PeftlabError) else f"{type(err).__name__}: {err}"
        return {"error": " ".join(message.split())[:2000] or type(err).__name__}
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


def run_logged(run, train_fn: Callable, log: Path | None, *, where: str, adopt_pruned: bool) -> dict:
    """Train a claimed run (here, or in a worker), its output in ``log``; returns :func:`run_one`'s outcome and
    the pid for the claimer to record. A full disk comes back as ``{"stop": message}``: the claimer hands the run
    back and stops."""
    try:
        with output_to(log):
            print(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} run {short_key(run.key)} attempt {run.attempt} "
                  f"{where} (pid {os.getpid()}, host {os.uname().nodename})", flush=True)
            outcome = run_one(run.config, run.key, train_fn, adopt_pruned=adopt_pruned)
    except PeftlabError as err:  # a full disk: not the run's fault, never recorded failed
        return {"stop": str(err), "pid": os.getpid()}
    except OSError as err:  # the log itself could not be written
        full = out_of_space(err)
        if full is None:
            raise
        return {"stop": str(no_space_error(full, run.key)), "pid": os.getpid()}
    return {**outcome, "pid": os.getpid()}


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


def limit_threads(threads: int) -> None:
    """A worker's share of the CPU threads, and no tokenizer threads of its own."""
    import torch

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(max(1, threads))


def record(store, key: str, outcome: dict) -> str:
    """Write a run's outcome into the claimer's store; returns the status recorded. A pruned trial's row moves to
    its pruned key and its folder is renamed (``Store.finish``; the folder must be visible here, as every run
    folder is on a cluster's shared file system); ``store.find(key)`` reads it back."""
    result = outcome.get("result")
    if result is not None:
        store.finish(key, result)
        return effective_status(result["status"], result)
    store.fail(key, outcome.get("error") or "the run returned no result")
    return "failed"


# --------------------------------------------------------------------------- executors


class Executor:
    """How a sweep or a tune trains its runs: claims each run in this process, has the backend train it and
    records what comes back. A backend supplies ``start(run, reporter)`` (a Future of :func:`run_logged`'s
    outcome; ``reporter``, a tune trial's, has ``hook()``: the run's ``on_epoch_end``), ``lost(key, err)`` (what a
    run whose process died is recorded with; any other error is raised) and ``cancel()``/``close()``.

    ``wait_if_held``: a run another live process holds is waited for, and claimed here should its holder stop (a
    tune, whose next step reads the outcome); a sweep waits for such runs after every other run."""

    slots = 1  # runs it trains at once

    def __init__(self, store: Store, log_dir: Path | None, *, wait_if_held: bool):
        self.store, self.log_dir, self.wait_if_held = store, log_dir, wait_if_held
        self.in_flight: dict[Future, str] = {}  # -> run key
        self.stopped: str | None = None  # the first full-disk message a run came back with

    def __len__(self) -> int:
        return len(self.in_flight)

    def submit(self, run, reporter=None) -> bool:
        """Claim ``run`` (a :class:`peftlab.lab.spec.Run`) and start it; False when it is not claimable (another
        process holds or settled it)."""
        key = run.key
        row = self.store.claim(key)
        while row is None and self.wait_if_held and held_by_another(self.store, key):
            time.sleep(HELD_POLL_SECONDS)
            self.store.prepare([key])  # a holder that died meanwhile: pending again
            row = self.store.claim(key)
        if row is None:
            return False
        run = dataclasses.replace(run, attempt=row["attempts"] + 1)
        try:
            self.in_flight[self.start(run, reporter)] = key
        except BaseException:  # Ctrl-C while it trains here, or it could not start: handed back
            with contextlib.suppress(PeftlabError):  # if even that write fails, its dead owner frees it later
                self.store.release(key)
            raise
        return True

    def wait(self, timeout: float) -> list[str]:
        """Keys whose outcome is now in the store; a full disk ends the runs in flight, then raises its line."""
        done = self._record(timeout)
        while self.stopped and self.in_flight:
            done += self._record(timeout)
        if self.stopped:
            raise PeftlabError(self.stopped)
        return done

    def _record(self, timeout: float) -> list[str]:
        finished, _ = wait_futures(list(self.in_flight), timeout=timeout, return_when=FIRST_COMPLETED)
        keys = []
        for future in finished:  # a run stays in flight until recorded: if that fails, abort() hands it back
            key = self.in_flight[future]
            try:
                outcome = future.result()
            except Exception as err:  # noqa: BLE001 - lost() raises what is not a dead worker
                outcome = {"result": None, "error": self.lost(key, err)}
            if "stop" in outcome:  # handed back, never recorded failed; wait() stops with the message
                self.store.release(key)
                self.stopped = self.stopped or outcome["stop"]
            else:
                record(self.store, key, outcome)
            del self.in_flight[future]
            keys.append(key)
        return keys

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, kind, err, tb) -> None:
        if kind is not None:  # the block failed (Ctrl-C too): the runs in flight are handed back
            self.abort()
        self.close()

    def abort(self) -> None:
        """Stop and hand back every run in flight (pending again: the rerun resumes their checkpoints)."""
        self.cancel()
        for key in self.in_flight.values():
            with contextlib.suppress(PeftlabError):
                self.store.release(key)
        self.in_flight.clear()

    def start(self, run, reporter) -> Future:
        raise NotImplementedError

    def lost(self, key: str, err: Exception) -> str:
        raise err

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        pass


class InProcess(Executor):
    """Trains each run in this process as it is submitted, its output in its log."""

    def __init__(self, store: Store, train_fn: Callable | str | None, log_dir: Path | None, *,
                 wait_if_held: bool = True):
        super().__init__(store, log_dir, wait_if_held=wait_if_held)
        self.train_fn = resolve_train_fn(train_fn)

    def start(self, run, reporter) -> Future:
        # a trial's own pruned result.json, left by a kill before it was recorded, is its outcome (adopted), never
        # that of a plain re-run
        future: Future = Future()
        future.set_result(run_logged(run, with_epoch_hook(self.train_fn, reporter), log_path(self.log_dir, run.key),
                                     where="in this process", adopt_pruned=reporter is not None))
        return future


def train_all(executor: Executor, next_run: Callable[[], tuple[Any, Any] | None], on_done: Callable[[str], None],
              *, poll: float) -> None:
    """Give ``executor`` the runs ``next_run()`` hands out (``(run, reporter)``; None: none for now) while it has
    room, until none is in flight; ``on_done(key)`` once each is settled (here, or by a process that held it)."""
    while True:
        while len(executor) < executor.slots and (item := next_run()) is not None:
            if not executor.submit(*item):
                on_done(item[0].key)
        if not len(executor):
            return
        for key in executor.wait(poll):
            on_done(key)
