"""Where a benchmark runs: the device, the precision, the environment it records, and which methods it runs."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from peftlab.errors import PeftlabError


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict[str, Any]:
    import peft
    import transformers

    import peftlab

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "peftlab": peftlab.__version__,
        "device": str(device),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "niceness": os.nice(0) if hasattr(os, "nice") else None,
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gb"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return env


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PeftlabError("--device cuda asked for, but torch sees no CUDA device",
                           fix="run on a machine with a CUDA GPU, or use --device cpu")
    return device


def autocast_for(device: torch.device, precision: str):
    """bf16 autocast on CUDA (``auto``/``bf16``); fp32 otherwise. Returns a context-manager factory."""
    use_bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if not use_bf16:
        return contextlib.nullcontext
    return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def method_list(text: str | None, methods: dict, extra: tuple[str, ...] = ()) -> list[str]:
    from peftlab.errors import unknown

    if not text:
        return list(methods)
    names = [m.strip().lower() for m in text.split(",") if m.strip()]
    for name in names:
        if name not in methods and name not in extra:
            raise unknown("method", name, list(methods) + list(extra), where="--methods")
    return names


def precision_name(device: torch.device, precision: str) -> str:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return "bf16 autocast (fp32 weights)"
    return "fp32"
