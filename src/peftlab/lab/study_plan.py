"""The folder of a `peftlab study` (``plan.json``, ``specs/``) that makes a rerun resume the same study (a rerun
with other settings is refused), and its runs as sweep specs with their run keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text

PLAN_FILE = "plan.json"
SAFETY = 1.15  # workers sharing a machine's memory bandwidth run slower than one run alone


def duration_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


# --------------------------------------------------------------------------- the study folder


@dataclass
class StudyPaths:
    root: Path
    store: Path

    def __post_init__(self):
        self.plan, self.specs, self.runs = self.root / PLAN_FILE, self.root / "specs", self.root / "runs"


def save_fair_plan(paths: StudyPaths, design) -> None:
    """plan.json of a fair study: its design, saved on the first run; a rerun with other settings is refused."""
    record = design.record()
    if paths.plan.is_file():
        saved = json.loads(paths.plan.read_text()).get("design") or {}
        refuse_changes(paths, saved, record, list(record))
        return
    paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.plan, json.dumps({"protocol": "fair", "design": record}, indent=2) + "\n")


def refuse_changes(paths: StudyPaths, saved: dict, wanted: dict, keys) -> None:
    """A resumed study is the same study: the first of ``keys`` whose value changed is refused."""
    changed = sorted(k for k in keys if _canon(saved.get(k)) != _canon(wanted.get(k)))
    if changed:
        key = changed[0]
        raise PeftlabError(f"{paths.root} holds a study planned with other settings ({key}: {saved.get(key)!r}, "
                           f"now {wanted.get(key)!r})", where=str(paths.plan),
                           fix="rerun with the same options, or use another --output-dir")


def resolved_run(config: dict, where: str = "study", *, check_inputs: bool = False):
    """A study run's config typed, checked and resolved as a sweep resolves it."""
    from peftlab.config import TrainConfig, normalise_keys
    from peftlab.resolve import resolve_config

    return resolve_config(TrainConfig.from_dict(normalise_keys(TrainConfig, config, where)), check_inputs=check_inputs)


def keyed(configs: list[dict]) -> list[tuple[dict, str]]:
    """Each config with its run key."""
    from peftlab.lab.store import config_key

    return [(config, config_key(resolved_run(config).to_dict())) for config in configs]


def with_rows(configs: list[dict], by_key: dict[str, dict]) -> list[tuple[dict, dict | None]]:
    """Each config with its store row (None: not in the store yet)."""
    return [(config, by_key.get(key)) for config, key in keyed(configs)]


def _canon(value):
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def write_spec(paths: StudyPaths, name: str, configs: list[dict], description: str) -> Path:
    """An explicit list of runs as a sweep spec: the keys every run shares in ``base``, the rest in one ``zip``
    group (equal-length lists: one position per run), readable and runnable with plain `peftlab sweep`."""
    import yaml

    keys = sorted({k for c in configs for k in c})
    shared = {k: configs[0][k] for k in keys if all(k in c and c[k] == configs[0][k] for c in configs)}
    varying = [k for k in keys if k not in shared]
    spec: dict[str, Any] = {"description": description, "output_dir": str(paths.runs), "store": str(paths.store),
                            "base": shared}
    if varying:
        spec["zip"] = [{k: [c.get(k) for c in configs] for k in varying}]
    path = paths.specs / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(spec, sort_keys=False))
    return path


