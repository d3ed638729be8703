"""``peftlab report PATH...``: the papers' table from results stores or run folders, with honest statistics.

Inputs: each PATH is a sweep's ``results.sqlite`` (or the sweep's output folder holding it), or a run folder
written by ``peftlab train`` (``result.json``, optionally ``config.yaml``), so ``peftlab report runs/*/``
works; a folder with only ``config.yaml`` is an unfinished run. Anything else is an error.

Rows are configs grouped without the seed (nor task, output folder, or settings that vary only with the
task, such as a per-task epoch count), methods in the order the runs list them (a sweep's grid order), other
keys by value; columns are tasks (their primary metric, ``best`` epoch by default),
an Avg column (mean over tasks of the cell means, only for rows with every task, and left out when a column
is a lower-is-better metric such as eval_loss) and #Param. A cell is
``mean ± std (n)`` with the sample std (ddof=1) over seeds. Runs that diverged, collapsed or failed, and
tune trials pruned before their last epoch (result.json ``stopped_early``), are never averaged in: they are counted in the cell (``71.2 ± 0.8 (3) [1 collapsed]``), and a cell with only
such runs names them. Runs with ``epochs: 0`` form the before-fine-tuning row(s). A "majority class" row
follows them: per task, the mean of the runs' ``majority_baseline`` (the primary metric of always
predicting the evaluated dev set's most frequent class; 0 for correlation metrics: CoLA's
MCC, STS-B's Pearson), for GLUE-style tasks scored on their primary metric; a note says when runs disagree.
It is ``Table.majority`` (not one of ``Table.rows``, the groups of runs); in the CSV a row labelled
"majority class" with ``before_fine_tuning`` 0 and the mean, std and count over the runs.

``--baseline "method=lora,targets=q,k,v,lr_ratio=1"`` picks a row (labelled "(baseline)"); every other cell
is compared with the baseline's cell of the same task by a two-sided two-sample t-test over seeds:
``--test welch`` (default; ``scipy.stats.ttest_ind(equal_var=False)``) or ``--test student`` (pooled
variance, ``equal_var=True``, KaSA's "independent two-sample t-test"). ``--correction bh`` (default) adjusts
the p-values of all comparisons in the table (every row × task cell with a p) together by
Benjamini-Hochberg (``scipy.stats.false_discovery_control(method="bh")``); ``--correction none`` keeps them
raw. A cell reads ``85.0 ± 1.0 (3)† p=0.0036 (adj 0.0072)``: † marks p < ``--alpha``, the adjusted p when a
correction is on. The footnote names the test and the correction; the CSV carries ``{task}_p`` and
``{task}_p_adj``. Two groups without any spread give p = 0 (different means) or an undefined p (``n/a``,
left out of the correction); the footnote counts them.

``--params`` picks the #Param convention: ``total`` (default: every trainable parameter, the classification
head included, once), ``adapter`` (the head left out) or ``yao`` (Yao et al.'s: adapter + 2 × head for every
adapter method, so their LoRA {q,v} r=8 on RoBERTa-base reads 1.48M = 294,912 + 2 × 592,130; the total for
``full`` fine-tuning). The footnote says which.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from peftlab.errors import PeftlabError, closest
from peftlab.io_utils import atomic_write_text
from peftlab.lab.records import (
    NON_RESULT_KEYS,
    TRAINING_ONLY_KEYS,
    RunRecord,
    auto_scale,
    collect,
    fmt_value,
    hashable,
    load_rows,
    matches,
    parse_filter,
    task_determined_keys,
    task_order,
    varying_keys,
)
from peftlab.lab.stats import CORRECTIONS, TESTS, compare_with_baseline
from peftlab.lab.store import NOT_OK
from peftlab.lab.tables import MAJORITY, PARAM_CONVENTIONS, RENDERERS

# Task kinds with a majority class (the instruction tasks' majority_baseline is a placeholder 0).
MAJORITY_KINDS = ("classification", "regression")


# --------------------------------------------------------------------------- the table


@dataclass
class Cell:
    values: list[float] = field(default_factory=list)
    excluded: Counter = field(default_factory=Counter)  # status -> count (diverged, collapsed, failed, missing)
    p: float | None = None
    p_adj: float | None = None  # corrected over the table's comparisons (--correction), else None
    marked: bool = False

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) >= 2 else None


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
    test: str = "welch"
    correction: str = "bh"
    comparisons: list[tuple[Row, str]] = field(default_factory=list)  # (row, task) with a p, in table order
    untested: int = 0  # non-baseline cells with values but no p (< 2 runs there or in the baseline)
    constant: int = 0  # comparisons of two groups without any spread (p is 0 or nan)
    majority: Row | None = None  # the majority-class reference row (not a group of runs: not in ``rows``)
    datasets: dict[str, str] = field(default_factory=dict)  # task -> result.json "dataset" when not full GLUE

    @property
    def averageable(self) -> bool:
        """Avg means something only over scores that all grow with quality (not accuracy with eval_loss)."""
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


def param_count(trainable: dict | None, convention: str, method: str | None) -> int | None:
    """A run's #Param under ``convention`` (total, adapter or yao) from result.json's ``trainable_params``."""
    trainable = trainable or {}
    if convention == "yao":
        if method == "full":  # Yao et al.'s full FT: every trainable weight, the head once
            return trainable.get("total")
        adapter, head = trainable.get("adapter"), trainable.get("head")
        return None if adapter is None or head is None else int(adapter) + 2 * int(head)
    return trainable.get(convention)


# --------------------------------------------------------------------------- grouping (pandas)


def records_frame(records: list[RunRecord], *, drop: set[str], params: str) -> tuple[pd.DataFrame, list[dict]]:
    """One line per record: its group (the config without ``drop``; before-fine-tuning runs also pool over
    TRAINING_ONLY_KEYS), task, seed, the value it contributes or why it is left out, #Param and the
    majority-class score. Returns the frame and each group's config (index = the frame's ``group``)."""
    group_ids: dict[tuple, int] = {}
    configs: list[dict] = []
    lines = []
    for rec in records:
        left_out = set(drop) | (set(TRAINING_ONLY_KEYS) if rec.before else set())
        config = {k: v for k, v in rec.config.items() if k not in left_out}
        frozen = (rec.before, tuple(sorted((k, hashable(v)) for k, v in config.items())))
        if frozen not in group_ids:
            group_ids[frozen] = len(configs)
            configs.append(config)
        if rec.status in NOT_OK:
            value, excluded = math.nan, rec.status
        elif (rec.result or {}).get("stopped_early"):  # a tune trial pruned after a few epochs: not a full run
            value, excluded = math.nan, "pruned"
        elif rec.value is None or not math.isfinite(rec.value):
            value, excluded = math.nan, "missing metric"
        else:
            value, excluded = rec.value, None
        result = rec.result or {}
        count = param_count(result.get("trainable_params"), params, rec.config.get("method")) \
            if rec.result and not rec.before else None
        lines.append({"group": group_ids[frozen], "before": rec.before, "task": rec.task, "seed": rec.seed,
                      "value": value, "excluded": excluded, "params": count, "majority": _majority_value(rec)})
    return pd.DataFrame(lines), configs


def _majority_value(rec: RunRecord) -> float | None:
    """The run's majority-class score, when it scores the reported metric of a GLUE-style task."""
    from peftlab.tasks.table import TASKS

    result = rec.result or {}
    value, task = result.get("majority_baseline"), TASKS.get(rec.task)
    if (value is None or task is None or task.kind not in MAJORITY_KINDS
            or rec.metric != result.get("primary_metric", task.primary_metric)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _cells(frame: pd.DataFrame) -> pd.DataFrame:
    """(group, task) -> the values averaged (in run order) and the runs left out, by reason."""
    return frame.groupby(["group", "task"], sort=False).agg(
        values=("value", lambda s: [float(v) for v in s.dropna()]),
        excluded=("excluded", lambda s: Counter(s.dropna())))


def build_table(rows: Iterable[dict], *, which: str = "best", metric: str | None = None, params: str = "total",
                baseline: str | None = None, alpha: float = 0.05, where: str | None = None,
                scale: float | None = None, test: str = "welch", correction: str = "bh") -> Table:
    if which not in ("best", "final"):
        raise PeftlabError(f"--which must be best or final, got '{which}'")
    if params not in PARAM_CONVENTIONS:
        raise PeftlabError(f"--params must be {', '.join(PARAM_CONVENTIONS)}, got '{params}'")
    if test not in TESTS:
        raise PeftlabError(f"--test must be {' or '.join(TESTS)}, got '{test}'{closest(test, TESTS)}")
    if correction not in CORRECTIONS:
        raise PeftlabError(f"--correction must be {' or '.join(CORRECTIONS)}, got '{correction}'")
    if not 0 < alpha < 1:
        raise PeftlabError(f"--alpha must be in (0, 1), got {alpha}")
    filters = parse_filter(where)
    records, skipped = collect(rows, which=which, metric=metric, where=filters)
    if not records:
        detail = f" ({', '.join(f'{n} {s}' for s, n in skipped.items())})" if skipped else ""
        raise PeftlabError(f"no finished runs to report{detail}" + (" match --where" if filters else ""),
                           fix="run the sweep first (peftlab sweep SPEC.yaml), or loosen --where")
    per_task = task_determined_keys([r for r in records if not r.before])
    tasks = task_order(r.task for r in records)
    metrics: dict[str, str] = {}
    for rec in records:
        if rec.metric and rec.task not in metrics:
            metrics[rec.task] = rec.metric

    frame, configs = records_frame(records, drop=set(NON_RESULT_KEYS) | set(per_task), params=params)
    majority, majority_differ = _majority_row(frame)
    # identical untrained models repeated across a training grid count once per seed
    frame = frame[~(frame["before"] & frame.duplicated(["group", "task", "seed"]))]
    groups = {gid: Row(config=configs[gid], label={}, before=bool(before))
              for gid, before in frame.groupby("group", sort=False)["before"].first().items()}
    for (gid, task), cell in _cells(frame).iterrows():
        groups[gid].cells[task] = Cell(values=cell["values"], excluded=cell["excluded"])
    trained_frame = frame[~frame["before"]]
    for gid, counts in trained_frame.groupby("group", sort=False)["params"].agg(lambda s: set(s.dropna())).items():
        groups[gid].params = {int(c) for c in counts}

    trained_rows = [r for r in groups.values() if not r.before]
    before_rows = [r for r in groups.values() if r.before]
    label_keys = varying_keys([r.config for r in trained_rows])
    if not label_keys and trained_rows:  # a single row still says what it is
        label_keys = ["method"]
    for row in trained_rows:
        row.label = {k: row.config.get(k) for k in label_keys}
    before_keys = varying_keys([r.config for r in before_rows])
    for row in before_rows:
        extra = ", ".join(f"{k}={fmt_value(row.config.get(k))}" for k in before_keys)
        row.name = "before fine-tuning" + (f" ({extra})" if extra else "")
        row.label = {k: None for k in label_keys}
    # methods in the order the runs list them (the sweep's grid order); other keys by value
    method_order = list(dict.fromkeys(str(rec.config.get("method")) for rec in records))
    trained_rows.sort(key=lambda r: tuple(_sort_value(k, r.label.get(k), method_order) for k in label_keys))
    before_rows.sort(key=lambda r: r.name)
    if majority is not None:
        majority.label = {k: None for k in label_keys}

    table = Table(tasks=tasks, label_keys=label_keys, rows=before_rows + trained_rows, metrics=metrics,
                  scale=scale if scale is not None else auto_scale(metrics.values()), which=which, params=params,
                  alpha=alpha, test=test, correction=correction, majority=majority)
    for rec in records:
        dataset = (rec.result or {}).get("dataset")
        if dataset and dataset != "glue":
            table.datasets[rec.task] = dataset
    if table.datasets:
        table.notes.append("; ".join(f"{t}: dataset {d}" + (" (10k subsets of GLUE train, 90/10 train/dev; not the "
                                                              "full task)" if d == "glue_subsets" else "")
                                     for t, d in sorted(table.datasets.items())))
    for rec in records:  # a task's own caveats (result.json "report_notes"), e.g. who judged MT-Bench
        for note in (rec.result or {}).get("report_notes") or []:
            if f"{rec.task}: {note}" not in table.notes:
                table.notes.append(f"{rec.task}: {note}")
    if baseline:
        wanted = parse_filter(baseline, what="--baseline")
        hits = [r for r in trained_rows if matches(r.config, wanted)]
        if len(hits) != 1:
            vary = ", ".join(label_keys) or "method"
            raise PeftlabError(
                f"--baseline '{baseline}' matches {len(hits)} rows of the table, not 1",
                fix=f"name one row by the keys that vary ({vary})" if hits else f"the rows vary in: {vary}")
        table.baseline, table.baseline_text = hits[0], baseline
        compare_with_baseline(table)
    if majority_differ:
        ranges = ", ".join(f"{task} {lo * table.scale:.4g}–{hi * table.scale:.4g}"
                           for task, lo, hi in sorted(majority_differ, key=lambda d: tasks.index(d[0])))
        table.notes.append(f"{MAJORITY}: the runs' dev sets differ (max_eval_samples/eval_seed?), so does the "
                           f"majority-class score ({ranges}); the row shows the mean over runs")
    if per_task:
        settings = [f"{k} " + ", ".join(f"{t}={fmt_value(v)}" for t, v in sorted(vals.items()))
                    for k, vals in per_task.items()]
        table.notes.append("per-task settings: " + "; ".join(settings))
    if skipped:
        unfinished = ", ".join(f"{n} {s}" for s, n in sorted(skipped.items()))
        table.notes.append(f"not in the table (unfinished): {unfinished}")
    return table


def _sort_value(key: str, value, method_order: list[str]):
    if key == "method":
        return (0, method_order.index(str(value)) if str(value) in method_order else len(method_order), str(value))
    if isinstance(value, bool) or value is None:
        return (1, 0, str(value))
    if isinstance(value, (int, float)):
        return (0, float(value), "")
    return (1, 0, str(value))


def _majority_row(frame: pd.DataFrame) -> tuple[Row | None, list[tuple]]:
    """The majority-class row (None when no task has one) and the ``(task, lowest, highest)`` of the tasks
    whose runs disagree (different dev examples).

    Per task: every run's ``majority_baseline`` that scores the reported metric (the task's primary metric) of a
    GLUE-style task; instruction tasks (no classes) and other metrics (``--metric``) get no cell."""
    scores = frame.dropna(subset=["majority"]).groupby("task", sort=False)["majority"].agg(list)
    if scores.empty:
        return None, []
    row = Row(config={}, label={}, majority=True, name=MAJORITY,
              cells={task: Cell(values=[float(v) for v in values]) for task, values in scores.items()})
    differ = [(task, min(cell.values), max(cell.values)) for task, cell in row.cells.items()
              if min(cell.values) != max(cell.values)]
    return row, differ


# --------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "report", help="table of results stores or run folders: mean ± std over seeds per config and task",
        description="Rows: configs without the seed; columns: tasks (primary metric), Avg, #Param. Diverged, "
                    "collapsed and failed runs are counted, never averaged in. With --baseline, every other cell "
                    "shows its p-value (and the corrected one) against the baseline's cell of its task.")
    parser.add_argument("stores", nargs="+", metavar="PATH",
                        help="results.sqlite of a sweep (or its output folder), or run folders of peftlab train "
                             "(holding result.json; e.g. runs/*/); several are merged")
    parser.add_argument("--format", choices=sorted(RENDERERS), default=None,
                        help="md, latex or csv (default: from --out's suffix, else md)")
    parser.add_argument("--out", default=None, help="write to this file instead of stdout")
    parser.add_argument("--which", choices=("best", "final"), default="best",
                        help="the best epoch's metrics (default, as the papers report) or the final epoch's")
    parser.add_argument("--metric", default=None, help="report this metric instead of each task's primary metric")
    parser.add_argument("--params", choices=tuple(PARAM_CONVENTIONS), default="total",
                        help="#Param convention: total = all trainable parameters, head included (default); "
                             "adapter = without the head; yao = Yao et al.'s: adapter + 2 x head for adapter "
                             "methods (LoRA {q,v} r=8 on RoBERTa-base: 294,912 + 2 x 592,130 = 1.48M), the total "
                             "for full fine-tuning")
    parser.add_argument("--baseline", default=None, metavar="K=V,...",
                        help='row to test every other against, e.g. "method=lora,targets=q,k,v,lr_ratio=1"')
    parser.add_argument("--test", choices=tuple(TESTS), default="welch",
                        help="two-sample t-test vs the baseline over seeds: welch (default; unequal variances, "
                             "scipy ttest_ind equal_var=False) or student (pooled variance, equal_var=True; KaSA's)")
    parser.add_argument("--correction", choices=CORRECTIONS, default="bh",
                        help="multiple-comparison correction over all the table's comparisons: bh = "
                             "Benjamini-Hochberg (default; the † marks use the adjusted p) or none")
    parser.add_argument("--alpha", type=float, default=0.05,
                        help="significance level of the † marks (default 0.05)")
    parser.add_argument("--where", default=None, metavar="K=V,...", help='only runs matching, e.g. "model=minilm-l6"')
    parser.add_argument("--digits", type=int, default=1, help="decimals in md/latex (default 1)")
    parser.add_argument("--scale", type=float, default=None,
                        help="multiply metrics by this (default: 100 for accuracy-like metrics, else 1)")
    parser.set_defaults(func=run_cli)


def run_cli(args) -> int:
    fmt = args.format
    if fmt is None:
        suffix = Path(args.out).suffix.lower() if args.out else ""
        fmt = {".tex": "latex", ".csv": "csv"}.get(suffix, "md")
    if args.digits < 0:
        raise PeftlabError(f"--digits must be >= 0, got {args.digits}")
    table = build_table(load_rows(args.stores), which=args.which, metric=args.metric, params=args.params,
                        baseline=args.baseline, alpha=args.alpha, where=args.where, scale=args.scale,
                        test=args.test, correction=args.correction)
    text = RENDERERS[fmt](table, args.digits)
    if args.out:
        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
        if fmt == "md":  # a `peftlab tune` store: its trials, winner and compute after the table
            from peftlab.lab.tune_summary import summaries_beside

            for summary in summaries_beside(args.stores):
                print("\n" + summary, end="")
    return 0
