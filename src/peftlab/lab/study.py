"""``peftlab study``: a claim checked on your model and data as a reviewer would design it, in one command.

The design (:mod:`peftlab.lab.study_design` for the fixed-rate protocol, :mod:`peftlab.lab.study_protocol` for the
fair one, both from a spec file) becomes stages; each stage is written as an ordinary sweep spec under
``<output dir>/specs/`` and run through :func:`peftlab.lab.sweep.run_sweep` into one results store, so every run
is a run like any other (``peftlab report`` / ``plot`` read the store) and the study is resumable by
construction: a rerun of the same command re-derives each stage from the store, skips finished runs and resumes
unfinished ones.

The plan (runs and epochs per stage, the estimated wall time with ``--workers`` processes, once runs have
finished) is printed before anything long starts; the design is saved in ``plan.json`` and a rerun with other
settings is refused, so a resumed study is the same study.

Output: ``results.sqlite``, ``plan.json``, ``specs/``, ``runs/`` (run folders), and from
:mod:`peftlab.lab.study_report` (or ``study_fair_report``) the tables, the figures, verdicts.json and ``REPORT.md``.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text
from peftlab.lab import study_design as sd
from peftlab.lab.store import Store
from peftlab.lab.study_plan import (SAFETY, Plan, StudyPaths, duration_text, keyed, load_or_save_plan,
                                    plan_stages, save_fair_plan, write_spec)

# --------------------------------------------------------------------------- running stages


@dataclass
class Study:
    design: sd.Design
    paths: StudyPaths
    workers: int
    train_fn: Callable | str | None = None
    progress: bool = True
    say: Callable[[str], None] = print
    ray_options: object | None = None  # RayOptions: every run a Ray task (--backend ray), else local processes

    def rows_by_key(self) -> dict[str, dict]:
        if not self.paths.store.is_file():
            return {}
        with Store(self.paths.store, create=False) as store:
            return {row["key"]: row for row in store.rows()}

    def stage_rows(self, configs: list[dict]) -> list[tuple[dict, dict | None]]:
        rows = self.rows_by_key()
        return [(config, rows.get(key)) for config, key in keyed(configs)]

    def run_configs(self, name: str, configs: list[dict], description: str, *, workers: int | None = None) -> None:
        from peftlab.lab.spec import load_spec
        from peftlab.lab.sweep import run_sweep, run_sweep_ray

        if not configs:
            return
        path = write_spec(self.paths, name, configs, description)
        sweep = load_spec(path)
        todo = sum(1 for _, row in self.stage_rows(configs) if row is None or row["status"] in ("pending", "running"))
        self.say(f"stage {name}: {len(sweep.runs)} runs ({todo} to run){self.eta_text(configs, todo)}")
        if self.ray_options is not None and workers is None:
            outcome = run_sweep_ray(sweep, self.ray_options, train_fn=self.train_fn, progress=self.progress)
        else:
            if workers is None:  # one worker runs in this process; more are spawned processes claiming the store
                workers = 0 if self.workers <= 1 else self.workers
            outcome = run_sweep(sweep, workers=workers, train_fn=self.train_fn, progress=self.progress)
        if not outcome.all_finished:
            raise PeftlabError(f"stage {name} did not finish ({outcome.counts})", fix="rerun the same command")

    def eta_text(self, configs: list[dict], todo: int) -> str:
        per = self.seconds_per_epoch()
        if per is None or not configs or not todo:
            return ""
        epochs = sd.count_epochs(configs) * todo / len(configs)
        return f", ~{duration_text(epochs * per * SAFETY / max(1, self.workers))}"

    def seconds_per_epoch(self) -> float | None:
        """Median wall seconds per trained epoch of this study's finished runs (None before the first)."""
        per = []
        for row in self.rows_by_key().values():
            epochs = len(((row.get("result") or {}).get("epochs_log")) or [])
            if row["status"] == "ok" and epochs and row.get("seconds"):
                per.append(row["seconds"] / epochs)
        return statistics.median(per) if per else None


# --------------------------------------------------------------------------- the grid shape (lambda)


def run_grid(study: Study) -> dict[str, dict]:
    """The grid design's stages, task by task within each stage; returns each task's picks (as data)."""
    design = study.design
    for task in design.tasks:
        study.run_configs(f"grid-{task}", sd.grid_configs(design, task),
                          f"lambda study, {task}: eta_QK x eta_V grid on the selection seeds")
    if not design.selection_seeds:
        return {task: {"confirmatory": True} for task in design.tasks}
    picks = {task: choose(study, task) for task in design.tasks}
    for task in design.tasks:
        cells = [sd.Cell(**c) for c in picks[task]["heldout_cells"]]
        study.run_configs(f"heldout-{task}", sd.heldout_configs(design, task, cells),
                          f"lambda study, {task}: the picks and their controls on held-out seeds")
    optional = {s.name for s in plan_stages(design) if s.optional}
    for task in design.tasks:
        diagonal = picks[task].get("diagonal")
        if "key" in optional and diagonal:
            study.run_configs(f"key-{task}", sd.key_configs(design, task, sd.Cell(**diagonal["cell"])),
                              f"lambda study, {task}: W_k trained too, at the diagonal pick's rate")
    for task in design.tasks:
        cells = [sd.Cell(**picks[task][k]["cell"]) for k in ("diagonal", "off_diagonal") if picks[task].get(k)]
        if "plateau" in optional and cells:
            steps = sd.plateau_steps(steps_per_epoch(study, task), design.evals_per_epoch)
            study.run_configs(f"plateau-{task}", sd.plateau_configs(design, task, cells, steps),
                              f"lambda study, {task}: the picks trained to a plateau, dev evaluations every "
                              f"{steps} steps")
    return picks


