"""Where a benchmark runs: the device, the precision, the environment it records, which methods it runs, and
the result files it writes."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages (None where the OS has none): how busy the machine was."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def write_result(result: dict, out_dir: Path, name: str, render: Callable[[dict], str]) -> dict:
    """Write ``<name>.json`` and its Markdown (``render(result)``) into ``out_dir``; both paths go in
    ``result["files"]``, which is returned."""
    json_path, markdown_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    atomic_write_text(json_path, json.dumps(result, indent=2))
    atomic_write_text(markdown_path, render(result))
    result["files"] = {"json": str(json_path), "markdown": str(markdown_path)}
    return result


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
        "loadavg_start": loadavg(),
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
