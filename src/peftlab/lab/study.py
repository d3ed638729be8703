"""``peftlab study lambda|kasa``: a claim checked on your model and data as a reviewer would design it, in one command.

The design (:mod:`peftlab.lab.study_design`) becomes stages; each stage is written as an ordinary sweep (or
tune) spec under ``<output dir>/specs/`` and run through :func:`peftlab.lab.sweep.run_sweep` (or
:func:`peftlab.lab.tune.run.run_tune`) into one results store, so every run is a run like any other
(``peftlab report`` / ``plot`` read the store) and the study is resumable by construction: a rerun of the same
command re-derives each stage from the store, skips finished runs and resumes unfinished ones.

Sizing: the first grid run is the pilot (a real run of the design, timed alone with a worker's thread share);
the plan (runs and epochs per stage, the estimated wall time with ``--workers`` processes) is printed before
anything long starts. With ``--budget-hours`` the design is shrunk to fit (in this order: the plateau arm,
the search comparison, held-out seeds down to 5, selection seeds down to 2, the largest lambda and the
largest diagonal rate), each cut printed and written into REPORT.md; a design that cannot fit is refused with
its minimum. The fitted design is saved in ``plan.json`` and reused by a rerun, so a resumed study is the
same study. Optional stages (``key``, ``plateau``) are skipped, and said so, when the remaining budget is
too short for them.

Output: ``results.sqlite``, ``plan.json``, ``specs/``, ``runs/`` (run folders), ``search-<task>/`` (the tune),
and from :mod:`peftlab.lab.study_report` the tables (md, csv, tex), the figures and ``REPORT.md``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable

from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text
from peftlab.lab import study_design as sd
from peftlab.lab.store import Store, config_key
from peftlab.lab.study_plan import (SAFETY, Plan, StagePlan, StudyPaths, duration_text, fit_to_budget,
                                    load_or_save_plan, naive_budget, plan_stages, write_spec)



# --------------------------------------------------------------------------- running stages


@dataclass
class Study:
    design: sd.Design
    paths: StudyPaths
    workers: int
    deadline: float | None = None  # time.monotonic() by which the budget runs out
    train_fn: Callable | str | None = None
    progress: bool = True
    say: Callable[[str], None] = print
    skipped: list[str] = field(default_factory=list)
    ray_options: object | None = None  # RayOptions: every run a Ray task (--backend ray), else local processes

    def rows_by_key(self) -> dict[str, dict]:
        if not self.paths.store.is_file():
            return {}
        with Store(self.paths.store, create=False) as store:
            return {row["key"]: row for row in store.rows()}

    def resolve(self, configs: list[dict]) -> list[tuple[dict, str]]:
        """Each config resolved as a sweep resolves it, with its run key."""
        from peftlab.config import TrainConfig, normalise_keys
        from peftlab.resolve import resolve_config

        out = []
        for config in configs:
            typed = normalise_keys(TrainConfig, config, "study")
            resolved = resolve_config(TrainConfig.from_dict(typed)).to_dict()
            out.append((config, config_key(resolved)))
        return out

    def stage_rows(self, configs: list[dict]) -> list[tuple[dict, dict | None]]:
        rows = self.rows_by_key()
        return [(config, rows.get(key)) for config, key in self.resolve(configs)]

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
        """Median wall seconds per trained epoch of this study's finished runs (the pilot's, at first)."""
        per = []
        for row in self.rows_by_key().values():
            epochs = len(((row.get("result") or {}).get("epochs_log")) or [])
            if row["status"] == "ok" and epochs and row.get("seconds"):
                per.append(row["seconds"] / epochs)
        return statistics.median(per) if per else None

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def fits(self, stage: StagePlan) -> bool:
        left, per = self.time_left(), self.seconds_per_epoch()
        if left is None or per is None:
            return True
        return stage.epochs * per * SAFETY / max(1, self.workers) <= left

    # ----------------------------------------------------------------- pilot

    def pilot(self) -> float:
        """Seconds per epoch of the first grid (or rows) run, run alone with a worker's thread share."""
        known = self.seconds_per_epoch()
        if known is not None:
            return known
        first = (sd.grid_configs(self.design, self.design.tasks[0]) if self.design.kind == "lambda"
                 else sd.kasa_configs(self.design, self.design.tasks[0]))[0]
        threads = max(1, (os.cpu_count() or 1) // max(1, self.workers))
        self.say(f"pilot: one run of the design, alone, {threads} thread(s) (a worker's share) ...")
        self.run_configs("pilot", [{**first, "threads": threads}], "the pilot: the design's first run", workers=0)
        per = self.seconds_per_epoch()
        if per is None:
            raise PeftlabError("the pilot run did not finish ok, so the study cannot be sized",
                               where=str(self.paths.runs), fix="see the pilot's log in <output dir>/runs/logs/")
        return per


# --------------------------------------------------------------------------- the lambda study


def run_lambda(study: Study) -> dict[str, dict]:
    """The lambda design's stages, task by task within each stage; returns each task's picks (as data)."""
    design = study.design
    picks: dict[str, dict] = {}
    if design.search_comparison and design.selection_seeds >= 2:
        for task in design.tasks:
            run_search(study, task)
    for task in design.tasks:
        study.run_configs(f"grid-{task}", sd.grid_configs(design, task),
                          f"lambda study, {task}: eta_QK x eta_V grid on the selection seeds")
    if not design.selection_seeds:
        return {task: {"confirmatory": True} for task in design.tasks}
    for task in design.tasks:
        picks[task] = choose(study, task)
        cells = [sd.Cell(**c) for c in picks[task]["heldout_cells"]]
        study.run_configs(f"heldout-{task}", sd.heldout_configs(design, task, cells),
                          f"lambda study, {task}: the picks and their controls on held-out seeds")
    optional = {s.name: s for s in plan_stages(design) if s.optional}
    for task in design.tasks:
        diagonal = picks[task].get("diagonal")
        if "key" in optional and diagonal:
            if study.fits(replace(optional["key"], epochs=optional["key"].epochs // len(design.tasks))):
                study.run_configs(f"key-{task}", sd.key_configs(design, task, sd.Cell(**diagonal["cell"])),
                                  f"lambda study, {task}: W_k trained too, at the diagonal pick's rate")
            else:
                study.skipped.append(f"key-{task}: not enough budget left")
    for task in design.tasks:
        if "plateau" in optional:
            cells = [sd.Cell(**picks[task][k]["cell"]) for k in ("diagonal", "off_diagonal") if picks[task].get(k)]
            stage = replace(optional["plateau"], epochs=optional["plateau"].epochs // len(design.tasks))
            if cells and study.fits(stage):
                steps = sd.plateau_steps(steps_per_epoch(study, task), design.evals_per_epoch)
                study.run_configs(f"plateau-{task}", sd.plateau_configs(design, task, cells, steps),
                                  f"lambda study, {task}: the picks trained to a plateau, dev evaluations every "
                                  f"{steps} steps")
            else:
                study.skipped.append(f"plateau-{task}: not enough budget left")
    return picks


def steps_per_epoch(study: Study, task: str) -> int:
    for config, row in study.stage_rows(sd.grid_configs(study.design, task)):
        result = (row or {}).get("result") or {}
        if result.get("train_examples") and result.get("epochs_log"):
            per_epoch = result["train_examples"] / len(result["epochs_log"])
            return max(1, math.ceil(per_epoch / int(result["config"]["batch_size"])))
    raise PeftlabError(f"no finished grid run of {task} to count its steps per epoch", fix="rerun the study")


def choose(study: Study, task: str) -> dict:
    """The task's picks from the selection seeds, the search's picks, and the cells to re-run held out:
    both picks, the off-diagonal pick's lambda-1 controls at its eta_QK and at its eta_V (when the diagonal
    has those rates), the tune's and the naive search's picks. Saved to picks-<task>.json."""
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
            control = sd.Cell(rate, 1.0)
            if any(math.isclose(rate, r) for r in design.diagonal):
                control = sd.Cell(next(r for r in design.diagonal if math.isclose(rate, r)), 1.0)
                controls[name] = asdict(control)
                cells.append(control)
    search = search_picks(study, task) if design.search_comparison and design.selection_seeds >= 2 else {}
    cells += [sd.Cell(**p["cell"]) for p in search.values() if p.get("cell")]
    record = {"task": task,
              "diagonal": _score_record(picks.diagonal), "off_diagonal": _score_record(picks.off_diagonal),
              "controls": controls, "search": search,
              "scores": [_score_record(s) for s in scores],
              "heldout_cells": [asdict(c) for c in dict.fromkeys(cells)]}
    atomic_write_text(study.paths.root / f"picks-{task}.json", json.dumps(record, indent=2) + "\n")
    return record


def _score_record(score: sd.CellScore | None) -> dict | None:
    if score is None:
        return None
    return {"cell": asdict(score.cell), "mean": score.mean, "values": list(score.values), "failed": score.failed}


def run_search(study: Study, task: str) -> None:
    """`peftlab tune` (ASHA) over the search space at the naive search's budget, into the study's store."""
    import yaml

    from peftlab.lab.tune.run import run_tune
    from peftlab.lab.tune.spec import load_tune_spec

    design = study.design
    spec = {"description": f"lambda study, {task}: ASHA search at the naive search's budget",
            "output_dir": str(study.paths.search(task)), "store": str(study.paths.store),
            "base": {**sd.task_base(design, task), "seed": 0}, "search": sd.search_space(design),
            "budget": {"epochs": naive_budget(design)}, "seeds": design.selection_seeds, "top_k": design.top_k,
            "pruner": {"kind": "asha", "min_epochs": 1, "reduction_factor": 3},
            "heldout_seeds": design.heldout_seeds, "heldout_seed_start": design.heldout_seed_start}
    path = study.paths.specs / f"search-{task}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.safe_dump(spec, sort_keys=False))
    study.say(f"stage search-{task}: peftlab tune {path} (budget {naive_budget(design)} epochs)")
    summary = run_tune(load_tune_spec(path), backend="ray" if study.ray_options is not None else "local",
                       ray_options=study.ray_options, train_fn=study.train_fn, progress=study.progress)
    if summary.get("winner") is None:
        study.skipped.append(f"search-{task}: the tune named no winner")


def search_picks(study: Study, task: str) -> dict:
    """The grid's, the naive search's and the tune's picks over the tune's space, as
    :func:`peftlab.lab.tune.compare.compare` makes them (the naive search re-seeds the design's top k: the
    tune's budget), each as a cell with the epochs it cost."""
    from peftlab.lab.tune.compare import compare
    from peftlab.lab.tune.spec import load_tune_spec

    spec_file = study.paths.specs / f"search-{task}.yaml"
    summary_file = study.paths.search(task) / "tune.json"
    if not spec_file.is_file():
        return {}
    with Store(study.paths.store, create=False) as store:
        rows = store.rows()
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    comparison = compare(load_tune_spec(spec_file), rows, summary=summary, naive_top_k=study.design.top_k)
    return {pick.search: {"cell": asdict(sd.Cell(float(pick.params["lr"]), float(pick.params.get("lr_ratio", 1.0)))),
                          "epochs": pick.cost_epochs, "how": pick.how} for pick in comparison.picks}


# --------------------------------------------------------------------------- the kasa study


def run_kasa(study: Study) -> dict[str, dict]:
    for task in study.design.tasks:
        study.run_configs(f"rows-{task}", sd.kasa_configs(study.design, task),
                          f"KaSA study, {task}: KaSA and its baselines on the held-out seeds")
    return {}


# --------------------------------------------------------------------------- the whole study


def run_study(design: sd.Design, paths: StudyPaths, *, workers: int, budget_hours: float | None = None,
              train_fn: Callable | str | None = None, progress: bool = True, report: bool = True,
              say: Callable[[str], None] = print, ray_options=None) -> sd.Design:
    """Plan (pilot, fit to the budget), run every stage, then write the report; returns the design run."""
    start = time.monotonic()
    deadline = start + budget_hours * 3600 if budget_hours else None
    study = Study(design, paths, workers=max(1, workers), deadline=deadline, train_fn=train_fn,
                  progress=progress, say=say, ray_options=ray_options)

    def fitted() -> sd.Design:
        if budget_hours is None:
            return design
        per = study.pilot()
        left = deadline - time.monotonic()
        return fit_to_budget(design, per, study.workers, left)

    study.design = load_or_save_plan(paths, design, fitted)
    for note in study.design.notes:
        say(note)
    plan = Plan(plan_stages(study.design), study.seconds_per_epoch(), study.workers)
    say(f"plan ({paths.root}):\n{plan.describe()}")
    if study.design.kind == "lambda":
        run_lambda(study)
    else:
        run_kasa(study)
    for line in study.skipped:
        say(f"skipped: {line}")
    if report:
        from peftlab.lab.study_report import write_report

        written = write_report(paths, study.design, skipped=study.skipped, seconds=time.monotonic() - start)
        say(f"report: {written}")
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


def save_fair_plan(paths: StudyPaths, design) -> None:
    """plan.json of a fair study: its design, saved on the first run; a rerun with other settings is refused
    (a resumed study is the same study)."""
    record = json.loads(json.dumps(asdict(design), default=str))
    if paths.plan.is_file():
        saved = json.loads(paths.plan.read_text()).get("design")
        changed = sorted(k for k in record if saved is None or saved.get(k) != record[k])
        if changed:
            raise PeftlabError(f"{paths.root} holds a study planned with other settings ({changed[0]}: "
                               f"{(saved or {}).get(changed[0])!r}, now {record[changed[0]]!r})",
                               where=str(paths.plan), fix="rerun with the same options, or use another --output-dir")
        return
    paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(paths.plan, json.dumps({"protocol": "fair", "design": record}, indent=2) + "\n")

