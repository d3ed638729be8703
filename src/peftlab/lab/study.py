"""``peftlab study``'s runner: each stage of a design written as an ordinary sweep spec under ``specs/`` and run
through :func:`peftlab.lab.sweep.run_sweep` into one store, so every run is a run like any other and a rerun of
the same command skips finished runs and resumes the rest (``plan.json`` refuses other settings).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

from peftlab.errors import PeftlabError
from peftlab.lab.store import Store
from peftlab.lab.study_plan import SAFETY, StudyPaths, duration_text, save_fair_plan, with_rows, write_spec


@dataclass
class Study:
    """A study's stages run as sweeps into its folder's store (also the fixed-rate protocol's, in studies/)."""

    design: object
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
        return with_rows(configs, self.rows_by_key())

    def run_configs(self, name: str, configs: list[dict], description: str) -> None:
        from peftlab.lab.spec import load_spec
        from peftlab.lab.sweep import run_sweep

        if not configs:
            return
        path = write_spec(self.paths, name, configs, description)
        sweep = load_spec(path)
        todo = sum(1 for _, row in self.stage_rows(configs) if row is None or row["status"] in ("pending", "running"))
        self.say(f"stage {name}: {len(sweep.runs)} runs ({todo} to run){self.eta_text(configs, todo)}")
        # Ray tasks when asked (run_sweep prefers them), else one worker in this process or spawned processes
        outcome = run_sweep(sweep, workers=0 if self.workers <= 1 else self.workers, ray=self.ray_options,
                            train_fn=self.train_fn, progress=self.progress)
        if not outcome.all_finished:
            raise PeftlabError(f"stage {name} did not finish ({outcome.counts})", fix="rerun the same command")

    def eta_text(self, configs: list[dict], todo: int) -> str:
        per, stopped_after = self.pace()
        if per is None or not configs or not todo:
            return ""
        # an early-stopped run trains about as long as the study's early-stopped runs did, not to its epoch cap
        expected = [min(int(c.get("epochs") or 0), stopped_after) if c.get("early_stop_patience") and stopped_after
                    else int(c.get("epochs") or 0) for c in configs]
        return f", ~{duration_text(sum(expected) * todo / len(configs) * per * SAFETY / max(1, self.workers))}"

    def pace(self) -> tuple[float | None, float | None]:
        """Median wall seconds per trained epoch of this study's finished runs, and the median epochs its
        early-stopped runs trained (None before the first of each)."""
        per, epochs_run = [], []
        for row in self.rows_by_key().values():
            epochs = len((row.get("result") or {}).get("epochs_log") or [])
            if row["status"] == "ok" and epochs and row.get("seconds"):
                per.append(row["seconds"] / epochs)
                if (row.get("config") or {}).get("early_stop_patience"):
                    epochs_run.append(epochs)
        return (statistics.median(per) if per else None), (statistics.median(epochs_run) if epochs_run else None)


# --------------------------------------------------------------------------- the whole study


def run_fair_study(design, paths: StudyPaths, *, workers: int, train_fn: Callable | str | None = None,
                   progress: bool = True, report: bool = True, say: Callable[[str], None] = print,
                   ray_options=None):
    """The fair protocol (:mod:`peftlab.lab.study_fair`): searches and held-out stages, then the report."""
    from peftlab.lab.study_fair import run_task

    study = Study(design, paths, workers=max(1, workers), train_fn=train_fn, progress=progress, say=say,
                  ray_options=ray_options)
    save_fair_plan(paths, design)
    for task in design.tasks:
        run_task(study, design, task)
    if report:
        from peftlab.lab.study_fair_report import write_fair_report

        say(f"report: {write_fair_report(paths, design)}")
    return design

