"""Two benchmark runs at the same time, one core each: the pairs of ``peftlab bench --against trainer --task math``.

A pair is two worker subprocesses started together, each pinned to its own core (``os.sched_setaffinity``) with
one thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``). Whatever else the machine does while they run
hits both alike, so the ratio of their rates is measured in one go; each pair runs twice with the cores
swapped (:func:`pair_schedule`), so a faster core favours neither side, and the ratio reported is the geometric
mean of the two. What the pairing cannot remove: the two runs share the memory bus and the last-level cache, and
the one that finishes first leaves the other alone for its last stretch (each run's own clock covers only its own
training loop).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text


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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
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
