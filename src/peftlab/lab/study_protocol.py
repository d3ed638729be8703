"""The fair-comparison protocol of `peftlab study`, as data: rows, rate searches, picks. Pure: configs in,
configs or picks out (:mod:`peftlab.lab.study_fair` runs the stages).

Every compared row gets the same treatment, so the comparison speaks to the methods and not to one shared rate:
three disjoint splits (each seed's training subset; a selection split carved out of the training split, which
every choice reads: the rate, the best epoch, early stopping; the dev set as the test split, read only for the
reported numbers); each row's own module rate, searched on the selection seeds on a grid ``grid_factor`` apart
and extended past an edge while the best rate sits there (the head's rate tied to it, as the KaSA authors'
scripts do); each run to its plateau (early stopping, ``epochs`` the cap); each pick re-run on held-out seeds,
paired by seed across rows, every finished run kept (a run with no value counts at the split's chance).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from peftlab.errors import PeftlabError
from peftlab.lab.study_spec import Section, StudySpec, load_study_spec, shipped


def float_list(values: Iterable, what: str, example: str = "2,4,8") -> tuple[float, ...]:
    out = []
    for value in values:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise PeftlabError(f"{what}: '{value}' is not a number", fix=f"e.g. {what} {example}") from None
        if not math.isfinite(number) or number <= 0:
            raise PeftlabError(f"{what}: {value} must be a finite number > 0")
        out.append(number)
    if len(set(out)) != len(out):
        raise PeftlabError(f"{what}: a value is given twice ({', '.join(map(str, out))})")
    return tuple(out)


def check_seeds(start, count, selection_seeds: int, *, minimum: int = 2) -> None:
    """The held-out seeds: at least ``minimum`` (2: pairs), within the seed range, after the selection seeds."""
    if isinstance(count, bool) or not isinstance(count, int) or count < minimum:
        raise PeftlabError(f"--heldout-seeds must be an integer >= {minimum}{' (pairs)' if minimum == 2 else ''}, "
                           f"got {count!r}")
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < 2**31 - 1000:
        raise PeftlabError(f"--heldout-seed-start must be an integer in [0, 2**31 - 1000), got {start!r}")
    if start + count > 2**31:  # else a list of seeds no machine can hold
        raise PeftlabError(f"--heldout-seeds {count} from --heldout-seed-start {start} goes past seed 2**31 - 1",
                           fix="held-out seeds are a few dozen runs, e.g. --heldout-seeds 10")
    if start < selection_seeds:
        raise PeftlabError(f"--heldout-seed-start {start} overlaps the selection seeds 0-{selection_seeds - 1}",
                           fix="held-out seeds must be seeds no selection used")


def key_ablation_targets(targets: str) -> str | None:
    """{q,v} -> {q,k,v}: the same update with W_k trained too; None when k is already trained (or no q/v)."""
    from peftlab.config import parse_targets

    names = parse_targets(targets)
    return None if "k" in names or not {"q", "v"} <= set(names) else ",".join(parse_targets((*names, "k")))


@dataclass(frozen=True)
class Row:
    """One compared row: its name, its config keys, and the rate its search is centred on."""

    name: str
    keys: dict[str, Any]
    centre: float


@dataclass(frozen=True)
class Arm:
    """A config run on the held-out seeds at a stated rate (a row's pick, or a fixed-rate arm)."""

    name: str
    keys: dict[str, Any]
    rate: float


@dataclass(frozen=True)
class Protocol:
    """The fair protocol's knobs (what `--dry-run` prints and REPORT.md states)."""

    selection_samples: int = 500
    patience: int = 3
    min_delta: float = 0.002
    selection_seeds: int = 2
    grid_factor: float = 2.0
    grid_width: int = 1
    max_extensions: int = 3

    def __post_init__(self):
        for name in ("selection_samples", "patience", "selection_seeds", "grid_width", "max_extensions"):
            value, low = getattr(self, name), 0 if name == "max_extensions" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PeftlabError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if not (math.isfinite(self.grid_factor) and self.grid_factor > 1):
            raise PeftlabError(f"--grid-factor must be > 1, got {self.grid_factor}", fix="e.g. 2 (rates x2 apart)")
        if not (math.isfinite(self.min_delta) and self.min_delta >= 0):
            raise PeftlabError(f"--min-delta must be >= 0, got {self.min_delta}")

    def run_keys(self) -> dict[str, Any]:
        return {"selection_samples": self.selection_samples, "early_stop_patience": self.patience,
                "early_stop_min_delta": self.min_delta}

    @property
    def selection_seed_list(self) -> list[int]:
        return list(range(self.selection_seeds))

    def initial_steps(self) -> list[int]:
        return list(range(-self.grid_width, self.grid_width + 1))


def rate_at(row: Row, step: int, factor: float) -> float:
    """The row's rate ``step`` grid points from its centre (rounded to 6 significant digits: stable run keys)."""
    return float(f"{row.centre * factor ** step:.6g}")


def run_config(base: dict, task: str, keys: dict, rate: float, seed: int) -> dict:
    config = {**base, "task": task, **keys, "seed": seed}
    if keys.get("method") == "head":  # no adapter: its one rate is the head's; projections do not apply
        for key in ("targets", "layers", "lr", "lr_ratio"):
            config.pop(key, None)
        config["head_lr"] = rate
    else:
        config.update(lr=rate, head_lr=rate)
    return config


# --------------------------------------------------------------------------- the search


@dataclass(frozen=True)
class RateScore:
    rate: float
    step: int
    mean: float | None  # None until every selection seed has finished
    values: tuple[float, ...]
    labels: tuple[str, ...]  # the statuses of runs that are not ok


@dataclass(frozen=True)
class Search:
    """A row's search so far: the grid points tried (steps from the centre), their scores, the pick."""

    row: Row
    steps: tuple[int, ...]
    scores: tuple[RateScore, ...]
    extensions: int

    @property
    def best(self) -> RateScore | None:
        """The best rate by its selection mean (ties: the smaller rate); None until all have finished."""
        if not self.scores or any(s.mean is None for s in self.scores):
            return None
        return max(self.scores, key=lambda s: (s.mean, -s.rate))

    @property
    def at_edge(self) -> str | None:
        """"low" / "high" when the best rate is the smallest / largest tried and no other rate ties it, else None (a
        tie is a plateau, not a slope past the edge: a row that learned at no rate ties everywhere, at chance)."""
        best = self.best
        if best is None or any(s is not best and math.isclose(s.mean, best.mean, abs_tol=1e-12) for s in self.scores):
            return None
        return {max(self.steps): "high", min(self.steps): "low"}.get(best.step)  # one step: "low" (it is both)


def selection_value(row: dict) -> float:
    """A search run's score: the selection metric at its best epoch; a finished run without one counts at the
    split's chance (it is never dropped)."""
    result = row.get("result") or {}
    name = result.get("choice_metric") or result.get("primary_metric")
    value = ((result.get("best") or {}).get("metrics") or {}).get(name)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return float(result.get("majority_baseline") or 0.0)


def score_rate(row: Row, step: int, factor: float, runs: dict[int, dict | None]) -> RateScore:
    """A rate's score from its runs on the selection seeds (seed -> store row, None when not run yet)."""
    done = {seed: r for seed, r in runs.items() if r is not None and r.get("status") not in ("pending", "running")}
    values = tuple(selection_value(done[s]) for s in sorted(done))
    labels = tuple(done[s]["status"] for s in sorted(done) if done[s]["status"] != "ok")
    complete = len(done) == len(runs) and all(r.get("status") != "failed" for r in done.values())
    return RateScore(rate_at(row, step, factor), step, statistics.fmean(values) if complete else None, values, labels)


def extend(search: Search, protocol: Protocol) -> int | None:
    """The step to try next when the best rate sits at an edge and extensions remain; None when done."""
    edge = search.at_edge
    if edge is None or search.extensions >= protocol.max_extensions:
        return None
    return min(search.steps) - 1 if edge == "low" else max(search.steps) + 1


def grid_steps(protocol: Protocol, extensions: Iterable[int]) -> tuple[int, ...]:
    """The steps of a search after the given extension steps."""
    return tuple(sorted(set(protocol.initial_steps()) | set(extensions)))


@dataclass(frozen=True)
class Design:
    """A fair study: its kind, tasks, base config, rows, the protocol and the held-out seeds."""

    kind: str  # the spec's name: lambda | kasa | a user's own
    tasks: tuple[str, ...]
    base: dict[str, Any]
    rows: tuple[Row, ...]
    protocol: Protocol = field(default_factory=Protocol)
    heldout_seeds: int = 10
    heldout_seed_start: int = 100
    key_seeds: int = 20  # lambda: the W_k ablation's held-out seeds (sized for about +-2 points)
    equivalence_margin: float = 1.0
    paper_arms: bool = True  # the spec's arms at the paper's per-task settings (kasa: the 2 x 2)
    key_ablation: bool = True  # {q,k,v} at the baseline's pick (lambda: the lambda-1 row)
    spec: StudySpec | None = field(default=None, compare=False, repr=False)  # None: the shipped one of its kind

    def __post_init__(self):
        if self.spec is None:
            object.__setattr__(self, "spec", load_study_spec(shipped()[self.kind]))
        check_seeds(self.heldout_seed_start, max(self.heldout_seeds, self.key_seeds), self.protocol.selection_seeds)
        if not self.rows:
            raise PeftlabError("the study has no rows", fix="give --rows (kasa) or --ratios (lambda)")

    @property
    def heldout_seed_list(self) -> list[int]:
        return list(range(self.heldout_seed_start, self.heldout_seed_start + self.heldout_seeds))

    @property
    def key_seed_list(self) -> list[int]:
        return list(range(self.heldout_seed_start, self.heldout_seed_start + max(self.key_seeds,
                                                                                  self.heldout_seeds)))

    def base_for(self, task: str) -> dict:
        return {**self.base, **self.protocol.run_keys(), "task": task}

    @property
    def section(self) -> Section:
        return self.spec.section

    def record(self) -> dict:
        """The design as plan.json holds it (its spec is named by ``kind``, not copied)."""
        fields = {k: v for k, v in asdict(self).items() if k != "spec"}
        return json.loads(json.dumps(fields, default=str))

    def swept_value(self, keys: dict) -> float | None:
        """The row's value of the spec's swept key (lambda: lr_ratio, 1 where unset); None without a swept key."""
        swept = self.section.swept
        return None if swept is None else float(keys.get(swept["key"], swept["baseline"]))

    def baseline_row(self) -> Row | None:
        """The row at the swept key's baseline (lambda 1), against which the other rows are compared."""
        swept = self.section.swept
        return next((r for r in self.rows if swept and self.swept_value(r.keys) == swept["baseline"]), None)


def search_configs(design: Design, task: str, row: Row, steps: Iterable[int]) -> list[dict]:
    factor = design.protocol.grid_factor
    return [run_config(design.base_for(task), task, row.keys, rate_at(row, step, factor), seed)
            for step in steps for seed in design.protocol.selection_seed_list]


def heldout_configs(design: Design, task: str, arms: Iterable[Arm], seeds: list[int] | None = None) -> list[dict]:
    seeds = design.heldout_seed_list if seeds is None else seeds
    return [run_config(design.base_for(task), task, arm.keys, arm.rate, seed) for seed in seeds for arm in arms]


def paper_arms(design: Design, task: str) -> list[Arm]:
    """The spec's fixed arms at the task's paper rate (kasa: LoRA at the authors' rate, KaSA at their settings:
    the 2 x 2 whose other two cells are the tuned rows); none when the design leaves them out."""
    if not design.paper_arms:
        return []
    settings = design.spec.paper(task) if design.section.paper_arms else {}
    return [Arm(arm.name, {**arm.keys, **{k: settings[k] for k in arm.paper}}, float(settings["lr"]))
            for arm in design.section.paper_arms]


def rate_controls(design: Design, off: Arm, baseline: Row) -> list[Arm]:
    """The baseline at the best swept row's rate and at that rate x its swept value (lambda 1 at the best lambda
    > 1 row's eta_QK and at its eta_V: "a larger eta_V" against "a larger rate")."""
    names = design.section.controls
    if len(names) != 2:
        return []
    value = design.swept_value(off.keys)
    return [Arm(names[0], baseline.keys, off.rate), Arm(names[1], baseline.keys, float(f"{off.rate * value:.6g}"))]
