"""Two benchmark runs at the same time, one core each: the pairs of ``benchmarks/against_trainer.py`` (GLUE) and
``benchmarks/against_trainer_decoder.py`` (decoder tasks), and what both share (their flags, the schedule, the
runs made together).

A pair is two worker subprocesses started together, each pinned to its own core (``os.sched_setaffinity``) with
one thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``). Whatever else the machine does while they run
hits both alike, so the ratio of their rates is measured in one go; each pair runs twice with the cores
swapped (:func:`pair_schedule`), so a faster core favours neither side, and the ratio reported is the geometric
mean of the two. What the pairing cannot remove: the two runs share the memory bus and the last-level cache, and
the one that finishes first leaves the other alone for its last stretch (each run's own clock covers only its own
training loop).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from benchmarks.cli import names, positive_int, seeds
from benchmarks.machine import environment, loadavg, write_result
from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]  # the workers import `benchmarks` from here
OK_STATUSES = ("ok", "collapsed", "no_learning")


def parse_setup_pairs(text: str | None, default: str, setups, check=None) -> list[tuple[str, str]]:
    """``--pairs A:B,...`` (``default`` when not given) as (A, B) pairs of ``setups``, each pair once;
    ``check(setup)`` may refuse a known name with a better line first (a setup of the other benchmark)."""
    from peftlab.errors import unknown

    pairs = []
    for piece in (text or default).split(","):
        parts = [p.strip().lower() for p in piece.split(":")]
        if len(parts) != 2 or parts[0] == parts[1]:
            raise PeftlabError(f"--pairs: '{piece}' is not two different setups A:B", fix=f"e.g. --pairs {default}")
        for part in parts:
            if check is not None:
                check(part)
            if part not in setups:
                raise unknown("setup", part, list(setups), where="--pairs")
        pairs.append((parts[0], parts[1]))
    return list(dict.fromkeys(pairs))


def two_cores() -> tuple[int, int]:
    """The first two cores this process may run on; one line naming the fix when there are fewer."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(usable) < 2:
        raise PeftlabError(f"pairs run one core each, side by side, and this process may use {len(usable) or 'an unknown number of'} core(s)",
                           fix="run on a machine (or under taskset) with at least 2 usable cores")
    return usable[0], usable[1]


def pair_schedule(pairs: list[tuple[str, str]], rounds: int, cores: tuple[int, int]) -> list[dict[str, Any]]:
    """Every pair in every round, twice: ``(a on core 0, b on core 1)`` then swapped. Returns one entry per
    concurrent run: ``{"round", "pair": "a:b", "orientation", "cores": {setup: core}}``."""
    out = []
    for r in range(rounds):
        for a, b in pairs:
            for orientation in (0, 1):
                first, second = (cores[0], cores[1]) if orientation == 0 else (cores[1], cores[0])
                out.append({"round": r, "pair": f"{a}:{b}", "orientation": orientation, "cores": {a: first, b: second}})
    return out


def _pinned(core: int):
    def pin() -> None:  # runs in the child between fork and exec
        os.sched_setaffinity(0, {core})

    return pin


def run_pair(worker: str, specs: dict[str, dict], cores: dict[str, int], work: Path, label: str) -> dict[str, dict]:
    """Start ``python -m <worker> SPEC OUT`` for both setups at once, each pinned to its core; wait for both.
    Returns {setup: the worker's JSON, plus ``core``, ``process_wall_s``, ``log``} (``status: failed`` with the last
    log line when a worker fails)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": path}
    started: dict[str, tuple] = {}
    for setup, spec in specs.items():
        stem = f"{label}-{setup}"
        spec_path, out_path, log_path = work / f"{stem}.spec.json", work / f"{stem}.json", work / f"{stem}.log"
        atomic_write_text(spec_path, json.dumps({**spec, "threads": 1, "core": cores[setup]}, indent=2))
        out_path.unlink(missing_ok=True)
        log = open(log_path, "w")
        proc = subprocess.Popen([sys.executable, "-m", worker, str(spec_path), str(out_path)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, preexec_fn=_pinned(cores[setup]))
        started[setup] = (proc, log, out_path, log_path, time.perf_counter())
    results = {}
    for setup, (proc, log, out_path, log_path, start) in started.items():
        code = proc.wait()
        wall = time.perf_counter() - start
        log.close()
        if code != 0 or not out_path.is_file():
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            results[setup] = {"status": "failed", "error": f"exit {code}: {lines[-1][:300] if lines else ''}"}
        else:
            results[setup] = json.loads(out_path.read_text())
        results[setup].update(core=cores[setup], process_wall_s=wall, log=str(log_path))
    return results


# `peftlab train` options both comparisons take, named, checked and documented by their declarations. Their own,
# though train has the option: --mixed-precision (no or bf16 only, what both sides can run on a CPU)
PAIR_TRAIN_FLAGS = ("model", "epochs", "max_length", "batch_size", "rank", "alpha", "lr", "data_dir")


def add_pair_flags(made: argparse.ArgumentParser, *, tasks: list[str], pairs: str, train_examples: int,
                   **train_defaults) -> None:
    """The flags both comparisons take, with this comparison's defaults: its ``tasks``, ``pairs`` and
    ``train_examples``, and ``train_defaults`` of train's options (any option there beyond
    :data:`PAIR_TRAIN_FLAGS` is one more flag: ``lr_ratio``)."""
    from peftlab.config import TrainConfig, add_dataclass_flags

    made.add_argument("--tasks", type=names, default=tasks, help="task(s), comma list")
    made.add_argument("--pairs", default=pairs, help="comma list of A:B setup pairs run side by side, one core each")
    made.add_argument("--repeats", type=positive_int, default=1, help="rounds of every pair, both ways")
    made.add_argument("--seeds", type=seeds, default=[0], help="comma list; round r uses the r-th, cyclically")
    made.add_argument("--train-examples", type=positive_int, default=train_examples,
                      help="a seeded subset of the training set")
    made.add_argument("--mixed-precision", choices=("no", "bf16"), default="no",
                      help="the same precision on every side (bf16: CPU autocast; Trainer bf16=True, use_cpu=True)")
    only = PAIR_TRAIN_FLAGS + tuple(name for name in train_defaults if name not in PAIR_TRAIN_FLAGS)
    add_dataclass_flags(made, TrainConfig, only=only, defaults={"epochs": 1, **train_defaults})


def common_settings(args) -> dict[str, Any]:
    """The settings both comparisons record from :func:`add_pair_flags`' flags."""
    return {"model": args.model, "tasks": args.tasks, "repeats": args.repeats, "seeds": args.seeds, "threads": 1,
            "train_examples": args.train_examples, "epochs": args.epochs, "max_length": args.max_length,
            "batch_size": args.batch_size, "rank": args.rank, "alpha": args.alpha,
            "mixed_precision": args.mixed_precision, "data_dir": args.data_dir}


