"""Memory of one configuration: its standalone resident size plus the transient peak of one train step.

The transient peak is ``torch.cuda.max_memory_allocated`` on CUDA; on CPU it is the peak of the torch CPU
allocator's live bytes, read from ``torch.profiler``'s memory events (``profile_memory=True``; no tracemalloc,
which does not see torch's allocations), with the step's RSS high-water-mark delta (``/proc/self/clear_refs`` +
``VmHWM``, after ``malloc_trim``) reported beside it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_step_delta_mb(fn: Callable[[], Any]) -> float | None:
    """Peak RSS during ``fn`` minus RSS before it (Linux: reset VmHWM via /proc/self/clear_refs)."""
    gc.collect()
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return None
    before = _proc_status_kib("VmRSS")
    fn()
    peak = _proc_status_kib("VmHWM")
    if before is None or peak is None:
        return None
    return max(0.0, (peak - before) / 1024)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (kineto prints profiler_start/stop lines from C++)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cpu_tensor_peak_mb(fn: Callable[[], Any]) -> float | None:
    """Peak of the torch CPU allocator's live bytes during ``fn`` above the level before it.

    Read from ``torch.profiler``'s memory events (each allocation and free, in time order). None when this
    torch's profiler does not expose them.
    """
    from torch.profiler import ProfilerActivity, profile

    try:
        with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        live = peak = 0
        for event in events:
            live += event.nbytes()
            peak = max(peak, live)
        return peak / 2**20
    except Exception:  # a private API: degrade to "not measured" rather than fail the benchmark
        return None


def cuda_step_peak_mb(fn: Callable[[], Any], device: torch.device) -> float:
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def resident_mb(model: torch.nn.Module, optimizer=None) -> dict[str, float]:
    """Standalone size: every distinct parameter and buffer (as if this model were loaded alone) + AdamW state."""
    seen: set[int] = set()
    weights = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        weights += tensor.numel() * tensor.element_size()
    state = 0
    if optimizer is not None:
        for per_param in optimizer.state.values():
            for value in per_param.values():
                if torch.is_tensor(value):
                    state += value.numel() * value.element_size()
    return {"weights_mb": weights / 2**20, "optimizer_state_mb": state / 2**20}


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return ("peak_mb = standalone weights + AdamW state + transient step peak "
                "(torch.cuda.max_memory_allocated during one train step minus memory_allocated before it)")
    return ("peak_mb = standalone weights + AdamW state + transient step peak (peak live bytes of the torch "
            "CPU allocator during one train step, from torch.profiler memory events; no tracemalloc); "
            "rss_step_delta_mb = VmHWM - VmRSS around one step after malloc_trim (process RSS, includes "
            "allocator slack)")
