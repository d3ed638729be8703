"""User-facing errors: one line that says what is wrong, where, and how to fix it.

Everything a user can get wrong (a name, a number, a file) raises :class:`PeftlabError`;
the CLI prints ``peftlab: error: <message>`` and exits with status 2, never a traceback.
Programming errors stay ordinary exceptions so their tracebacks survive.
"""

from __future__ import annotations

import difflib
from typing import Iterable

USER_ERROR_EXIT = 2


class PeftlabError(Exception):
    """A problem with the user's input; ``str(err)`` is a complete one-line message."""

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what, self.where, self.fix = what, where, fix
        parts = [what if where is None else f"{what} ({where})"]
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__("; ".join(parts).replace("\n", " "))


def closest(name: str, choices: Iterable[str]) -> str:
    """A ' did you mean X?' hint, or '' when nothing is close."""
    match = difflib.get_close_matches(str(name), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def unknown(kind: str, name: str, choices: Iterable[str], *, where: str | None = None) -> PeftlabError:
    choices = sorted(choices)
    return PeftlabError(
        f"unknown {kind} '{name}'{closest(name, choices)}",
        where=where,
        fix=f"use one of: {', '.join(choices)}",
    )
