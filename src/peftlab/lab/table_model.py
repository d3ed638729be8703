"""The report's table as data: :class:`Cell` (one config × task), :class:`Row` (one config), :class:`Table`, and
:class:`Comparison` / :class:`Power` (a cell against the baseline's cell of its task). ``report`` builds these,
``stats`` compares them, ``tables`` renders them. Values are in the metric's own scale (an accuracy of 0.85, not
85); :attr:`Table.scale` is applied only when rendering.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Statuses of a run that finished without learning the task: *labels*. A labelled run is a finished run like an ok
# one: it stays in its cell's mean and in every paired comparison at its measured value, and its label is counted
# beside the cell; leaving runs out because of how they came out would bias every comparison they are in.
FAILED_TO_LEARN = ("no_learning", "collapsed", "diverged")
FINISHED_STATUSES = ("ok", *FAILED_TO_LEARN)  # runs in a cell at their value; failed (crashed) and pruned are not


@dataclass
class Power:
    """What the comparison's design can detect (``--power``): two-sided, at ``table.alpha``, 80 % power."""
    design: str  # "paired" (differences of matched seeds) or "two-sample" (pooled sd, equal seeds per row)
    n: int  # pairs (paired) or the smaller row's seeds (two-sample)
    sd: float  # sd of the paired differences, or the pooled sd of the two cells
    detectable: float | None  # smallest true difference found with 80 % power at this n (None: sd is 0)
    target: float  # the difference asked about (--power-diff, else |observed difference|)
    seeds_needed: int | None  # seeds (pairs, or per row) for 80 % power at ``target``; None: beyond the cap


@dataclass
class Comparison:
    """One cell against the baseline's cell of its task (``--test``)."""
    test: str  # paired, wilcoxon, welch or student
    diff: float  # mean(cell) - mean(baseline) (unpaired) or the mean paired difference
    ci_low: float  # 95 % confidence interval of ``diff`` (t or bootstrap)
    ci_high: float
    p: float  # two-sided; nan when undefined (no spread and no difference)
    n_pairs: int | None = None  # paired tests: the seeds present in both cells
    constant: bool = False  # no spread at all (paired differences, or both groups): p is 0 or nan
    p_adj: float | None = None  # over the table's comparisons (--correction), else None
    marked: bool = False  # p (or adjusted p) < alpha
    tost_p: float | None = None  # --equivalence-margin: max of the two one-sided p-values
    tost_p_adj: float | None = None
    equivalent: bool = False  # both one-sided tests pass after the correction
    power: Power | None = None
    # the sensitivity: the same test with both cells' labelled runs left out (None: no labelled run in the pairs,
    # or fewer than 2 pairs without them); its p is corrected over the sensitivity comparisons, apart
    without_labels: Comparison | None = None


@dataclass
class Cell:
    values: list[float] = field(default_factory=list)  # every finished run with a measured value, in run order
    seeds: list[int] = field(default_factory=list)  # the seed of each value (pairing matches on it)
    statuses: list[str] = field(default_factory=list)  # the status of each value: ok or a label (FAILED_TO_LEARN)
    no_value: Counter = field(default_factory=Counter)  # label -> labelled runs without a value: counted, unpaired
    excluded: Counter = field(default_factory=Counter)  # reason -> runs left out: failed (crashed), pruned, ...
    comparison: Comparison | None = None

    def __post_init__(self) -> None:
        if not self.statuses:  # a cell built from values alone (the majority row, tests): all of them ok
            self.statuses = ["ok"] * len(self.values)
        if len(self.statuses) != len(self.values):
            raise ValueError(f"{len(self.values)} values but {len(self.statuses)} statuses")

    def add_run(self, status: str, seed: int, value: float | None) -> None:
        """One run of the cell: a finished run (ok or labelled) at its value; a labelled run without a value under
        ``no_value``; anything else (crashed, pruned, an ok run missing the metric) under ``excluded``."""
        measured = isinstance(value, (int, float)) and math.isfinite(value)
        if status in FINISHED_STATUSES and measured:
            self.values.append(float(value))
            self.seeds.append(int(seed))
            self.statuses.append(status)
        elif status in FAILED_TO_LEARN:
            self.no_value[status] += 1
        else:
            self.excluded["missing metric" if status == "ok" else status] += 1

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) >= 2 else None

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def labels(self) -> Counter:
        """label -> the cell's labelled runs, with a value or without."""
        return Counter(s for s in self.statuses if s != "ok") + self.no_value

    @property
    def labelled(self) -> int:
        return sum(self.labels.values())

    @property
    def labelled_values(self) -> int:
        """Labelled runs in the mean and the pairs (the sensitivity comparison leaves them out)."""
        return sum(s != "ok" for s in self.statuses)

    def ok_only(self) -> Cell:
        """The cell without its labelled runs: the sensitivity comparison's side."""
        kept = [i for i, s in enumerate(self.statuses) if s == "ok"]
        return Cell(values=[self.values[i] for i in kept], seeds=[self.seeds[i] for i in kept],
                    statuses=["ok"] * len(kept), excluded=Counter(self.excluded))

    def per_seed(self) -> dict[int, float]:
        """seed -> its value (the mean, should two runs of the cell share a seed)."""
        by_seed: dict[int, list[float]] = {}
        for seed, value in zip(self.seeds, self.values):
            by_seed.setdefault(seed, []).append(value)
        return {seed: statistics.fmean(values) for seed, values in by_seed.items()}


