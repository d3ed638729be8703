"""Folders of the peftlab model cache, each published whole by one rename: a converted checkpoint (config and
weights) or a tokenizer alone. A reader sees a finished folder or none, also when a conversion is killed or two
processes convert the same model at once."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable


def is_converted(target: Path) -> bool:
    """Whether ``target`` holds a finished cached copy (written by a rename: config and weights, or nothing)."""
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def tokenizer_saved(target: Path) -> bool:
    """Whether ``target`` holds a finished tokenizer-only copy (written by a rename, as a converted model)."""
    return (target / "tokenizer_config.json").is_file()


def write_and_publish(target: Path, write: Callable[[Path], Any], finished=None) -> Path:
    """Write beside ``target`` and rename, so a killed conversion never leaves a half-written cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        publish_folder(staging, target, finished)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def publish_folder(staging: Path, target: Path, finished: Callable[[Path], bool] | None = None) -> None:
    """Rename the finished folder ``staging`` to ``target``; if a concurrent process (a second test worker, a
    sweep's other run) published first, keep its copy and drop ours. The rename is the only step that makes a
    cached copy visible, so a reader sees a whole folder or none; ``finished`` tells a published copy."""
    try:
        os.replace(staging, target)
    except OSError:
        if not (finished or is_converted)(target):  # not a lost race: a real failure (permissions, disk)
            raise
        shutil.rmtree(staging, ignore_errors=True)
