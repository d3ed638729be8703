"""User-facing errors: one line that says what is wrong, where, and how to fix it.

Everything a user can get wrong (a name, a number, a file) raises :class:`PeftlabError`;
the CLI prints ``peftlab: error: <message>`` and exits with status 2, never a traceback.
Programming errors stay ordinary exceptions so their tracebacks survive.
"""

from __future__ import annotations

import difflib
import errno
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

    def lines(self) -> list[str]:
        """The lines the command line prints (one; :class:`PeftlabErrors` has one per problem)."""
        return [str(self)]


class PeftlabErrors(PeftlabError):
    """Several independent problems found at once (the preflight of a sweep): one line each, exit 2."""

    def __init__(self, errors: list[PeftlabError]):
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(first.what, where=first.where, fix=first.fix)

    def lines(self) -> list[str]:
        return [str(err) for err in self.errors]


def os_error(err: OSError, command: str | None = None) -> PeftlabError:
    """The one line of an OSError that reached the command line: what the OS said, about which path(s)."""
    paths = [str(p) for p in (err.filename, err.filename2) if p is not None]
    name = errno.errorcode.get(err.errno or 0, "")
    told = err.strerror or str(err) or type(err).__name__
    where = "peftlab" + (f" {command}" if command else "")
    return PeftlabError(
        f"{told}" + (f" ({name})" if name else "") + (f": {' -> '.join(repr(p) for p in paths)}" if paths else ""),
        where=where, fix="check that path (its folders exist, are folders, are writable, and each name fits the "
                         "filesystem), then rerun; PEFTLAB_DEBUG=1 shows the traceback")


# Names users bring from HF Trainer, peft and litgpt configs, mapped to peftlab's (keys; flags use dashes).
KNOWN_ALIASES = {
    "learning_rate": "lr", "num_train_epochs": "epochs", "num_epochs": "epochs",
    "per_device_train_batch_size": "batch_size", "train_batch_size": "batch_size",
    "per_device_eval_batch_size": "eval_batch_size", "max_seq_length": "max_length", "max_seq_len": "max_length",
    "lora_r": "rank", "r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
    "target_modules": "targets", "model_name_or_path": "model", "task_name": "task",
    "warmup_steps": "warmup_ratio", "gradient_clipping": "max_grad_norm", "lr_v_ratio": "lr_ratio",
}


def closest(name: str, choices: Iterable[str]) -> str:
    """A ' did you mean X?' hint, or '' when nothing is close."""
    choices = [str(c) for c in choices]
    dashed = str(name).startswith("--")
    key = str(name).lstrip("-").replace("-", "_")
    alias = KNOWN_ALIASES.get(key)
    if alias is not None:
        alias = "--" + alias.replace("_", "-") if dashed else alias
        if alias in choices:
            return f" (did you mean '{alias}'?)"
    match = difflib.get_close_matches(str(name), choices, n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def unknown(kind: str, name: str, choices: Iterable[str], *, where: str | None = None) -> PeftlabError:
    choices = sorted(choices)
    return PeftlabError(f"unknown {kind} '{name}'{closest(name, choices)}", where=where,
                        fix=f"use one of: {', '.join(choices)}")
