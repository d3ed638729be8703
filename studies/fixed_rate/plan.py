"""The plan of a fixed-rate study: runs and epochs per stage, the wall-time estimate, and ``plan.json`` that makes
a rerun resume the same study (a rerun with other settings is refused)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass

from peftlab.io_utils import atomic_write_text
from peftlab.lab.study_plan import SAFETY, StudyPaths, duration_text, refuse_changes
from studies.fixed_rate import design as sd

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
