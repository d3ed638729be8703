"""``peftlab sweep --workers N``: each run in a fresh spawned process (``concurrent.futures``, one task per child).

The sweep's process claims and records every run (the only writer of the store); a worker trains one run and
exits, so no run inherits another's memory, threads or compiled code. Each slot is its own one-process pool: a
worker that dies breaks only its pool, so its run is known and recorded failed while the others go on. A worker
exits when the sweep dies: a SIGKILLed sweep must not leave runs training into folders its rerun resumes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable

from peftlab.lab.runner import Detached, limit_threads, log_path, resolve_train_fn, run_detached, train_fn_name
from peftlab.lab.store import Store, short_key

PARENT_POLL_SECONDS = 0.5


def _die_with(parent_pid: int) -> None:
    """In a worker: exit as soon as the sweep that started it is gone (it is then re-parented)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(1)


def start_worker(parent_pid: int, threads: int, pids) -> None:
    """A worker's initializer: its pid to the sweep (which may have to stop it), its share of the CPU threads,
    and the watch on its parent."""
    if os.getppid() != parent_pid:  # the parent died before the worker started
        os._exit(1)
    pids.put(os.getpid())
    threading.Thread(target=_die_with, args=(parent_pid,), daemon=True, name="peftlab-parent-watch").start()
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    limit_threads(int(os.environ["OMP_NUM_THREADS"]))


def train_in_worker(run: dict, fn_name: str, log: str | None) -> dict:
    return run_detached(run, resolve_train_fn(fn_name), Path(log) if log else None, where="in a sweep worker",
                        adopt_pruned=False)


class LocalProcesses(Detached):
    """``workers`` runs at a time, each in a fresh spawned process of this machine."""

    def __init__(self, store: Store, train_fn: Callable | str | None, log_dir: Path | None, *, workers: int,
                 note: Callable[[str], None] = lambda message: None):
        import multiprocessing

        super().__init__(store)
        self.slots, self.log_dir, self.note = workers, log_dir, note
        self.fn_name = train_fn_name(train_fn)
        self.context = multiprocessing.get_context("spawn")
        self.threads = max(1, (os.cpu_count() or 1) // workers)
        self.idle: list[Slot] = []
        self.busy: dict[Future, tuple[str, Slot]] = {}

    def _slot(self) -> "Slot":
        return self.idle.pop() if self.idle else Slot(self.context, self.threads)

    def start(self, run: dict, reporter) -> None:
        log = log_path(self.log_dir, run["key"])
        slot = self._slot()
        future = slot.pool.submit(train_in_worker, run, self.fn_name, str(log) if log else None)
        self.busy[future] = (run["key"], slot)

    def finished(self, timeout: float) -> list[tuple[str, dict[str, Any]]]:
        if not self.busy:
            return []
        done, _ = wait_futures(list(self.busy), timeout=timeout, return_when=FIRST_COMPLETED)
        out = []
        for future in done:
            key, slot = self.busy.pop(future)
            try:
                out.append((key, future.result()))
                self.idle.append(slot)
            except BrokenProcessPool:  # its worker died mid-run: that run is lost, the others go on
                slot.pool.shutdown(wait=False)
                self.note(f"a sweep worker died training run {short_key(key)}: marked failed")
                out.append((key, {"result": None, "error": "worker process died (killed, or it crashed: see its log)"}))
        return out

    def cancel(self) -> None:
        for future, (_, slot) in list(self.busy.items()):
            slot.stop(future)
        self.busy.clear()
        self.close()

    def close(self) -> None:
        for slot in self.idle:
            slot.pool.shutdown(wait=True)
        self.idle.clear()


class Slot:
    """A one-process pool, and the pids its workers report (one worker alive at a time: the last one)."""

    def __init__(self, context, threads: int):
        self.pids = context.SimpleQueue()
        self.pool = ProcessPoolExecutor(max_workers=1, mp_context=context, max_tasks_per_child=1,
                                        initializer=start_worker, initargs=(os.getpid(), threads, self.pids))

    def stop(self, future: Future) -> None:
        """End the run in flight (Ctrl-C of the sweep; the caller hands the run back), then the pool."""
        pid = None
        while not self.pids.empty():
            pid = self.pids.get()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if pid is None or future.done():
                break
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            with contextlib.suppress(Exception):
                future.exception(timeout=10)
        self.pool.shutdown(wait=False, cancel_futures=True)
