"""Fake result.json records for the lab tests (sweep, tune, study, report, plot), held to the real contract.

The fakes write only the fields their test is about; :func:`checked` fills the other fields
schemas/result.schema.json requires with placeholders that say "nothing measured here" (no timing, no memory,
no git checkout, the installed package versions) and then validates the record, so a fake can never drift
from what ``peftlab train`` writes. Fields that change what a report or plot shows (``majority_baseline``,
``curve`` points, ``kasa_sigma``, ...) are not filled in: a fake that needs them says so itself.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata, resources

import jsonschema

SCHEMA = json.loads(resources.files("peftlab").joinpath("schemas/result.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
# A stand-in source digest: the fakes all ran "the same code", which is not this checkout's.
FAKE_SOURCE_DIGEST = hashlib.sha256(b"peftlab test fake").hexdigest()
PACKAGES = ("peftlab", "torch", "transformers", "peft", "accelerate", "datasets")


def _installed(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _epochs_run(result: dict) -> int:
    """As the loop counts it: the epoch a hook stopped at, else the logged epochs plus a diverged partial one;
    a fake that logs no epochs ran the epochs it was asked for."""
    stopped = result.get("stopped_early")
    if isinstance(stopped, dict) and isinstance(stopped.get("epoch"), int):
        return stopped["epoch"]
    if "epochs_log" not in result:
        return int(result.get("epochs", (result.get("config") or {}).get("epochs", 0)))
    return len(result["epochs_log"]) + (result.get("status") == "diverged")


def placeholders(result: dict) -> dict:
    """The required fields a fake left out, each with a value that claims nothing the fake did not do."""
    config = result.get("config") or {}
    targets = config.get("targets", "")
    return {
        "schema_version": 1, "status_reason": None if result.get("status") == "ok" else result.get("status"),
        "task": config.get("task"), "seed": config.get("seed"),
        "model": config.get("model"), "method": config.get("method"), "rank": config.get("rank"),
        "targets": ",".join(targets) if isinstance(targets, (list, tuple)) else targets,
        "alpha": config.get("alpha"), "lr": config.get("lr"), "lr_ratio": config.get("lr_ratio"),
        "head_lr": config.get("head_lr"), "group_lrs": {},
        "epochs": config.get("epochs"), "epochs_run": _epochs_run(result),
        "epochs_log": [], "curve": [], "before": None,
        "train_seconds": 0.0, "train_examples_per_second": None, "peak_memory_mb": 0.0,
        "versions": {package: _installed(package) for package in PACKAGES},
        "git_commit": None,
        "code": {"commit": None, "dirty": None, "version": _installed("peftlab"), "source_digest": FAKE_SOURCE_DIGEST},
        "train_examples_digest": None,
    }


def checked(result: dict, *, written_before: tuple[str, ...] = ()) -> dict:
    """``result`` with the missing required fields filled (see :func:`placeholders`), validated against
    result.schema.json; raises jsonschema.ValidationError naming every violation. ``written_before``: fields an
    older peftlab did not write yet (e.g. ``code``): left absent, as in such a record, and not required."""
    complete = dict(result)
    for name, value in placeholders(result).items():
        if name not in written_before:
            complete.setdefault(name, value)
    absent = {f"{name!r} is a required property" for name in written_before if name not in complete}
    errors = sorted((e for e in VALIDATOR.iter_errors(complete) if e.absolute_path or e.message not in absent),
                    key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors]
        raise jsonschema.ValidationError("fake result breaks result.schema.json:\n" + "\n".join(lines))
    return complete
