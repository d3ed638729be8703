"""The plan of a `peftlab study`: runs and epochs per stage, the wall-time estimate, and the study folder
(``plan.json``, ``specs/``) that makes a rerun resume the same study (a rerun with other settings is refused).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text
from peftlab.lab import study_design as sd

PLAN_FILE = "plan.json"
SAFETY = 1.15  # workers sharing a machine's memory bandwidth run slower than one run alone
# The fixed-rate design's knobs that a rerun must not change (a resumed study is the same study), by its shape.
PLAN_KEYS = {"grid": ("kind", "tasks", "base", "lr_grid", "ratios", "diagonal", "selection_seeds", "heldout_seeds",
                      "heldout_seed_start", "plateau_epochs", "plateau_seeds", "evals_per_epoch", "key_ablation",
                      "search_comparison", "top_k"),
             "rows": ("kind", "tasks", "base", "selection_seeds", "heldout_seeds", "heldout_seed_start",
                      "plateau_epochs", "plateau_seeds", "rows", "long_epochs")}


# --------------------------------------------------------------------------- the plan


@dataclass
class StagePlan:
    name: str
    runs: int
    epochs: int
    optional: bool = False
    note: str = ""


@dataclass
class Plan:
    stages: list[StagePlan]
    seconds_per_epoch: float | None  # from the store's finished runs
    workers: int

    @property
    def epochs(self) -> int:
        return sum(s.epochs for s in self.stages)

    def seconds(self, stages: list[StagePlan] | None = None) -> float | None:
        if self.seconds_per_epoch is None:
            return None
        epochs = sum(s.epochs for s in (self.stages if stages is None else stages))
        return epochs * self.seconds_per_epoch * SAFETY / self.workers

    def describe(self) -> str:
        lines = []
        for s in self.stages:
            cost = self.seconds([s])
            eta = f", ~{duration_text(cost)}" if cost is not None else ""
            lines.append(f"  {s.name:<8} {s.runs:>5} runs {s.epochs:>6} epochs{eta}"
                         + (" (optional)" if s.optional else "") + (f"  {s.note}" if s.note else ""))
        total = self.seconds()
        per = f"{self.seconds_per_epoch:.1f} s per epoch per worker" if self.seconds_per_epoch else "not timed yet"
        lines.append(f"  total    {sum(s.runs for s in self.stages):>5} runs {self.epochs:>6} epochs"
                     + (f", ~{duration_text(total)} with {self.workers} worker(s) ({per})" if total else f" ({per})"))
        return "\n".join(lines)


def duration_text(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plan_stages(design: sd.Design) -> list[StagePlan]:
    """Runs and epochs per stage; the held-out picks are not known yet, so their count is the most they can
    be (diagonal + off-diagonal pick, their eta_QK and eta_V controls)."""
    tasks = len(design.tasks)
    e = design.epochs
    stages = []
    if design.shape == "rows":
        configs = sd.kasa_configs(design, design.tasks[0])
        return [StagePlan("rows", len(configs) * tasks, sd.count_epochs(configs) * tasks)]
    cells = len(sd.grid_cells(design))
    seeds = design.selection_seeds or design.heldout_seeds
    stages.append(StagePlan("grid", cells * seeds * tasks, cells * seeds * e * tasks))
    if design.selection_seeds:
        picks = 4
        stages.append(StagePlan("heldout", picks * design.heldout_seeds * tasks,
                                picks * design.heldout_seeds * e * tasks, note="at most"))
    if design.key_ablation and sd.key_ablation_targets(design.base.get("targets", "q,v")):
        stages.append(StagePlan("key", design.heldout_seeds * tasks, design.heldout_seeds * e * tasks, optional=True))
    if design.plateau_epochs and design.plateau_seeds and design.selection_seeds:
        n = 2 * design.plateau_seeds * tasks
        # step evaluations cost about one extra epoch per (evals_per_epoch / 4): counted as epochs
        extra = 1 + design.evals_per_epoch / 8
        stages.append(StagePlan("plateau", n, int(math.ceil(n * design.plateau_epochs * extra)), optional=True))
    return stages


# --------------------------------------------------------------------------- the study folder


@dataclass
class StudyPaths:
    root: Path
    store: Path

    @property
    def plan(self) -> Path:
        return self.root / PLAN_FILE

    @property
    def specs(self) -> Path:
        return self.root / "specs"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def search(self, task: str) -> Path:
        return self.root / f"search-{task}"


def design_record(design: sd.Design) -> dict:
    data = {k: v for k, v in asdict(design).items() if k != "spec"}
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in data.items()}


def load_or_save_plan(paths: StudyPaths, design: sd.Design) -> sd.Design:
    """The study's design: the one saved in plan.json when this folder has a study already (same knobs: else
    refused; a design an earlier budget fit cut comes back as it ran), else ``design``, saved now."""
    keys = PLAN_KEYS[design.shape]
    wanted = {k: v for k, v in design_record(design).items() if k in keys}
    if paths.plan.is_file():
        saved = json.loads(paths.plan.read_text())
        refuse_changes(paths, saved.get("asked") or {}, wanted, keys)
        fields = {f.name for f in dataclasses.fields(sd.Design)}
        record = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["design"].items() if k in fields}
        return sd.Design(**record, spec=design.spec)
    paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.plan, json.dumps({"asked": wanted, "design": design_record(design)}, indent=2) + "\n")
    return design


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


def keyed(configs: list[dict]) -> list[tuple[dict, str]]:
    """Each config resolved as a sweep resolves it, with its run key."""
    from peftlab.config import TrainConfig, normalise_keys
    from peftlab.lab.store import config_key
    from peftlab.resolve import resolve_config

    out = []
    for config in configs:
        typed = normalise_keys(TrainConfig, config, "study")
        out.append((config, config_key(resolve_config(TrainConfig.from_dict(typed), check_inputs=False).to_dict())))
    return out


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


