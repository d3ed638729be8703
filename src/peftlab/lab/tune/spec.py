"""The ``peftlab tune`` spec: what to search, with which budget, and how a winner is named (its keys: README,
"Choosing lambda within a budget").

The budget is in epochs trained in all: the seed re-runs (``top_k x (seeds - 1) x epochs``) are reserved first and
the search spends the rest; ``grid_fraction`` is a fraction of the full grid (every point x ``seeds`` x
``epochs``), so a search with a range needs ``budget: {epochs: N}``. The held-out seeds (``heldout_seeds``
from ``heldout_seed_start``) may not overlap the selection seeds, and their epochs are counted outside the
budget: they check the pick, they do not make it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

from peftlab.config import ROLES
from peftlab.errors import PeftlabError, closest
from peftlab.lab.spec import Run, resolved_run
from peftlab.tasks.table import SELECTION_PREFIX

SPEC_KEYS = ("description", "output_dir", "store", "base", "search", "budget", "seeds", "top_k", "pruner",
             "sampler_seed", "metric", "heldout_seeds", "heldout_seed_start")
BUDGET_KEYS = ("epochs", "grid_fraction")
PRUNER_KEYS = ("kind", "min_epochs", "reduction_factor")
PRUNERS = ("asha", "hyperband", "none")
RANGE_KEYS = ("low", "high", "log", "step")
# The tune sets these itself: the seed in the re-runs, the epochs as the pruner's resource, the task of the spec, the
# trials' folders (the config's `searchable` / `run_managed` roles).
NOT_SEARCHABLE = ROLES.not_searchable
DEFAULT_GRID_FRACTION = 0.35
DEFAULT_HELDOUT_SEEDS = 10
DEFAULT_HELDOUT_SEED_START = 1000
STUDY_FILE = "study.sqlite"
SUMMARY_FILE = "tune.json"  # the summary :mod:`peftlab.lab.tune.summary` writes


@dataclass(frozen=True)
class SearchParam:
    name: str
    values: tuple | None = None  # a grid axis (categorical)
    low: float | None = None  # a range
    high: float | None = None
    log: bool = False
    step: float | None = None

    @property
    def is_range(self) -> bool:
        return self.values is None

    def to_json(self) -> dict:
        if self.values is not None:
            return {"values": list(self.values)}
        return {"low": self.low, "high": self.high, "log": self.log, "step": self.step}


@dataclass(frozen=True)
class PrunerSpec:
    kind: str = "asha"
    min_epochs: int = 1
    reduction_factor: int = 3

    def describe(self) -> str:
        if self.kind == "none":
            return "no pruning"
        name = "successive halving (ASHA)" if self.kind == "asha" else "Hyperband"
        return f"{name}, from {self.min_epochs} epoch(s), keeping 1/{self.reduction_factor} at each rung"


@dataclass
class TuneSpec:
    spec_path: Path
    output_root: Path
    store_path: Path
    base: dict[str, Any]  # typed config keys (TrainConfig names)
    search: dict[str, SearchParam]
    epochs: int  # per run: the pruner's maximum resource
    budget_epochs: float
    seeds: int
    top_k: int
    pruner: PrunerSpec
    sampler_seed: int
    metric: str
    direction: str  # maximize | minimize
    description: str = ""
    budget_source: str = ""  # how the budget was given, for the start-up line
    grid_size: int | None = field(default=None)
    heldout_seeds: int = DEFAULT_HELDOUT_SEEDS  # the winner's re-runs on seeds no choice used (0: none)
    heldout_seed_start: int = DEFAULT_HELDOUT_SEED_START

    @property
    def study_path(self) -> Path:
        return self.output_root / STUDY_FILE

    @property
    def summary_path(self) -> Path:
        return self.output_root / SUMMARY_FILE

    @property
    def base_seed(self) -> int:
        return int(self.base.get("seed") or 0)

    @property
    def seed_list(self) -> list[int]:
        return [self.base_seed + i for i in range(self.seeds)]

    @property
    def heldout_seed_list(self) -> list[int]:
        return [self.heldout_seed_start + i for i in range(self.heldout_seeds)]

    @property
    def heldout_epochs(self) -> int:
        """Epochs of the held-out check (outside the budget)."""
        return self.heldout_seeds * self.epochs

    @property
    def grid_epochs(self) -> int | None:
        """Epochs the full grid x seeds would train (the sweep this tune stands in for)."""
        return None if self.grid_size is None else self.grid_size * self.seeds * self.epochs

    @property
    def seed_reserve(self) -> int:
        return self.top_k * (self.seeds - 1) * self.epochs

    @property
    def search_budget(self) -> float:
        return self.budget_epochs - self.seed_reserve

    @property
    def grid_points(self) -> list[dict[str, Any]] | None:
        """Every search point of a list-only space, in a fixed shuffled order (``sampler_seed``)."""
        import itertools
        import random

        if self.grid_size is None:
            return None
        names = list(self.search)
        points = [dict(zip(names, combo)) for combo in itertools.product(*(self.search[n].values for n in names))]
        random.Random(self.sampler_seed).shuffle(points)
        return points

    def fingerprint(self) -> str:
        """What the study's trials depend on: a spec whose search changed cannot continue the same study."""
        data = {"base": self.base, "search": {k: p.to_json() for k, p in self.search.items()},
                "metric": self.metric, "pruner": list(astuple(self.pruner)), "sampler_seed": self.sampler_seed}
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def describe(self) -> str:
        space = " x ".join(f"{name} {list(p.values)}" if p.values is not None else
                           f"{name} [{p.low}, {p.high}{', log' if p.log else ''}]" for name, p in self.search.items())
        grid = (f"full grid {self.grid_size} points x {self.seeds} seeds x {self.epochs} epochs = "
                f"{self.grid_epochs} epochs; " if self.grid_size else "")
        return (f"tune {self.spec_path.name}: {space}; {grid}budget {self.budget_epochs:g} epochs "
                f"({self.budget_source}): search {self.search_budget:g}, seed re-runs {self.seed_reserve} "
                f"(top {self.top_k} x {self.seeds - 1} more seeds); pruner: {self.pruner.describe()}; "
                f"objective: {self.metric} ({self.direction}, best epoch); {self.describe_heldout()}")

    def describe_heldout(self) -> str:
        if not self.heldout_seeds:
            return "no held-out check (heldout_seeds: 0): the winner is scored on the seeds that chose it"
        seeds = self.heldout_seed_list
        return (f"then the winner on {self.heldout_seeds} held-out seed(s) {seeds[0]}..{seeds[-1]} "
                f"({self.heldout_epochs} epochs, outside the budget)")


