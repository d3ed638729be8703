"""``peftlab sweep SPEC.yaml``: run each run of a spec (:mod:`peftlab.lab.spec`) once, recording it in a results store.

A rerun skips finished runs, resumes unfinished ones and, with ``--retry-failed``, reruns failed ones; a run that
raises is recorded failed and the sweep goes on. Runs train through an executor (:mod:`peftlab.lab.runner`): in
this process, ``--workers N`` processes (:mod:`peftlab.lab.sweep_workers`) or Ray tasks
(:mod:`peftlab.lab.ray_backend`). Runs another process holds are waited for, so a sweep returns when every run it
sees is settled. A full disk is the machine's fault, not the run's: the run is handed back (pending) and the sweep
stops with one line. Each run's output (C code's too) goes to ``<output_dir>/logs/<short key>.log``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from peftlab.argtypes import nonnegative_int
from peftlab.errors import PeftlabError
from peftlab.lab.runner import Executor, InProcess, held_by_another, log_path, train_all
from peftlab.lab.spec import Sweep, add_spec_flags, load_spec
from peftlab.lab.store import Store, short_key
from peftlab.lab.store_schema import FINISHED


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


def executor_for(store: Store, log_dir: Path | None, note: Callable[[str], None], *, train_fn: Callable | str | None,
                 workers: int = 0, ray=None, wait_if_held: bool) -> Executor:
    """Ray tasks (``ray``: a :class:`peftlab.lab.ray_backend.RayOptions`; Ray is started or joined at the first
    run), else ``workers`` spawned processes, else this process."""
    if ray is not None:
        from peftlab.lab.ray_backend import RayTasks

        return RayTasks(store, train_fn, log_dir, ray, note=note, wait_if_held=wait_if_held)
    if workers > 0:
        from peftlab.lab.sweep_workers import LocalProcesses

        return LocalProcesses(store, train_fn, log_dir, workers=workers, note=note, wait_if_held=wait_if_held)
    return InProcess(store, train_fn, log_dir, wait_if_held=wait_if_held)


def run_sweep(sweep: Sweep, *, workers: int = 0, retry_failed: bool = False, train_fn: Callable | str | None = None,
              progress: bool = True, capture_output: bool = True, poll_seconds: float = 1.0,
              ray=None) -> SweepOutcome:
    """Run every unfinished run of ``sweep``; the train function is injectable (callable or "module:attr"). Runs
    train in this process, in ``workers`` spawned processes, or as Ray tasks (``ray``: a
    :class:`peftlab.lab.ray_backend.RayOptions`; Ray is started or joined once a run is pending)."""
    sweep.output_root.mkdir(parents=True, exist_ok=True)
    log_dir = sweep.log_dir if capture_output else None
    with Store(sweep.store_path) as store:
        store.register((run.key, run.config, run.output_dir) for run in sweep.runs)
        reset = store.prepare(sweep.keys, retry_failed=retry_failed)
        counts = store.counts(sweep.keys)
        to_run = {k for k, s in store.statuses().items() if s == "pending"} & set(sweep.keys)
        with contextlib.closing(Progress(sweep, store, to_run, log_dir, enabled=progress,
                                         done=sum(counts[s] for s in FINISHED) + counts["failed"])) as shown:
            if reset["running"]:
                shown.note(f"resuming {reset['running']} run(s) left unfinished by a killed sweep")
            if reset["failed"]:
                shown.note(f"retrying {reset['failed']} failed run(s)")
            if counts["running"] - reset["running"] > 0:
                shown.note(f"{counts['running'] - reset['running']} run(s) are running in another live process: "
                           "left to it (this sweep waits for them, and resumes any whose process stops beating)")
            # a run another process holds is waited for after every other (_next_round)
            with executor_for(store, log_dir, shown.note, train_fn=train_fn, workers=workers, ray=ray,
                              wait_if_held=False) as executor:
                round_keys: set[str] | None = set(to_run)
                while round_keys is not None:  # what is pending, then what others left
                    to_run |= round_keys
                    queue = [(run, None) for run in sweep.runs if run.key in round_keys]
                    if queue:  # Ray is started only when there is something to run
                        train_all(executor, lambda: queue.pop(0) if queue else None, lambda key: shown.refresh(),
                                  poll=poll_seconds)
                    shown.refresh()
                    round_keys = _next_round(sweep, store, shown.note, poll_seconds=poll_seconds)
            counts = shown.refresh()
        statuses = store.statuses()
    failed = [k for k in sweep.keys if k in to_run and statuses.get(k) == "failed"]
    return SweepOutcome(total=len(sweep.keys), counts=counts, ran=len(to_run), failed_keys=failed)


class Progress:
    """A sweep's progress: a bar on a terminal; without one (CI, nohup, a log file) each finished run is one
    line (:meth:`note`), never a redrawn bar in the log."""

    def __init__(self, sweep: Sweep, store: Store, to_run: set[str], log_dir, *, enabled: bool, done: int):
        from tqdm.auto import tqdm

        self.sweep, self.store, self.to_run, self.log_dir, self.enabled = sweep, store, to_run, log_dir, enabled
        self.by_key, self.reported = {run.key: run for run in sweep.runs}, set()
        self.file = os.fdopen(os.dup(2), "w") if enabled else None
        self.bar = tqdm(total=len(sweep.keys), initial=done, desc="sweep", unit="run", file=self.file,
                        disable=not (enabled and os.isatty(2)), dynamic_ncols=True, smoothing=0.1)

    def note(self, message: str) -> None:
        if self.enabled:
            self.bar.write(message, file=self.file)
            self.file.flush()  # a log file is block-buffered: each line when it happens, not at the sweep's end

    def refresh(self) -> dict[str, int]:
        """The bar brought up to date, a line for each run finished since; the store's counts."""
        now = self.store.counts(self.sweep.keys)
        self.bar.update(sum(now[s] for s in FINISHED) + now["failed"] - self.bar.n)
        self.bar.set_postfix({s: now[s] for s in ("ok", "diverged", "collapsed", "no_learning", "failed") if now[s]},
                             refresh=True)
        for row in self.store.rows(parse=False):
            key = row["key"]
            if key not in self.to_run or key in self.reported or row["status"] not in (*FINISHED, "failed"):
                continue
            self.reported.add(key)
            run = self.by_key[key]
            if row["status"] == "failed":
                log = f" (log: {log_path(self.log_dir, key)})" if self.log_dir else ""
                self.note(f"run {short_key(key)} ({run.describe()}) failed: {row['error']}{log}")
            else:
                self.note(f"run {short_key(key)} ({run.describe()}): {row['status']}, {finished_summary(row)}")
        return now

    def close(self) -> None:
        self.bar.close()
        if self.file is not None:
            self.file.close()


