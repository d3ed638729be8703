"""A run's files: atomic writes, the output-directory guard, versions and the code that ran, checkpoints.

Layout of ``--output-dir``::

    config.yaml        resolved config (written first)
    epochs.jsonl       one line per finished epoch (metrics, loss, seconds)
    curve.jsonl        with --eval-steps: one line per dev evaluation during training (step, epoch, metrics)
    checkpoint/        last checkpoint: trainable tensors, optimizer, scheduler, RNG, loop state
    adapter/           the trained adapter (peft format) or full-FT tensors, safetensors
    result.json        written last, atomically: its presence with a final status marks a finished run
    tb/                TensorBoard logs

Checkpoints hold only what training changes (trainable tensors + optimizer state), not the frozen base:
the base (incl. KaSA's truncation and PiSSA/MiLoRA residuals, which are deterministic) is rebuilt on resume.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import random
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text  # noqa: F401 - re-exported: the run folder's writes are atomic

# Final statuses: a result.json with one of them marks a run that is never resumed (failed is resumable).
FINISHED = ("ok", "diverged", "collapsed", "no_learning", "pruned")
CURVE_FILE = "curve.jsonl"


def write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=_json_default) + "\n")


def _json_default(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_result(output_dir: str | Path) -> dict | None:
    path = Path(output_dir) / "result.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def inspect_output_dir(output_dir: str | Path, *, overwrite: bool, resume: bool) -> str:
    """Decide, without touching anything, what a run does with ``output_dir``: 'fresh', 'resume',
    'restart' (--resume but no checkpoint yet), 'overwrite' or 'finished' (--resume of a finished run).
    Refuses to clobber finished or unfinished work unless asked."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise PeftlabError(f"--output-dir {out} is a file", fix="pass a folder path")
    if overwrite:
        return "overwrite" if out.exists() else "fresh"
    result = read_result(out)
    if result is not None and result.get("status") in FINISHED:
        if resume:
            return "finished"
        raise PeftlabError(f"{out} already holds a finished run (status {result.get('status')})",
                           fix="choose another --output-dir, or pass --overwrite to replace it")
    if resume:
        return "resume" if _checkpoint_dir(out) is not None else "restart"
    if out.exists() and any(out.iterdir()):
        raise PeftlabError(f"{out} holds an unfinished run",
                           fix="pass --resume to continue it, --overwrite to start over, or another --output-dir")
    return "fresh"


def init_output_dir(output_dir: str | Path, mode: str) -> None:
    """Create (or clear, for 'overwrite'/'restart') the run folder once setup has succeeded."""
    out = Path(output_dir)
    if mode in ("overwrite", "restart") and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def remove_checkpoint(output_dir: str | Path) -> None:
    for name in ("checkpoint", ".checkpoint-old"):
        shutil.rmtree(Path(output_dir) / name, ignore_errors=True)


def versions() -> dict[str, str]:
    import accelerate
    import datasets
    import peft
    import transformers

    import peftlab

    return {
        "peftlab": peftlab.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
    }


@functools.lru_cache(maxsize=None)
def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout the package source lives in; (None, None) outside a git checkout (an
    installed wheel). Dirty: uncommitted changes to tracked files.

    Asked once per process: a process runs the code it imported at its start, and a sweep worker's runs then
    spawn no two git processes each."""
    src = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return None, None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=src,
                               capture_output=True, text=True, timeout=5)
        if dirty.returncode != 0:
            return sha.stdout.strip(), None
        return sha.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        return None, None


def git_commit() -> str | None:
    """result.json's ``git_commit``: the commit, with '+dirty' for uncommitted changes (None outside git)."""
    sha, dirty = git_state()
    return None if sha is None else sha + ("+dirty" if dirty else "")


SOURCE_SUFFIXES = (".py", ".json")


