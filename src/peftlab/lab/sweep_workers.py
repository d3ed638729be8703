"""``peftlab sweep --workers N``: each run in a fresh spawned process (``concurrent.futures``).

The sweep's process claims and records every run (the only writer of the store); a worker trains one run and
exits, so no run inherits another's memory, threads or compiled code. Each run has its own one-process pool: a
worker that dies breaks only its pool, so its run is known and recorded failed while the others go on. A worker
exits when the sweep dies: a SIGKILLed sweep must not leave runs training into folders its rerun resumes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Callable

from peftlab.lab.runner import Executor, limit_threads, log_path, resolve_train_fn, run_logged, train_fn_name
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


def train_in_worker(run, fn_name: str, log: str | None) -> dict:
    return run_logged(run, resolve_train_fn(fn_name), Path(log) if log else None, where="in a sweep worker",
                      adopt_pruned=False)


class LocalProcesses(Executor):
    """``workers`` runs at a time, each in a fresh spawned process of this machine."""

    def __init__(self, store: Store, train_fn: Callable | str | None, log_dir: Path | None, *, workers: int,
                 note: Callable[[str], None], wait_if_held: bool = False):
        import multiprocessing

        super().__init__(store, log_dir, wait_if_held=wait_if_held)
        self.slots, self.note = workers, note
        self.fn_name = train_fn_name(train_fn)
        self.context = multiprocessing.get_context("spawn")
        self.threads = max(1, (os.cpu_count() or 1) // workers)
        self.workers: dict[Future, tuple[ProcessPoolExecutor, object]] = {}  # -> its pool, the queue of its pid

    def start(self, run, reporter) -> Future:
        for done in [future for future in self.workers if future.done()]:  # its worker has exited (or died)
            self.workers.pop(done)[0].shutdown(wait=True)  # joins what is left of it
        log = log_path(self.log_dir, run.key)
        pids = self.context.SimpleQueue()
        pool = ProcessPoolExecutor(max_workers=1, mp_context=self.context, initializer=start_worker,
                                   initargs=(os.getpid(), self.threads, pids))
        future = pool.submit(train_in_worker, run, self.fn_name, str(log) if log else None)
        future.add_done_callback(lambda _: pool.shutdown(wait=False))  # its worker exits as soon as the run ends
        self.workers[future] = (pool, pids)
        return future

    def lost(self, key: str, err: Exception) -> str:
        if not isinstance(err, BrokenProcessPool):
            raise err
        self.note(f"a sweep worker died training run {short_key(key)}: marked failed")
        return "worker process died (killed, or it crashed: see its log)"

    def cancel(self) -> None:
        """End the runs in flight (Ctrl-C of the sweep; they are handed back), then their pools."""
        for future, (pool, pids) in list(self.workers.items()):
            pid = None if pids.empty() else pids.get()  # its one worker's
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if pid is None or future.done():
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                with contextlib.suppress(Exception):
                    future.exception(timeout=10)
            pool.shutdown(wait=False, cancel_futures=True)
        self.workers.clear()

    def close(self) -> None:
        for pool, _ in self.workers.values():
            pool.shutdown(wait=True)
        self.workers.clear()