def median(values):
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def mean(values):
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def made_together(runs: list[dict], task: str, pair: str) -> list[dict[str, dict]]:
    """{setup: run} of each finished pair of runs of ``pair`` made at the same time, in schedule order."""
    together: dict[tuple, dict] = {}
    for r in runs:
        if r["task"] == task and r.get("status") in OK_STATUSES and r.get("pair") == pair:
            together.setdefault((r["round"], r["orientation"]), {})[r["setup"]] = r
    first, second = pair.split(":")
    return [together[key] for key in sorted(together) if first in together[key] and second in together[key]]


@dataclass(frozen=True)
class Comparison:
    """What one side-by-side comparison runs: its result kind, the worker module of each side, the setups' texts,
    the settings copied into every run's spec, the per-task spec, its summary and its Markdown."""

    kind: str
    worker: str
    setups: dict[str, str]
    spec_keys: tuple[str, ...]
    summarize: Callable[[list, str, list], dict]
    render: Callable[[dict], str]
    task_spec: Callable[[str], dict] = lambda task: {}


def run_comparison(bench: Comparison, settings: dict, out_dir: Path, name: str, say) -> dict[str, Any]:
    """Every pair of every task, both ways round, ``repeats`` rounds; the result written after each pair."""
    import torch

    cores = two_cores()
    pairs = [tuple(p.split(":")) for p in settings["pairs"]]
    work = out_dir / f"{bench.kind.replace('_', '-')}-runs"
    work.mkdir(parents=True, exist_ok=True)
    used = dict.fromkeys(s for pair in pairs for s in pair)
    result: dict[str, Any] = {"kind": bench.kind, "environment": environment(torch.device("cpu")),
                              "settings": settings, "setups": {s: bench.setups[s] for s in bench.setups if s in used},
                              "cores": list(cores), "runs": [], "summary": []}
    result["environment"]["torch_threads"] = 1  # what every run was given
    schedule = pair_schedule(pairs, settings["repeats"], cores)
    for task in settings["tasks"]:
        for index, entry in enumerate(schedule):
            seed = settings["seeds"][entry["round"] % len(settings["seeds"])]
            label = f"{task}-r{entry['round']}-{entry['pair'].replace(':', '-vs-')}-o{entry['orientation']}"
            specs = {setup: {**{k: settings[k] for k in bench.spec_keys}, **bench.task_spec(task), "task": task,
                             "setup": setup, "seed": seed, "run_dir": str(work / f"{label}-{setup}"),
                             "logging_steps": max(1, settings["train_examples"] // settings["batch_size"] // 8)}
                     for setup in entry["cores"]}
            say(f"against trainer: {task} pair {index + 1}/{len(schedule)} {entry['pair']} (cores "
                + ", ".join(f"{s} {c}" for s, c in entry["cores"].items()) + f", seed {seed})")
            for setup, run in run_pair(bench.worker, specs, entry["cores"], work, label).items():
                run.update(task=task, setup=setup, round=entry["round"], pair=entry["pair"],
                           orientation=entry["orientation"], seed=seed, epochs=settings["epochs"])
                if run["status"] == "failed":
                    say(f"{label} {setup} failed: {run['error']} (log {run['log']})")
                result["runs"].append(run)
            write_result(result, out_dir, name, bench.render)
        result["summary"].append(bench.summarize(result["runs"], task, settings["pairs"]))
    result["environment"]["loadavg_end"] = loadavg()
    return write_result(result, out_dir, name, bench.render)