@functools.lru_cache(maxsize=None)
def source_digest(root: Path | None = None) -> str:
    """SHA-256 (64 hex) of the package's own sources: every ``.py`` and ``.json`` file under ``root`` (default:
    the installed ``peftlab`` package; ``__pycache__`` left out), in sorted order of their POSIX paths relative
    to ``root``; for each, its path (UTF-8), a NUL byte, its size in bytes as decimal text, a NUL byte and its
    bytes are hashed. Equal digests = the same code ran, whether or not git knew it (a wheel, a dirty tree).
    Computed once per process (a few hundred small files), like :func:`git_state`."""
    import hashlib

    base = Path(__file__).resolve().parents[1] if root is None else Path(root)
    files = sorted((p.relative_to(base).as_posix(), p) for p in base.rglob("*")
                   if p.suffix in SOURCE_SUFFIXES and p.is_file() and "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for relative, path in files:
        data = path.read_bytes()
        h.update(relative.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def code_record() -> dict:
    """result.json's ``code``: the commit and whether the tree was dirty (None outside git), the package version,
    and :func:`source_digest`."""
    import peftlab

    sha, dirty = git_state()
    return {"commit": sha, "dirty": dirty, "version": peftlab.__version__, "source_digest": source_digest()}


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# --------------------------------------------------------------------------- checkpoints


def rng_state() -> dict:
    # Plain containers and tensors only, so that torch.load(weights_only=True) can read it back.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    cached], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


BEST_WEIGHTS = "best.safetensors"


def save_checkpoint(output_dir: str | Path, model, optimizer, scheduler, loop_state: dict,
                    best_weights: dict | None = None) -> None:
    """Write checkpoint/ atomically: build it in a temporary folder, then swap it in. ``best_weights``: the
    trainable tensors of the best epoch so far (``--save best``), so a resumed run still saves them."""
    from safetensors.torch import save_file

    out = Path(output_dir)
    staging = Path(tempfile.mkdtemp(prefix=".checkpoint-", dir=out))
    try:
        trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        save_file(trainable, str(staging / "trainable.safetensors"))
        if best_weights:
            save_file({n: t.contiguous() for n, t in best_weights.items()}, str(staging / BEST_WEIGHTS))
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state()},
                   staging / "training_state.pt")
        (staging / "state.json").write_text(json.dumps(loop_state, default=_json_default))
        final = out / "checkpoint"
        old = out / ".checkpoint-old"
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _checkpoint_dir(out: Path) -> Path | None:
    """The complete checkpoint folder; a kill during the swap in save_checkpoint leaves the old one."""
    for name in ("checkpoint", ".checkpoint-old"):
        if (out / name / "state.json").is_file():
            return out / name
    return None


def has_checkpoint(output_dir: str | Path) -> bool:
    return _checkpoint_dir(Path(output_dir)) is not None


def load_checkpoint(output_dir: str | Path, model, optimizer, scheduler) -> dict:
    from safetensors.torch import load_file

    ckpt = _checkpoint_dir(Path(output_dir))
    tensors = load_file(str(ckpt / "trainable.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n in tensors if n not in params]
    if missing:
        raise PeftlabError(f"checkpoint in {ckpt} does not match this run's model ({missing[0]} missing)",
                           fix="resume with the same config, or pass --overwrite to start over")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    training = torch.load(ckpt / "training_state.pt", weights_only=True)  # no pickled code runs
    optimizer.load_state_dict(training["optimizer"])
    scheduler.load_state_dict(training["scheduler"])
    state = json.loads((ckpt / "state.json").read_text())
    state["rng"] = training["rng"]
    return state


def load_best_weights(output_dir: str | Path) -> dict | None:
    """The best epoch's trainable tensors saved with the checkpoint, if any."""
    from safetensors.torch import load_file

    ckpt = _checkpoint_dir(Path(output_dir))
    path = None if ckpt is None else ckpt / BEST_WEIGHTS
    return load_file(str(path)) if path is not None and path.is_file() else None
