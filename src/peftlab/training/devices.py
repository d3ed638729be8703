"""Where and in which precision a run computes: ``--mixed-precision auto`` and the Accelerator.

``auto`` is bf16 on CUDA; on a CPU, bf16 autocast only with native bf16 (AMX / AVX-512 BF16) and a model of
at least :data:`BF16_CPU_MIN_PARAMS` parameters, else fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch



# `--mixed-precision auto` on a CPU: bf16 autocast from this many parameters up. Measured on this project's
# CPU (AMX, avx512_bf16; docs/RESULTS.md, "bf16 autocast on the CPU"): MPNet-base (109M) trained 1.7-1.9x faster
# at the same SST-2 accuracy; MiniLM-L6 (22.7M) only 1.16-1.26x, so small models stay fp32.
BF16_CPU_MIN_PARAMS = 100_000_000


def cpu_has_native_bf16() -> bool:
    """AMX or AVX-512 BF16 (Linux /proc/cpuinfo flags): without them bf16 autocast is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags


def resolve_precision(requested: str, n_params: int, cuda: bool | None = None) -> tuple[str, str]:
    """The precision a run uses (no, bf16, fp16) and why, for the start-up line and result.json."""
    if requested != "auto":
        return requested, f"--mixed-precision {requested}"
    if torch.cuda.is_available() if cuda is None else cuda:
        return "bf16", "auto: CUDA"
    size = f"{n_params / 1e6:.1f}M parameters"
    if not cpu_has_native_bf16():
        return "no", "auto: CPU without native bf16 (AMX/avx512_bf16)"
    if n_params < BF16_CPU_MIN_PARAMS:
        return "no", f"auto: CPU, {size} < {BF16_CPU_MIN_PARAMS / 1e6:.0f}M (bf16 gains little on small models)"
    return "bf16", f"auto: CPU with native bf16, {size} >= {BF16_CPU_MIN_PARAMS / 1e6:.0f}M"


def make_accelerator(precision: str, grad_accum: int = 1, report_to: str = "none", project_dir: str | None = None):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, DistributedType

    if report_to != "none":  # a tracker's package missing: one line naming it (the preflight found it first)
        from peftlab.extras import require

        require(f"--report-to {report_to}")

    # Accelerate keeps one state per process, and its mixed precision cannot change once set. A sweep worker
    # runs many runs in one process, so a run with another precision resets it: only in a single process
    # (never under `accelerate launch`, where the state also holds the process group).
    if (AcceleratorState._shared_state and AcceleratorState().initialized
            and AcceleratorState().distributed_type == DistributedType.NO
            and AcceleratorState().mixed_precision != precision):
        AcceleratorState._reset_state()
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=grad_accum,
                       log_with=None if report_to == "none" else report_to, project_dir=project_dir)


def uses_grad_scaler(accelerator) -> bool:
    """fp16 training: Accelerate's GradScaler skips overflowing steps itself."""
    return getattr(accelerator, "scaler", None) is not None
