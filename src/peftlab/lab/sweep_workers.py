"""``peftlab sweep --workers N``: N spawned processes that claim runs from the results store and train them.

Each worker loops over the sweep's pending runs, claiming each in a ``BEGIN IMMEDIATE`` transaction (a run
another worker took first is skipped), and dies with the sweep (``PR_SET_PDEATHSIG``). The sweep's process
watches them: a worker that dies (the OOM killer, a crash) has its running rows marked failed and is replaced.
A worker that stops on a user-facing error (a full disk, a store that refuses writes: one line, exit status 2)
has handed its run back; the sweep starts no more workers and stops with that error.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from peftlab.errors import USER_ERROR_EXIT, PeftlabError
from peftlab.lab.store import Store, short_key


def _set_parent_death_signal() -> None:
    """Linux: die with the parent (a SIGKILLed sweep must not leave workers training in the background)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(store_path: str, runs: list[dict], train_fn_name: str, log_dir: str | None, threads: int,
                parent_pid: int) -> None:
    try:
        _work(store_path, runs, train_fn_name, log_dir, threads, parent_pid)
    except PeftlabError as err:  # one line, as the CLI prints it; the run was handed back
        print(f"peftlab: error: {err}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)


def _work(store_path: str, runs: list[dict], train_fn_name: str, log_dir: str | None, threads: int,
          parent_pid: int) -> None:
    from peftlab.lab.sweep import _attempt, resolve_train_fn

    _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    train_fn = resolve_train_fn(train_fn_name)
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    except ImportError:  # pragma: no cover - a fake train function in tests
        pass
    store = Store(store_path)
    order = [run["key"] for run in runs]
    by_key = {run["key"]: run for run in runs}
    while True:
        statuses = store.statuses()
        candidates = [key for key in order if statuses.get(key) == "pending"]
        if not candidates:
            break
        for key in candidates:  # a run another worker took first is skipped by _attempt
            log = Path(log_dir) / f"{short_key(key)}.log" if log_dir else None
            _attempt(by_key[key], store, train_fn, log, wait_if_held=False)
    store.close()




def run_workers(sweep, store: Store, payload: list[dict], *, workers: int, train_fn_name: str,
                 log_dir: Path | None, refresh, note, poll_seconds: float) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // workers)
    args = (str(sweep.store_path), payload, train_fn_name, str(log_dir) if log_dir else None, threads, os.getpid())

    def start():
        proc = ctx.Process(target=worker_main, args=args, daemon=True, name="peftlab-sweep-worker")
        proc.start()
        return proc

    procs = [start() for _ in range(workers)]
    deaths, stopped = 0, 0
    try:
        while procs:
            time.sleep(poll_seconds)
            for proc in list(procs):
                if proc.is_alive():
                    continue
                proc.join()
                procs.remove(proc)
                if proc.exitcode == USER_ERROR_EXIT:  # it printed its one line and handed its run back
                    stopped += 1
                elif proc.exitcode != 0:
                    deaths += 1
                    how = f"signal {-proc.exitcode}" if proc.exitcode < 0 else f"exit status {proc.exitcode}"
                    lost = store.fail_owned_by(proc.pid, f"worker process died ({how})")
                    note(f"a sweep worker died ({how}); {len(lost)} run(s) marked failed")
                    if store.counts([p["key"] for p in payload])["pending"] and deaths < len(payload) \
                            and not stopped:
                        procs.append(start())
            refresh()
        if stopped:
            raise PeftlabError(f"{stopped} sweep worker(s) stopped on the error printed above; their runs are "
                               "pending again", fix="fix that, then rerun the same command: it resumes")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
