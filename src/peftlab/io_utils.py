"""File reading and writing shared by every sub-package, and the check of a path to write before anything is
made (:func:`path_problem`). A file is written to a temporary name in its folder and renamed over the target, so a
reader (or a run killed mid-write) never sees half of it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from peftlab.errors import PeftlabError


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` (parents created) atomically, with the permissions of an ordinary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a result file is as readable as any other
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_default(value):
    """JSON for the NumPy scalars, tuples, sets and paths a run record may hold (``json.dumps(default=...)``)."""
    import numpy as np

    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_text_utf8(path: str | os.PathLike, *, what: str = "file", fix: str = "save it as UTF-8") -> str:
    """``path``'s text (UTF-8, a BOM dropped); not UTF-8: one line with ``path:line`` of the first bad byte."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise PeftlabError(f"{what} is not valid UTF-8 ({err.reason} at byte {err.start})", where=f"{path}:{line}",
                           fix=fix) from None


def _exists(path: Path) -> bool:
    try:
        return os.path.lexists(path)
    except (OSError, ValueError):  # a name too long, an embedded NUL
        return False


def nearest_existing(path: str | os.PathLike) -> Path:
    """``path`` (made absolute) or its nearest ancestor that exists (``/`` at worst)."""
    absolute = Path(os.path.abspath(Path(path).expanduser()))
    return next((p for p in (absolute, *absolute.parents) if _exists(p)), Path(absolute.anchor))


def _limit(folder: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(folder, name))
    except (OSError, ValueError):
        return default


def path_problem(path: str | os.PathLike, *, kind: str = "folder", write: bool = True) -> str | None:
    """Why ``path`` cannot be made or written as a ``kind`` ("folder" or "file"), or None. It need not exist yet:
    a name longer than its filesystem allows, a part of it that is a file, the wrong kind where it exists and,
    with ``write``, a nearest existing folder this process cannot write in (read-only, or no permission; root may
    write anywhere but on a read-only filesystem). Nothing is created; no exception for any path."""
    text = str(path)
    if not text.strip():
        return "the path is empty"
    if "\x00" in text:
        return "the path holds a NUL byte"
    absolute = Path(os.path.abspath(Path(text).expanduser()))
    found = nearest_existing(absolute)
    folder = found if found.is_dir() else found.parent
    name_max = _limit(folder, "PC_NAME_MAX", 255)
    long = next((part for part in absolute.parts[1:] if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        return (f"the name '{long[:24]}...' is {len(os.fsencode(long))} bytes, longer than its filesystem allows "
                f"({name_max}): File name too long")
    if len(os.fsencode(str(absolute))) >= _limit(folder, "PC_PATH_MAX", 4096):
        return "the path is longer than its filesystem allows: File name too long"
    if found == absolute:
        if kind == "folder" and not found.is_dir():
            return "it is a file, not a folder"
        if kind == "file" and found.is_dir():
            return "it is a folder, not a file"
    elif not found.is_dir():
        return f"it is below '{found}', which is a file, not a folder"
    if write and not os.access(folder, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        why = "read-only file system" if read_only else "permission denied"
        return f"the folder '{folder}' is not writable ({why})"
    return None
