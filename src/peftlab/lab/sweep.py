"""``peftlab sweep SPEC.yaml``: run each run of a spec once, recording every run in a results store.

The spec (base config, grid, zip groups) and how it expands into runs, keys and output folders:
:mod:`peftlab.lab.spec`. Re-running a spec (or a spec that overlaps it) skips finished runs (ok, diverged,
collapsed, no_learning), reruns unfinished ones (resuming from their checkpoint) and, with ``--retry-failed``,
failed ones. A run that raises is recorded as failed and the sweep goes on. A pruned tune trial of the same
config is never a finished cell: it is stored under another key (:func:`peftlab.lab.store.pruned_key`), and a
pruned run's folder found where the cell's run goes is renamed aside (:func:`peftlab.lab.store.pruned_dir`)
before the cell trains afresh.

Runs execute in this process (default) or in ``--workers N`` spawned processes that claim runs from the
store (``BEGIN IMMEDIATE``); a worker that dies marks its run failed and is replaced. Each run's output
(stdout/stderr, also of C code) goes to ``<output_dir>/logs/<short key>.log``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from peftlab.errors import PeftlabError
from peftlab.lab.spec import Sweep, add_output_flags, load_spec
from peftlab.lab.store import (
    FINISHED, RESULT_STATUSES, Store, config_key, epochs_run, is_pruned_result, move_run_folder, pruned_dir, short_key)

DEFAULT_TRAIN = "peftlab.training.loop:train"


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
    except Exception as err:  # noqa: BLE001 - any failure of one run is recorded; the sweep goes on
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
             adopt_pruned: bool = False) -> str | None:
    """Claim ``run`` and run it (:func:`run_one`); None when it was not claimable (finished, or another process
    has it)."""
    row = store.claim(run["key"])
    if row is None:
        return None
    with _output_to(log_path):
        if log_path is not None:
            print(f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} run {short_key(run['key'])} attempt "
                  f"{row['attempts'] + 1} (pid {os.getpid()})", flush=True)
        try:
            return run_one(run["config"], run["key"], train_fn, store, adopt_pruned=adopt_pruned)
        except BaseException:  # Ctrl-C or SystemExit: hand the run back for the next sweep
            store.release(run["key"])
            raise


# --------------------------------------------------------------------------- workers


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


def _worker_main(store_path: str, runs: list[dict], train_fn_name: str, log_dir: str | None, threads: int,
                 parent_pid: int) -> None:
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
            _attempt(by_key[key], store, train_fn, log)
    store.close()


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
        note(f"{counts['running'] - reset['running']} run(s) are running in another live process: not touched")
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

    payload = [{"key": run.key, "config": run.config} for run in sweep.runs if run.key in to_run]
    try:
        if workers <= 0:
            fn = resolve_train_fn(train_fn)
            for run in payload:
                log = log_dir / f"{short_key(run['key'])}.log" if log_dir else None
                _attempt(run, store, fn, log)
                refresh()
        elif payload:
            _run_workers(sweep, store, payload, workers=min(workers, len(payload)),
                         train_fn_name=_train_fn_name(train_fn), log_dir=log_dir, refresh=refresh, note=note,
                         poll_seconds=poll_seconds)
        counts = refresh()
        statuses = store.statuses()
    finally:
        bar.close()
        if bar_file is not None:
            bar_file.close()
        store.close()
    failed = [k for k in sweep.keys if k in to_run and statuses.get(k) == "failed"]
    return SweepOutcome(total=len(keys), counts=counts, ran=len(to_run), failed_keys=failed)


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


def _run_workers(sweep: Sweep, store: Store, payload: list[dict], *, workers: int, train_fn_name: str,
                 log_dir: Path | None, refresh, note, poll_seconds: float) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // workers)
    args = (str(sweep.store_path), payload, train_fn_name, str(log_dir) if log_dir else None, threads, os.getpid())

    def start():
        proc = ctx.Process(target=_worker_main, args=args, daemon=True, name="peftlab-sweep-worker")
        proc.start()
        return proc

    procs = [start() for _ in range(workers)]
    deaths = 0
    try:
        while procs:
            time.sleep(poll_seconds)
            for proc in list(procs):
                if proc.is_alive():
                    continue
                proc.join()
                procs.remove(proc)
                if proc.exitcode != 0:
                    deaths += 1
                    how = f"signal {-proc.exitcode}" if proc.exitcode < 0 else f"exit status {proc.exitcode}"
                    lost = store.fail_owned_by(proc.pid, f"worker process died ({how})")
                    note(f"a sweep worker died ({how}); {len(lost)} run(s) marked failed")
                    if store.counts([p["key"] for p in payload])["pending"] and deaths < len(payload):
                        procs.append(start())
            refresh()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


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
