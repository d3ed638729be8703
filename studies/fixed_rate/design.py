"""The *fixed-rate* designs (``python -m studies.fixed_rate``): their run configs and picks, pure.

A design is a list of *stages*; a stage is a set of run configs (one sweep spec per task), some of which
depend on what earlier stages found; the driver (:mod:`studies.fixed_rate.run`) runs them into one results store.
The design's rows and defaults are its spec file beside this module (``lambda.yaml``, ``kasa.yaml``; the paper
settings are those of peftlab's shipped spec of the same name); its *shape* says which stages it has:

**grid** (lambda: Yao et al.'s eta_V = lambda * eta_QK, checked against its own control):

1. ``grid``: every cell x the *selection seeds*: lambda in ``ratios`` at every eta_QK of ``lr_grid``, and
   the diagonal lambda = 1 at every rate of ``diagonal`` (which should cover the off-diagonal cells' eta_V,
   so that "a larger eta_V" can be told apart from "a larger learning rate").
2. ``heldout``: the best diagonal cell and the best off-diagonal cell of each task (by the mean over the
   selection seeds; a cell that broke a seed ranks below every cell whose seeds all trained), and the
   off-diagonal pick's lambda-1 controls at its eta_QK and at its eta_V, re-run on *held-out seeds*.
3. ``key``: W_k trained as well ({q,k,v} when the design tunes {q,v}) at the best diagonal cell's rate, on the
   held-out seeds: the "freezing W_k loses nothing" claim, tested for equivalence (TOST) by the report.
4. ``plateau``: the two picks trained ``plateau_epochs`` epochs with ``evals_per_epoch`` dev evaluations per
   epoch, on the first ``plateau_seeds`` held-out seeds: final quality and speed of learning, apart.

With ``selection_seeds = 0`` there is no selection: every cell runs on the held-out seeds (a confirmatory
design). The tune / naive-search comparison over the same space is ``scripts/tune_vs_grid.py``.

**rows** (kasa: KaSA against its baselines at equal budget, and at the paper's own settings): the spec's rows
and the before-fine-tuning row, on the held-out seeds; with ``long_epochs`` also the spec's long rows trained
that long (on the first ``plateau_seeds`` held-out seeds), so a slower method is not judged only at an
arbitrary early point.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from peftlab.errors import PeftlabError
from peftlab.lab.study_protocol import check_seeds, key_ablation_targets
from peftlab.lab.study_spec import load_study_spec, shipped


SPECS = Path(__file__).parent  # lambda.yaml, kasa.yaml: the two fixed-rate designs


@dataclass(frozen=True)
class FixedSpec:
    """A fixed-rate design's spec file (``<kind>.yaml`` beside this module)."""

    name: str
    title: str
    shape: str  # grid (lambda) | rows (kasa)
    options: dict[str, Any]  # option dest -> default
    rows: dict[str, dict] = field(default_factory=dict)  # rows shape: name -> train keys
    paper_rows: dict[str, tuple[str, ...]] = field(default_factory=dict)  # rows at the task's paper settings
    long_rows: tuple[str, ...] = ()
    pairs: tuple[tuple[str, str, str], ...] = ()  # (a, b, name): the comparisons a − b

    def paper(self, task: str) -> dict[str, Any]:
        """The task's paper settings: those of peftlab's shipped spec of the same name."""
        return load_study_spec(shipped()[self.name]).paper(task)


def load_spec(kind: str) -> FixedSpec:
    import yaml

    path = SPECS / f"{kind}.yaml"
    if not path.is_file():
        from peftlab.errors import unknown

        raise unknown("fixed-rate study", kind, sorted(p.stem for p in SPECS.glob("*.yaml")))
    data = yaml.safe_load(path.read_text())
    pairs = tuple((str(p[0]), str(p[1]), str(p[2]) if len(p) == 3 else f"{p[0]} − {p[1]}")
                  for p in data.get("pairs") or ())
    return FixedSpec(data["name"], data["title"], data["shape"], dict(data["options"]), dict(data.get("rows") or {}),
                     {k: tuple(v) for k, v in (data.get("paper_rows") or {}).items()},
                     tuple(data.get("long_rows") or ()), pairs)


