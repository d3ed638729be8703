"""Timing: one sample per configuration per round, round-robin, and the statistics of those samples.

Every configuration is built first, then each round visits them all in an order rotated by the round, so slow
drift of a shared machine hits all of them alike; ratios against a reference are medians of *per-round*
paired ratios. A sample is :class:`Clock` around ``--inner`` back-to-back calls.

``torch.utils.benchmark.Timer`` is not used for the samples: its ``timeit(number)`` first runs
``max(number // 100, 2)`` untimed calls of its own and sets torch's thread count to its ``num_threads``
(default 1) (torch/utils/benchmark/utils/timer.py). A train-step sample would then take two extra optimizer
steps, tripling every round's cost and moving the model state between rounds, and ``--threads`` would not hold;
``blocked_autorange`` picks its own number of calls, so rounds would no longer pair. The warm-up rounds are
ours (``--warmup``), the same for every configuration.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch


def summarize(samples: list[float]) -> dict[str, Any]:
    """Median, quartiles (linear interpolation), IQR and MAD (median absolute deviation) of ``samples``,
    which are kept in measurement order."""
    values = np.sort(np.array([float(x) for x in samples if x is not None and np.isfinite(x)], dtype=float))
    if not values.size:
        return {"n": 0, "median": None, "q25": None, "q75": None, "iqr": None, "mad": None, "min": None,
                "samples": []}
    median = float(np.median(values))
    q25, q75 = (float(q) for q in np.quantile(values, [0.25, 0.75]))
    return {
        "n": int(values.size),
        "median": median,
        "q25": q25,
        "q75": q75,
        "iqr": q75 - q25,
        "mad": float(np.median(np.abs(values - median))),
        "min": float(values[0]),
        "samples": [float(x) for x in samples],
    }


def paired_ratio(numerator: list[float], denominator: list[float]) -> dict[str, Any] | None:
    """Per-round ratios ``numerator[r] / denominator[r]`` (measured in the same round), summarised."""
    if not numerator or not denominator or len(numerator) != len(denominator):
        return None
    ratios = [a / b for a, b in zip(numerator, denominator) if b and a is not None]
    out = summarize(ratios)
    return {k: out[k] for k in ("n", "median", "q25", "q75", "iqr", "mad")}


class Clock:
    """Seconds per call of ``fn`` over ``inner`` back-to-back calls: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], Any], inner: int = 1) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0 / inner
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - start) / inner


def first_line(err: BaseException) -> str:
    """An error's first line, at most 300 characters: what a row of the results says went wrong."""
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def rotated(items: list, r: int) -> list:
    """``items`` starting at position ``r`` (mod its length): round r's visiting order."""
    if not items:
        return items
    r %= len(items)
    return items[r:] + items[:r]


MIN_ROUNDS_UNDER_DEADLINE = 3


def round_robin(rows: list, fn_of: Callable[[Any], Callable], into: str, rounds: int, warmup: int,
                clock: Clock, inner: int, progress: Callable[[str], None], deadline: float | None = None) -> int:
    """Time every live row once per round, rows in an order rotated by the round; returns timed rounds.

    A row has ``error`` (None while it is measured), ``label`` and a list attribute named ``into`` that each
    timed round appends its sample to; ``fn_of(row)`` is the call to time.

    Past ``deadline`` (``time.monotonic()``), stops after at least MIN_ROUNDS_UNDER_DEADLINE timed rounds:
    every row of a round is measured together, so paired ratios stay valid with fewer rounds.
    """
    live = [row for row in rows if row.error is None]
    fns = {id(row): fn_of(row) for row in live}
    timed = 0
    for r in range(warmup + rounds):
        if deadline is not None and timed >= MIN_ROUNDS_UNDER_DEADLINE and time.monotonic() > deadline:
            progress(f"{into}: time budget spent, stopping after {timed} timed rounds")
            break
        for row in rotated(live, r):
            try:
                seconds = clock(fns[id(row)], inner)
            except Exception as err:  # keep measuring the others; the row says what failed
                row.error = f"{into}: {type(err).__name__}: {first_line(err)}"
                progress(f"{row.label}: {row.error}")
                continue
            if r >= warmup:
                getattr(row, into).append(seconds)
        live = [row for row in live if row.error is None]
        timed += r >= warmup
        progress(f"{into}: round {r + 1}/{warmup + rounds}" + (" (warm-up)" if r < warmup else ""))
    return timed


def geometric_mean(values) -> float | None:
    """The geometric mean of the positive finite ``values`` (None if there are none): the mean of ratios
    that is symmetric, geomean(a/b) = 1 / geomean(b/a)."""
    kept = [float(v) for v in values if v is not None and np.isfinite(v) and v > 0]
    return float(np.exp(np.mean(np.log(kept)))) if kept else None


def paired_geomean(numerator: list, denominator: list) -> dict[str, Any] | None:
    """Per-repeat ratios ``numerator[r] / denominator[r]`` (runs of the same round) and their geometric mean,
    min and max; None unless both lists are complete and equally long."""
    if not numerator or len(numerator) != len(denominator):
        return None
    ratios = [a / b for a, b in zip(numerator, denominator) if a is not None and b]
    if len(ratios) != len(numerator):
        return None
    return {"n": len(ratios), "geomean": geometric_mean(ratios), "min": min(ratios), "max": max(ratios),
            "ratios": ratios}
