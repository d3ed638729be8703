"""The machine's measured GEMM peak: the denominator of model FLOP utilisation.

A short ``torch.matmul`` probe of n×n by n×n matrices at a few sizes, in the train step's dtype (fp32, or bf16
where the step runs under bf16 autocast: its linear layers then multiply bf16 matrices) and at torch's current
thread count (``--threads``), best of ``repeats`` per size after one untimed product; 2·n³ FLOPs per product.
The peak is the best rate over every size: the most this device did on dense products in this process, with
whatever else the machine was doing at the time (the result records the load average beside it).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.timing import Clock

DEFAULT_SIZES = (512, 1024, 2048)
DEFAULT_REPEATS = 5


def gemm_peak(dtype: torch.dtype = torch.float32, *, device: torch.device | None = None, sizes=DEFAULT_SIZES,
              repeats: int = DEFAULT_REPEATS, seed: int = 0) -> dict[str, Any]:
    """GFLOP/s of ``torch.matmul`` per size (every repeat, and the best) and the peak over sizes."""
    device = device or torch.device("cpu")
    clock = Clock(device)
    generator = torch.Generator().manual_seed(seed)
    per_size = []
    for n in sizes:
        a = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=generator).to(device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        torch.matmul(a, b, out=out)  # untimed: first-call setup (oneDNN primitives, CUDA handles)
        clock.sync()
        rates = [2 * n**3 / clock(lambda: torch.matmul(a, b, out=out)) / 1e9 for _ in range(repeats)]
        per_size.append({"n": n, "gflops": rates, "gflops_best": max(rates)})
    return {"dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "device": str(device),
            "repeats": repeats, "sizes": per_size, "peak_gflops": max(s["gflops_best"] for s in per_size),
            "method": f"torch.matmul of n x n by n x n, best of {repeats} per size after one untimed product, "
                      "2 n^3 FLOPs each"}


def utilisation(flops_per_step: int | None, step_seconds: float | None, peak: dict | None) -> dict[str, Any]:
    """Model FLOP/s of a train step (its counted FLOPs / its median time) and that as a share of the peak."""
    if not flops_per_step or not step_seconds:
        return {"model_gflops": None, "of_peak": None}
    rate = flops_per_step / step_seconds / 1e9
    return {"model_gflops": rate, "of_peak": rate / peak["peak_gflops"] if peak and peak.get("peak_gflops") else None}