@dataclass(frozen=True)
class Design:
    """One study: its kind, tasks, the base config every run shares, and the design's knobs."""

    kind: str  # the spec's name: lambda | kasa | a user's own
    tasks: tuple[str, ...]
    base: dict[str, Any]  # train keys shared by every run (model, method, targets, epochs, data ...)
    lr_grid: tuple[float, ...] = (5e-4, 1e-3, 2e-3)
    ratios: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0)
    diagonal: tuple[float, ...] = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3)
    selection_seeds: int = 3
    heldout_seeds: int = 10
    heldout_seed_start: int = 100
    plateau_epochs: int = 6
    plateau_seeds: int = 5
    evals_per_epoch: int = 4
    key_ablation: bool = True
    search_comparison: bool = False  # plan.json of the committed stores; the comparison is scripts/tune_vs_grid.py
    top_k: int = 2
    rows: tuple[str, ...] = ()  # rows shape: the spec's rows to run (empty: its default)
    long_epochs: int = 0
    equivalence_margin: float = 1.0  # in the table's points (x100 for accuracy-like metrics)
    notes: tuple[str, ...] = field(default=())  # what an earlier budget fitting changed (plan.json, REPORT.md)
    spec: FixedSpec | None = field(default=None, compare=False, repr=False)  # None: the spec file of its kind

    def __post_init__(self):
        if self.spec is None:
            object.__setattr__(self, "spec", load_spec(self.kind))
        if self.shape == "rows" and not self.rows:
            default = str(self.section.options.get("rows") or ",".join(self.section.rows))
            object.__setattr__(self, "rows", tuple(r.strip() for r in default.split(",") if r.strip()))
        self.check()

    @property
    def section(self) -> FixedSpec:
        return self.spec

    @property
    def shape(self) -> str:
        return self.section.shape

    def check(self) -> None:
        for name in ("selection_seeds", "plateau_epochs", "plateau_seeds", "long_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PeftlabError(f"--{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        for name in ("evals_per_epoch", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PeftlabError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.shape == "grid" and self.selection_seeds == 1:
            raise PeftlabError("--selection-seeds 1 picks on a single seed",
                               fix="use 2 or more (3 is the default), or 0 to run every cell on the held-out seeds")
        check_seeds(self.heldout_seed_start, self.heldout_seeds, self.selection_seeds, minimum=1)
        if self.plateau_seeds > self.heldout_seeds:
            raise PeftlabError(f"--plateau-seeds {self.plateau_seeds} exceeds --heldout-seeds {self.heldout_seeds}",
                               fix="the plateau arm runs on the first held-out seeds")
        if not math.isfinite(self.equivalence_margin) or self.equivalence_margin <= 0:
            raise PeftlabError(f"--equivalence-margin must be > 0, got {self.equivalence_margin}")
        unknown_rows = [r for r in self.rows if r not in self.section.rows] if self.shape == "rows" else []
        if unknown_rows:
            from peftlab.errors import unknown

            raise unknown(f"{self.kind} study row", unknown_rows[0], self.section.rows, where="--rows")
        if self.shape == "grid" and not (self.ratios or self.diagonal):
            raise PeftlabError("the lambda grid is empty", fix="give --ratios and/or --diagonal")
        if self.shape == "grid" and any(r == 1 for r in self.ratios):
            raise PeftlabError("--ratios lists lambda 1, which is the diagonal",
                               fix="put lambda-1 rates in --diagonal; --ratios holds lambda > 1")

    @property
    def epochs(self) -> int:
        return int(self.base["epochs"])

    @property
    def selection_seed_list(self) -> list[int]:
        return list(range(self.selection_seeds))

    @property
    def heldout_seed_list(self) -> list[int]:
        return list(range(self.heldout_seed_start, self.heldout_seed_start + self.heldout_seeds))

    @property
    def plateau_seed_list(self) -> list[int]:
        return self.heldout_seed_list[:self.plateau_seeds]

    def with_changes(self, note: str, **changes) -> "Design":
        return replace(self, notes=self.notes + (note,), **changes)


# --------------------------------------------------------------------------- cells


@dataclass(frozen=True)
class Cell:
    """A point of the lambda grid: eta_QK (the config's lr) and lambda (lr_ratio)."""

    lr: float
    ratio: float

    @property
    def eta_v(self) -> float:
        return self.lr * self.ratio

    @property
    def diagonal(self) -> bool:
        return self.ratio == 1

    def keys(self) -> dict[str, float]:
        return {"lr": self.lr, "lr_ratio": self.ratio}

    def describe(self) -> str:
        return f"eta_QK={self.lr:g} lambda={self.ratio:g} (eta_V={self.eta_v:g})"


def grid_cells(design: Design) -> list[Cell]:
    """The diagonal first (lambda 1, by rate), then lambda > 1 by eta_QK and lambda."""
    cells = [Cell(lr, 1.0) for lr in sorted(design.diagonal)]
    cells += [Cell(lr, float(r)) for lr in sorted(design.lr_grid) for r in sorted(design.ratios)]
    return list(dict.fromkeys(cells))


def cell_of(config: dict) -> Cell:
    return Cell(float(config["lr"]), float(config.get("lr_ratio") or 1.0))


# --------------------------------------------------------------------------- run configs per stage


def task_base(design: Design, task: str) -> dict[str, Any]:
    return {**design.base, "task": task}


def grid_configs(design: Design, task: str) -> list[dict]:
    seeds = design.selection_seed_list or design.heldout_seed_list
    return [{**task_base(design, task), **cell.keys(), "seed": seed} for seed in seeds for cell in grid_cells(design)]


def heldout_configs(design: Design, task: str, cells: Iterable[Cell]) -> list[dict]:
    return [{**task_base(design, task), **cell.keys(), "seed": seed}
            for seed in design.heldout_seed_list for cell in cells]


def key_configs(design: Design, task: str, diagonal_pick: Cell) -> list[dict]:
    targets = key_ablation_targets(design.base.get("targets", "q,v"))
    if targets is None:
        return []
    return [{**config, "targets": targets} for config in heldout_configs(design, task, [diagonal_pick])]


def plateau_steps(steps_per_epoch: int, evals_per_epoch: int) -> int:
    """--eval-steps giving about ``evals_per_epoch`` dev evaluations per epoch."""
    return max(1, math.ceil(steps_per_epoch / evals_per_epoch))


def plateau_configs(design: Design, task: str, cells: Iterable[Cell], eval_steps: int) -> list[dict]:
    return [{**task_base(design, task), **cell.keys(), "seed": seed, "epochs": design.plateau_epochs,
             "eval_steps": eval_steps} for seed in design.plateau_seed_list for cell in cells]


def kasa_row_config(design: Design, task: str, row: str) -> dict:
    """A rows-shape row's config: its spec keys; a paper row at the task's paper rate and settings."""
    config = {**task_base(design, task), **design.section.rows[row]}
    if config.get("method") == "head":  # no adapter: projections and their rates do not apply (and are refused)
        for key in ("targets", "layers", "lr", "lr_ratio"):
            config.pop(key, None)
    if row in design.section.paper_rows:
        settings = design.spec.paper(task)
        config.update(lr=settings["lr"], head_lr=settings["lr"],
                      **{k: settings[k] for k in design.section.paper_rows[row]})
    return config


def long_rows(design: Design) -> tuple[str, ...]:
    """The rows trained ``long_epochs`` too: the spec's long rows (kasa: LoRA and KaSA at the paper's settings)."""
    return tuple(row for row in design.section.long_rows if row in design.rows) if design.long_epochs else ()


def long_seed_list(design: Design) -> list[int]:
    """The long rows' seeds: the first ``plateau_seeds`` held-out seeds (all of them when 0)."""
    return design.heldout_seed_list[:design.plateau_seeds or design.heldout_seeds]


def kasa_configs(design: Design, task: str) -> list[dict]:
    rows = [kasa_row_config(design, task, row) for row in design.rows]
    rows.append({**task_base(design, task), "method": "lora", "epochs": 0})  # before fine-tuning
    configs = [{**row, "seed": seed} for seed in design.heldout_seed_list for row in rows]
    configs += [{**kasa_row_config(design, task, row), "epochs": design.long_epochs, "seed": seed}
                for seed in long_seed_list(design) for row in long_rows(design)]
    return configs


# --------------------------------------------------------------------------- picks


@dataclass(frozen=True)
class CellScore:
    cell: Cell
    mean: float
    values: tuple[float, ...]
    failed: int  # seeds that did not train (no_learning, collapsed, diverged, failed)


@dataclass(frozen=True)
class Picks:
    """What the selection seeds chose for one task: the best lambda-1 cell and the best lambda > 1 cell."""

    task: str
    diagonal: CellScore | None
    off_diagonal: CellScore | None
    scores: tuple[CellScore, ...]

    @property
    def cells(self) -> list[Cell]:
        return [s.cell for s in (self.diagonal, self.off_diagonal) if s is not None]


FAILED = ("no_learning", "collapsed", "diverged", "failed")


def run_value(row: dict) -> float:
    """A grid run's score for selection: its best dev metric. A run that did not train counts at chance
    (the dev set's majority class; 0 for correlations), whatever its best epoch was, so a cell's mean
    carries its failures instead of hiding them (a collapsed run keeps a good best epoch)."""
    result = row.get("result") or {}
    chance = float(result.get("majority_baseline") or 0.0)
    value = ((result.get("best") or {}).get("metrics") or {}).get(result.get("primary_metric"))
    if row.get("status") in FAILED or not isinstance(value, (int, float)) or not math.isfinite(value):
        return chance
    return float(value)


def score_cells(runs: Iterable[tuple[dict, dict | None]], seeds: list[int]) -> list[CellScore]:
    """Mean over ``seeds`` of every grid cell whose runs on all of them finished (higher is better: the driver
    refuses lower-is-better metrics). ``runs``: (config, store row or None) pairs of one task's grid stage."""
    by_cell: dict[Cell, dict[int, tuple[float, bool]]] = {}
    for config, row in runs:
        if row is None or row.get("status") in ("pending", "running") or config["seed"] not in seeds:
            continue
        by_cell.setdefault(cell_of(config), {})[config["seed"]] = (run_value(row), row.get("status") in FAILED)
    scores = []
    for cell, by_seed in by_cell.items():
        if any(seed not in by_seed for seed in seeds):
            continue
        values = tuple(by_seed[s][0] for s in seeds)
        scores.append(CellScore(cell, statistics.fmean(values), values, sum(by_seed[s][1] for s in seeds)))
    return scores


def pick_cells(task: str, scores: list[CellScore]) -> Picks:
    """The best diagonal and best off-diagonal cell: a cell any of whose seeds failed ranks below every cell
    whose seeds all trained (as the tune's winner and scripts/tune_compare.py rank), then by mean
    (failed seeds at chance), then the smaller eta_V."""

    def best(candidates: list[CellScore]) -> CellScore | None:
        return max(candidates, key=lambda s: (-s.failed, s.mean, -s.cell.eta_v), default=None)

    return Picks(task, best([s for s in scores if s.cell.diagonal]),
                 best([s for s in scores if not s.cell.diagonal]), tuple(scores))


def count_epochs(configs: Iterable[dict]) -> int:
    return sum(int(c.get("epochs") or 0) for c in configs)