def steps_per_epoch(study: Study, task: str) -> int:
    for config, row in study.stage_rows(sd.grid_configs(study.design, task)):
        result = (row or {}).get("result") or {}
        if result.get("train_examples") and result.get("epochs_log"):
            per_epoch = result["train_examples"] / len(result["epochs_log"])
            return max(1, math.ceil(per_epoch / int(result["config"]["batch_size"])))
    raise PeftlabError(f"no finished grid run of {task} to count its steps per epoch", fix="rerun the study")


def choose(study: Study, task: str) -> dict:
    """The task's picks from the selection seeds and the cells to re-run held out: both picks and the
    off-diagonal pick's lambda-1 controls at its eta_QK and at its eta_V (when the diagonal has those rates).
    Saved to picks-<task>.json."""
    design = study.design
    scores = sd.score_cells(study.stage_rows(sd.grid_configs(design, task)), design.selection_seed_list)
    picks = sd.pick_cells(task, scores)
    if picks.diagonal is None and picks.off_diagonal is None:
        raise PeftlabError(f"no grid cell of {task} finished on every selection seed", fix="rerun the study")
    cells = list(picks.cells)
    controls = {}
    if picks.off_diagonal is not None:
        off = picks.off_diagonal.cell
        for name, rate in (("same_eta_qk", off.lr), ("same_eta_v", off.eta_v)):
            match = next((r for r in design.diagonal if math.isclose(rate, r)), None)
            if match is not None:
                controls[name] = asdict(sd.Cell(match, 1.0))
                cells.append(sd.Cell(match, 1.0))
    record = {"task": task,
              "diagonal": _score_record(picks.diagonal), "off_diagonal": _score_record(picks.off_diagonal),
              "controls": controls, "search": {},
              "scores": [_score_record(s) for s in scores],
              "heldout_cells": [asdict(c) for c in dict.fromkeys(cells)]}
    atomic_write_text(study.paths.root / f"picks-{task}.json", json.dumps(record, indent=2) + "\n")
    return record


def _score_record(score: sd.CellScore | None) -> dict | None:
    if score is None:
        return None
    return {"cell": asdict(score.cell), "mean": score.mean, "values": list(score.values), "failed": score.failed}


# --------------------------------------------------------------------------- the whole study


def run_study(design: sd.Design, paths: StudyPaths, *, workers: int, train_fn: Callable | str | None = None,
              progress: bool = True, report: bool = True, say: Callable[[str], None] = print,
              ray_options=None) -> sd.Design:
    """The fixed-rate protocol: the plan, every stage, then the report; returns the design run."""
    start = time.monotonic()
    study = Study(design, paths, workers=max(1, workers), train_fn=train_fn, progress=progress, say=say,
                  ray_options=ray_options)
    study.design = load_or_save_plan(paths, design)
    plan = Plan(plan_stages(study.design), study.seconds_per_epoch(), study.workers)
    say(f"plan ({paths.root}):\n{plan.describe()}")
    if study.design.shape == "grid":
        run_grid(study)
    else:
        for task in design.tasks:
            study.run_configs(f"rows-{task}", sd.kasa_configs(study.design, task),
                              f"{design.kind} study, {task}: every row on the held-out seeds")
    if report:
        from peftlab.lab.study_report import write_report

        say(f"report: {write_report(paths, study.design, seconds=time.monotonic() - start)}")
    return study.design


def run_fair_study(design, paths: StudyPaths, *, workers: int, train_fn: Callable | str | None = None,
                   progress: bool = True, report: bool = True, say: Callable[[str], None] = print,
                   ray_options=None):
    """The fair protocol (:mod:`peftlab.lab.study_fair`): searches and held-out stages, then the report."""
    from peftlab.lab.study_fair import run_fair

    start = time.monotonic()
    study = Study(design, paths, workers=max(1, workers), train_fn=train_fn, progress=progress, say=say,
                  ray_options=ray_options)
    save_fair_plan(paths, design)
    run_fair(study, design)
    if report:
        from peftlab.lab.study_fair_report import write_fair_report

        say(f"report: {write_fair_report(paths, design, seconds=time.monotonic() - start)}")
    return design

