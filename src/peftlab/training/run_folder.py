"""A run's files: the output-directory guard, result.json, versions and the code that ran, checkpoint folders.

Layout of ``--output-dir``: ``config.yaml`` (written first), ``epochs.jsonl``, ``curve.jsonl`` (--eval-steps),
``checkpoint/`` (:mod:`peftlab.training.checkpoint`), ``adapter/``, ``result.json`` (written last, atomically: with a
final status it marks a finished run), ``tb/``. Torch-free at import: a sweep's or tune's driver reads run folders
through it."""

from __future__ import annotations

import functools
import importlib
import json
import platform
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text, json_default

if TYPE_CHECKING:  # annotations only: importing this module stays torch-free
    import torch

# Final statuses: a result.json with one of them marks a run that is never resumed (failed is resumable).
FINISHED = ("ok", "diverged", "collapsed", "no_learning", "pruned")
CURVE_FILE = "curve.jsonl"


def write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=json_default) + "\n")


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
        return "resume" if has_checkpoint(out) else "restart"
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


def versions() -> dict[str, str]:
    import peftlab

    libraries = ("torch", "transformers", "peft", "accelerate", "datasets")
    return {"peftlab": peftlab.__version__, "python": platform.python_version(),
            **{name: importlib.import_module(name).__version__ for name in libraries}}


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
    """Peak memory of this process on ``device``, MiB."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


# --------------------------------------------------------------------------- checkpoint folders
# What a checkpoint holds and how it is written is peftlab.training.checkpoint; here: where it lies.

CHECKPOINT = "checkpoint"  # the last complete checkpoint
CHECKPOINT_OLD = ".checkpoint-old"  # the one before, while a new one is swapped in
CHECKPOINT_NEW = ".checkpoint-new"  # a checkpoint being written (never read)
CHECKPOINT_MARKER = "state.json"  # the loop state of process 0: in every complete checkpoint


def checkpoint_dir(output_dir: str | Path) -> Path | None:
    """The complete checkpoint folder, or None; a kill during the swap leaves the old one, which is used."""
    folders = (Path(output_dir) / name for name in (CHECKPOINT, CHECKPOINT_OLD))
    return next((folder for folder in folders if (folder / CHECKPOINT_MARKER).is_file()), None)


def has_checkpoint(output_dir: str | Path) -> bool:
    return checkpoint_dir(output_dir) is not None


def remove_checkpoint(output_dir: str | Path) -> None:
    for name in (CHECKPOINT, CHECKPOINT_OLD, CHECKPOINT_NEW):
        shutil.rmtree(Path(output_dir) / name, ignore_errors=True)
