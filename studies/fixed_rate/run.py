"""Running a fixed-rate study: its stages through peftlab's study runner (:class:`peftlab.lab.study.Study`: each
stage a sweep into the study's store, resumable), the picks between them, then the report.

The plan (runs and epochs per stage, the estimated wall time once runs have finished) is printed before anything
long starts; the design is saved in ``plan.json`` and a rerun with other settings is refused.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from typing import Callable

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text
from peftlab.lab.study import Study
from peftlab.lab.study_plan import StudyPaths
from studies.fixed_rate import design as sd
from studies.fixed_rate.plan import Plan, load_or_save_plan, plan_stages

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
    plan = Plan(plan_stages(study.design), study.pace()[0], study.workers)
    say(f"plan ({paths.root}):\n{plan.describe()}")
    if study.design.shape == "grid":
        run_grid(study)
    else:
        for task in design.tasks:
            study.run_configs(f"rows-{task}", sd.kasa_configs(study.design, task),
                              f"{design.kind} study, {task}: every row on the held-out seeds")
    if report:
        from studies.fixed_rate.report import write_report

        say(f"report: {write_report(paths, study.design, seconds=time.monotonic() - start)}")
    return study.design