def _positive_int(value, name: str, where: str, *, low: int = 1, fix: str | None = None) -> int:
    """A whole number >= ``low`` (1: a positive integer)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        what = "a positive integer" if low == 1 else f"a whole number >= {low}"
        raise PeftlabError(f"{name} must be {what}, got {value!r}", where=where, fix=fix)
    return value


def _heldout(spec: dict, where: str, n_seeds: int, base_seed: int) -> tuple[int, int]:
    """``heldout_seeds`` and ``heldout_seed_start``, checked: whole numbers >= 0, and the held-out seeds apart
    from the selection seeds (base seed ... base seed + seeds - 1)."""
    count = _positive_int(spec.get("heldout_seeds", DEFAULT_HELDOUT_SEEDS), "heldout_seeds", where, low=0,
                          fix="e.g. heldout_seeds: 10 (the winner's re-runs on unused seeds); 0 turns them off")
    start = _positive_int(spec.get("heldout_seed_start", DEFAULT_HELDOUT_SEED_START), "heldout_seed_start", where,
                          low=0, fix=f"e.g. heldout_seed_start: {DEFAULT_HELDOUT_SEED_START}")
    selection = range(base_seed, base_seed + n_seeds)
    if count and start < selection.stop and selection.start < start + count:
        raise PeftlabError(f"the held-out seeds {start}..{start + count - 1} overlap the selection seeds "
                           f"{selection.start}..{selection.stop - 1}", where=where,
                           fix=f"set heldout_seed_start: {max(selection.stop, DEFAULT_HELDOUT_SEED_START)} "
                               f"(held-out seeds must be seeds no trial or re-run used)")
    return count, start


def _mapping(value, name: str, where: str, keys: tuple[str, ...], example: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PeftlabError(f"{name}: must be a mapping", where=where, fix=f"e.g. {name}: {example}")
    for key in value:
        if key not in keys:
            raise PeftlabError(f"unknown {name} key '{key}'{closest(str(key), keys)}", where=where,
                               fix=f"{name} keys are {', '.join(keys)}")
    return value


def _search_param(name: str, raw, where: str) -> SearchParam:
    from peftlab.lab.spec import typed_value

    def typed(value):
        return typed_value(name, value, f"{where}: search.{name}")

    if isinstance(raw, list):
        if not raw:
            raise PeftlabError(f"search.{name} is an empty list", where=where, fix="give it at least one value")
        values = tuple(typed(v) for v in raw)
        if len(set(map(repr, values))) != len(values):
            raise PeftlabError(f"search.{name} lists a value twice: {list(raw)}", where=where)
        return SearchParam(name, values=values)
    if isinstance(raw, dict):
        _mapping(raw, f"search.{name}", where, RANGE_KEYS, "{low: 1, high: 16, log: true}")
        if "low" not in raw or "high" not in raw:
            raise PeftlabError(f"search.{name} needs low and high", where=where,
                               fix=f"e.g. search: {{{name}: {{low: 1, high: 16, log: true}}}}, or a list of values")
        low, high = typed(raw["low"]), typed(raw["high"])
        if not isinstance(low, (int, float)) or isinstance(low, bool) or not low < high:
            raise PeftlabError(f"search.{name}: low must be a number below high, got low={low!r} high={high!r}",
                               where=where)
        log = bool(raw.get("log", False))
        if log and low <= 0:
            raise PeftlabError(f"search.{name}: a log range needs low > 0, got {low}", where=where)
        step = raw.get("step")
        if step is not None and log:
            raise PeftlabError(f"search.{name}: step and log cannot go together (Optuna)", where=where)
        return SearchParam(name, low=low, high=high, log=log, step=typed(step) if step is not None else None)
    raise PeftlabError(f"search.{name} must be a list of values or a range {{low, high, log}}, got {raw!r}",
                       where=where, fix=f"e.g. search: {{{name}: [1, 2, 4, 8, 16]}}; fixed values go under base:")


def load_tune_spec(path: str | os.PathLike, *, output_dir: str | None = None, store: str | None = None,
                   seeds: int | None = None) -> TuneSpec:
    """Read and check a tune spec; a config of every grid point is built, so bad values fail before training."""
    from peftlab.config import TrainConfig
    from peftlab.lab.spec import output_paths, read_spec
    from peftlab.resolve import refuse_unused_options, resolve_config
    from peftlab.tasks.table import LOWER_IS_BETTER, primary_metric

    path, spec = read_spec(path, "tune", SPEC_KEYS, examples="configs/tune/", config_keys="base:")
    where = str(path)
    base, params = _base_and_search(spec, where)
    defaults = resolve_config(TrainConfig.from_dict(base))  # checked and resolved: the epochs, task and metric
    methods = params["method"].values if "method" in params and not params["method"].is_range else [defaults.method]
    refuse_unused_options({*base, *params}, set(methods), where=where)
    epochs = int(defaults.epochs)
    if epochs < 1:
        raise PeftlabError("base epochs must be >= 1 for a tune (each trial trains up to that many epochs)",
                           where=where)
    metric = spec.get("metric") or primary_metric(defaults.task, defaults.metric)  # a user task's --metric
    if defaults.selection_samples and not spec.get("metric"):
        metric = SELECTION_PREFIX + metric  # --selection-samples: every choice (pruning, the winner) reads that split
    n_seeds = seeds if seeds is not None else spec.get("seeds", 5)
    n_seeds = _positive_int(n_seeds, "seeds" if seeds is None else "--seeds", where)
    heldout_seeds, heldout_start = _heldout(spec, where, n_seeds, int(base.get("seed") or 0))  # as TuneSpec.base_seed
    sampler_seed = _positive_int(spec.get("sampler_seed", 0), "sampler_seed", where, low=0)  # numpy's seeds: >= 0
    grid_size = None if any(p.is_range for p in params.values()) else math.prod(len(p.values) for p in params.values())
    budget_epochs, source = _budget(spec, where, grid_size, n_seeds * epochs)
    root, store_path = output_paths(path, spec, output_dir, store)
    tune = TuneSpec(spec_path=path, output_root=root, store_path=store_path, base=base, search=params, epochs=epochs,
                    budget_epochs=float(budget_epochs), seeds=n_seeds,
                    top_k=_positive_int(spec.get("top_k", 2), "top_k", where), pruner=_pruner(spec, where),
                    sampler_seed=sampler_seed, metric=str(metric),
                    direction="minimize" if metric in LOWER_IS_BETTER else "maximize",
                    description=str(spec.get("description") or ""), budget_source=source, grid_size=grid_size,
                    heldout_seeds=heldout_seeds, heldout_seed_start=heldout_start)
    for point in tune.grid_points or _range_points(params):  # every grid point's config is valid; a range's ends
        run_config(tune, point, tune.base_seed, where=where)
    if tune.search_budget < epochs:
        raise PeftlabError(f"the budget of {budget_epochs:g} epochs leaves {tune.search_budget:g} for the search "
                           f"after the seed re-runs ({tune.seed_reserve} epochs), less than one trial "
                           f"({epochs} epochs)", where=where, fix="raise the budget, or lower seeds / top_k")
    return tune


def _base_and_search(spec: dict, where: str) -> tuple[dict[str, Any], dict[str, SearchParam]]:
    """The spec's ``base:`` (typed config keys) and ``search:`` (each key's values or range, searchable)."""
    from peftlab.lab.spec import check_spec_keys, typed_base

    base = typed_base(spec, where)
    search = spec.get("search") or {}
    if not isinstance(search, dict) or not search:
        raise PeftlabError("search: must map at least one config key to its values", where=where,
                           fix="e.g. search: {lr_ratio: [1, 2, 4, 8, 16]}")
    check_spec_keys(search, where, "search")
    names = {str(key).replace("-", "_"): key for key in search}
    for name in set(names) & set(NOT_SEARCHABLE):
        fix = {"seed": "seeds: N re-runs the top candidates with N seeds",
               "epochs": "set epochs under base: (the most a trial trains; the pruner stops poor ones sooner)",
               "task": "tune one task per spec (one spec per task)"}.get(name, "set it under base:")
        raise PeftlabError(f"'{names[name]}' cannot be searched by peftlab tune", where=where, fix=fix)
    params = {name: _search_param(name, search[key], where) for name, key in names.items()}
    return base, params


def _pruner(spec: dict, where: str) -> PrunerSpec:
    raw = _mapping(spec.get("pruner"), "pruner", where, PRUNER_KEYS, "{kind: asha, min_epochs: 1}")
    pruner = PrunerSpec(str(raw.get("kind", "asha")),
                        _positive_int(raw.get("min_epochs", 1), "pruner.min_epochs", where),
                        _positive_int(raw.get("reduction_factor", 3), "pruner.reduction_factor", where))
    if pruner.kind not in PRUNERS:
        raise PeftlabError(f"unknown pruner.kind '{pruner.kind}'{closest(pruner.kind, PRUNERS)}", where=where,
                           fix=f"one of {', '.join(PRUNERS)}")
    if pruner.kind != "none" and pruner.reduction_factor < 2:
        raise PeftlabError("pruner.reduction_factor must be >= 2", where=where)
    return pruner


def _budget(spec: dict, where: str, grid_size: int | None, seed_epochs: int) -> tuple[float, str]:
    """The spec's ``budget:`` in epochs trained in all, and where that number came from (``seed_epochs``: one
    grid point's seeds x epochs)."""
    budget = _mapping(spec.get("budget"), "budget", where, BUDGET_KEYS, "{grid_fraction: 0.35}")
    if len(budget) > 1:
        raise PeftlabError("budget: give epochs or grid_fraction, not both", where=where)
    if "epochs" in budget:
        epochs = budget["epochs"]
        if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or epochs <= 0:
            raise PeftlabError(f"budget.epochs must be a positive number, got {epochs!r}", where=where)
        return epochs, f"budget.epochs {epochs:g}"
    fraction = budget.get("grid_fraction", DEFAULT_GRID_FRACTION)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise PeftlabError(f"budget.grid_fraction must be in (0, 1], got {fraction!r}", where=where)
    if grid_size is None:
        raise PeftlabError("a search with a range has no finite grid to take a fraction of", where=where,
                           fix="give budget: {epochs: N} (epochs trained in all)")
    return fraction * grid_size * seed_epochs, (f"{fraction:g} of the full grid"
                                                + ("" if "grid_fraction" in budget else ", the default"))


def _range_points(params: dict[str, SearchParam]) -> list[dict[str, Any]]:
    """Search points that give each parameter each of its listed values and both ends of its range once (the
    others at their first value or low end): each value's declared range is checked before any trial."""
    first = {name: p.low if p.is_range else p.values[0] for name, p in params.items()}
    return [{**first, name: value} for name, p in params.items()
            for value in ((p.low, p.high) if p.is_range else p.values)]


def run_config(tune: TuneSpec, params: dict[str, Any], seed: int, *, where: str | None = None) -> Run:
    """The run of one search point with one seed: its config, key and folder (named as a sweep's runs)."""
    point = " ".join(f"{k}={v}" for k, v in params.items())
    return resolved_run({**tune.base, **params, "seed": seed}, tune.output_root, label=f"search point {{{point}}}",
                        where=where or str(tune.spec_path))


def heldout_runs(tune: TuneSpec, params: dict[str, Any]) -> list[Run]:
    """The held-out check of one search point: its runs on ``tune.heldout_seed_list``."""
    return [run_config(tune, params, seed) for seed in tune.heldout_seed_list]