@dataclass
class Row:
    config: dict  # the grouping config (without seed, task, ...)
    label: dict[str, Any]
    before: bool = False
    cells: dict[str, Cell] = field(default_factory=dict)
    params: set[int] = field(default_factory=set)
    name: str = ""  # "before fine-tuning" for before rows, "majority class" for the majority row
    majority: bool = False  # the majority-class reference row (cells: each run's majority_baseline)

    @property
    def reference(self) -> bool:
        """Not a trained config: the before-fine-tuning and majority-class rows."""
        return self.before or self.majority

    def avg(self, tasks: list[str]) -> float | None:
        means = [self.cells[t].mean if t in self.cells else None for t in tasks]
        if not means or any(m is None for m in means):
            return None
        return statistics.fmean(means)


@dataclass
class CodeSummary:
    """Which code the table's runs ran (``lab/provenance``)."""
    groups: Counter = field(default_factory=Counter)  # commit sha / "source <digest>" / "unknown" -> runs
    dirty: int = 0  # runs from a tree with uncommitted changes
    digests: int = 0  # distinct source digests recorded
    runs: int = 0


@dataclass
class Table:
    tasks: list[str]
    label_keys: list[str]
    rows: list[Row]  # groups of runs: the before-fine-tuning rows, then the trained configs
    metrics: dict[str, str]  # task -> metric name
    scale: float
    which: str
    params: str
    alpha: float
    baseline: Row | None = None
    baseline_text: str = ""
    notes: list[str] = field(default_factory=list)
    test: str = "paired"  # the test used (after --test auto chose)
    test_requested: str = "auto"  # --test as given
    test_reason: str = ""  # why auto chose what it chose
    correction: str = "bh"
    ci: str = "t"  # t or bootstrap
    margin: float | None = None  # --equivalence-margin, in the table's scale
    power: bool = False
    power_diff: float | None = None  # --power-diff, in the table's scale
    comparisons: list[tuple[Row, str]] = field(default_factory=list)  # (row, task) with a p, in table order
    untested: Counter = field(default_factory=Counter)  # reason -> non-baseline cells with values but no p
    constant: int = 0  # comparisons without any spread (p is 0 or nan)
    majority: Row | None = None  # the majority-class reference row (not a group of runs: not in ``rows``)
    datasets: dict[str, str] = field(default_factory=dict)  # task -> result.json "dataset" when not full GLUE
    code: CodeSummary = field(default_factory=CodeSummary)
    superseded_pruned: int = 0  # pruned trials left out: a complete run of the same config and seed exists

    @property
    def paired(self) -> bool:
        return self.test in ("paired", "wilcoxon")

    @property
    def averageable(self) -> bool:
        """Avg means something only over scores that all grow with quality (not accuracy with eval_loss)."""
        from peftlab.lab.records import auto_scale
        from peftlab.tasks.table import LOWER_IS_BETTER

        # nor over scores on different scales (MT-Bench's 1-10 with an accuracy in [0, 1])
        return (not any(metric in LOWER_IS_BETTER for metric in self.metrics.values())
                and len({auto_scale([metric]) for metric in self.metrics.values()}) <= 1)

    def avg(self, row: Row) -> float | None:
        return row.avg(self.tasks) if self.averageable else None

    @property
    def display_rows(self) -> list[Row]:
        """The rows as rendered: before fine-tuning, majority class, then the trained configs."""
        before = [r for r in self.rows if r.before]
        return before + ([self.majority] if self.majority else []) + [r for r in self.rows if not r.before]
