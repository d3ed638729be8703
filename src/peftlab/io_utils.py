"""File reading and writing shared by every sub-package (it imports only :mod:`peftlab.errors`).

A file is written to a temporary name in its folder and renamed over the target, so a reader (or a run
killed mid-write) never sees half of it. A text file that is not UTF-8 is one line naming the file and the line
of the first bad byte (:func:`read_text_utf8`), whoever reads it.
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


def read_text_utf8(path: str | os.PathLike, *, what: str = "file", fix: str = "save it as UTF-8") -> str:
    """``path``'s text (UTF-8, a BOM dropped); not UTF-8: one line with ``path:line`` of the first bad byte."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise PeftlabError(f"{what} is not valid UTF-8 ({err.reason} at byte {err.start})", where=f"{path}:{line}",
                           fix=fix) from None