def _next_round(sweep: Sweep, store: Store, note, *, poll_seconds: float) -> set[str] | None:
    """After a round, what the sweep runs next; None when each of its runs is finished or failed. A run another
    live process holds (a second sweep, a tune, on any machine that shares the store) is waited for: if that
    process dies (or its heartbeat lapses) the run is pending again and this sweep resumes it; if it was a tune
    trial that the tune pruned, its row has moved to the trial's pruned key and the cell is registered again, to
    train the complete run. So a sweep returns only when every run it could see through is settled."""
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
        held = {key for key in sweep.keys if statuses.get(key) == "running" and held_by_another(store, key)}
        if not held:
            return None
        if held - waited:
            note(f"waiting for {len(held)} run(s) of this sweep that another process is training")
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
    parser.add_argument("--workers", type=nonnegative_int, default=0, metavar="N",
                        help="run in N worker processes (default 0: one run at a time in this process)")
    parser.add_argument("--retry-failed", action="store_true", help="run failed runs again")
    add_spec_flags(parser, dry_run="print the grid (one line per run), its size and what the preflight found; "
                                   "run nothing")
    parser.set_defaults(func=run_cli)


def dry_run(sweep: Sweep) -> None:
    statuses: dict[str, str] = {}
    if sweep.store_path.is_file():
        with Store(sweep.store_path, create=False) as store:
            statuses = store.statuses()
    width = len(str(len(sweep.runs)))
    for run in sweep.runs:
        status = statuses.get(run.key, "new")
        print(f"{run.index:>{width}}  {short_key(run.key)}  {status:<11}  {run.describe()}")
    # "pruned" under a cell's own key is only ever read from an unmigrated (schema-1) store: the sweep migrates
    # it, which moves the trial off the key, and runs the cell
    finished = sum(1 for run in sweep.runs if statuses.get(run.key) in FINISHED and statuses[run.key] != "pruned")
    failed = sum(1 for run in sweep.runs if statuses.get(run.key) == "failed")
    extra = f" ({sweep.duplicates} duplicate grid cells dropped)" if sweep.duplicates else ""
    print(f"{len(sweep.runs)} runs{extra}: {finished} finished, {failed} failed, "
          f"{len(sweep.runs) - finished - failed} to run -> {sweep.output_root} (store {sweep.store_path})")


def run_cli(args) -> int:
    sweep = load_spec(args.spec, output_dir=args.output_dir, store=args.store)
    from peftlab.lab import ray_backend
    from peftlab.lab.preflight_cells import check_sweep, print_findings

    ray_backend.check_backend_args(args)
    if args.dry_run:
        dry_run(sweep)
        return print_findings(check_sweep(sweep, args, dry_run=True))
    check_sweep(sweep, args)  # every cell's data, model, extras, the folders and their room: before any run
    if args.backend == "ray" and args.workers:
        raise PeftlabError("--workers is for the local backend", fix="with --backend ray use --cpus-per-run")
    ray = ray_backend.RayOptions.from_args(args) if args.backend == "ray" else None
    outcome = run_sweep(sweep, workers=args.workers, retry_failed=args.retry_failed, capture_output=not args.verbose,
                        ray=ray)
    counts = outcome.counts
    summary = ", ".join(f"{counts[s]} {s}" for s in ("ok", "diverged", "collapsed", "no_learning", "pruned", "failed",
                                                     "pending", "running") if counts[s])
    print(f"sweep {sweep.spec_path.name}: {outcome.total} runs: {summary or 'none'}; store {sweep.store_path}")
    if counts["failed"]:
        print(f"failed runs: see {sweep.log_dir}/<key>.log; rerun them with --retry-failed", file=sys.stderr)
    print(f"table: peftlab report {sweep.store_path}")
    return 1 if counts["failed"] else 0
