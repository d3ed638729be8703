"""The plan of a `peftlab study`: runs and epochs per stage, the wall-time estimate, fitting a design to
``--budget-hours``, and the study folder (``plan.json``, ``specs/``) that makes a rerun resume the same study.

Fitting cuts, in this order, until the estimate fits: the plateau arm, the search comparison, held-out seeds
down to 5, selection seeds down to 2, then the largest lambda and the largest diagonal rate (each cut is
noted on the design: the plan and REPORT.md say it); a design that cannot fit is refused with its minimum.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text
from peftlab.lab import study_design as sd

PLAN_FILE = "plan.json"
SAFETY = 1.15  # workers sharing a machine's memory bandwidth run slower than the pilot alone
MIN_HELDOUT = 5
# The design's knobs that a rerun must not change (a resumed study is the same study).
PLAN_KEYS = ("kind", "tasks", "base", "lr_grid", "ratios", "diagonal", "selection_seeds", "heldout_seeds",
             "heldout_seed_start", "plateau_epochs", "plateau_seeds", "evals_per_epoch", "key_ablation",
             "search_comparison", "top_k", "rows", "long_epochs")


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
    seconds_per_epoch: float | None  # from the pilot (or the store's finished runs)
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


def naive_budget(design: sd.Design) -> int:
    """Epochs of the naive search over the tune's space: every point once, the top k re-seeded."""
    space = sd.search_space(design)
    points = len(space["lr"]) * len(space["lr_ratio"])
    return (points + design.top_k * (design.selection_seeds - 1)) * design.epochs


def plan_stages(design: sd.Design) -> list[StagePlan]:
    """Runs and epochs per stage; the held-out picks are not known yet, so their count is the most they can
    be (diagonal + off-diagonal pick, their eta_QK and eta_V controls, the search's picks)."""
    tasks = len(design.tasks)
    e = design.epochs
    stages = []
    if design.kind == "kasa":
        configs = sd.kasa_configs(design, design.tasks[0])
        return [StagePlan("rows", len(configs) * tasks, sd.count_epochs(configs) * tasks)]
    if design.search_comparison and design.selection_seeds >= 2:
        budget = naive_budget(design)
        stages.append(StagePlan("search", 0, budget * tasks, note="tune at the naive search's budget"))
    cells = len(sd.grid_cells(design))
    seeds = design.selection_seeds or design.heldout_seeds
    stages.append(StagePlan("grid", cells * seeds * tasks, cells * seeds * e * tasks))
    if design.selection_seeds:
        picks = 4 + (2 if design.search_comparison else 0)
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


def fit_to_budget(design: sd.Design, seconds_per_epoch: float, workers: int, budget_s: float) -> sd.Design:
    """Shrink the design until its estimate fits ``budget_s``; every cut is noted on the design."""
    def estimate(d: sd.Design) -> float:
        return Plan(plan_stages(d), seconds_per_epoch, workers).seconds()

    cuts: list[tuple[str, Callable[[sd.Design], sd.Design | None]]] = [
        ("no plateau arm", lambda d: d.with_changes("budget: the plateau arm was dropped", plateau_epochs=0)
         if d.plateau_epochs else None),
        ("no search comparison", lambda d: d.with_changes("budget: the tune / naive-search comparison was dropped",
                                                          search_comparison=False) if d.search_comparison else None),
    ]
    design_now = design
    for _, cut in cuts:
        if estimate(design_now) <= budget_s:
            return design_now
        design_now = cut(design_now) or design_now
    while estimate(design_now) > budget_s and design_now.heldout_seeds > MIN_HELDOUT:
        n = max(MIN_HELDOUT, design_now.heldout_seeds - 1)
        design_now = replace(design_now, heldout_seeds=n, plateau_seeds=min(design_now.plateau_seeds, n))
    if design_now.heldout_seeds != design.heldout_seeds:
        design_now = design_now.with_changes(f"budget: {design_now.heldout_seeds} held-out seeds instead of "
                                             f"{design.heldout_seeds}")
    if estimate(design_now) > budget_s and design_now.selection_seeds > 2:
        design_now = design_now.with_changes(f"budget: 2 selection seeds instead of {design_now.selection_seeds}",
                                             selection_seeds=2)
    while estimate(design_now) > budget_s and design_now.kind == "lambda":
        if len(design_now.ratios) > 2:
            top = max(design_now.ratios)
            design_now = design_now.with_changes(f"budget: lambda {top:g} dropped",
                                                 ratios=tuple(r for r in design_now.ratios if r != top))
        elif len(design_now.diagonal) > 2:
            top = max(design_now.diagonal)
            design_now = design_now.with_changes(f"budget: diagonal rate {top:g} dropped",
                                                 diagonal=tuple(r for r in design_now.diagonal if r != top))
        else:
            break
    need = estimate(design_now)
    if need > budget_s:
        raise PeftlabError(f"the smallest design this study allows needs ~{duration_text(need)}, more than "
                           f"--budget-hours {budget_s / 3600:g} ({seconds_per_epoch:.1f} s per epoch measured)",
                           fix="raise --budget-hours, lower --max-train-samples / --epochs, or add --workers")
    return design_now


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
    data = asdict(design)
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in data.items()}


def load_or_save_plan(paths: StudyPaths, design: sd.Design, fitted: Callable[[], sd.Design]) -> sd.Design:
    """The study's design: the one saved in plan.json when this folder has a study already (same knobs:
    else refused), else ``fitted()`` saved now."""
    wanted = {k: v for k, v in design_record(design).items() if k in PLAN_KEYS}
    if paths.plan.is_file():
        saved = json.loads(paths.plan.read_text())
        asked = saved.get("asked") or {}
        changed = sorted(k for k in PLAN_KEYS if _canon(asked.get(k)) != _canon(wanted.get(k)))
        if changed:
            key = changed[0]
            raise PeftlabError(f"{paths.root} holds a study planned with other settings ({key}: "
                               f"{asked.get(key)!r}, now {wanted.get(key)!r})",
                               where=str(paths.plan), fix="rerun with the same options, or use another --output-dir")
        record = saved["design"]
        return sd.Design(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.items()})
    chosen = fitted()
    paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.plan, json.dumps({"asked": wanted, "design": design_record(chosen)}, indent=2) + "\n")
    return chosen


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


