"""``peftlab report PATH...``: the papers' table from results stores or run folders, with honest statistics.

Inputs: each PATH is a sweep's ``results.sqlite`` (or the sweep's output folder holding it), or a run folder
written by ``peftlab train`` (``result.json``, optionally ``config.yaml``), so ``peftlab report runs/*/``
works; a folder with only ``config.yaml`` is an unfinished run. Anything else is an error.

Rows are configs grouped without the seed (nor task, output folder, or settings that vary only with the
task, such as a per-task epoch count); columns are tasks (their primary metric, ``best`` epoch by default),
an Avg column (mean over tasks of the cell means, only for rows with every task, and left out when a column
is a lower-is-better metric such as eval_loss) and #Param. A cell is
``mean ± std (n)`` with the sample std (ddof=1) over seeds. Runs that diverged, collapsed or failed are
never averaged in: they are counted in the cell (``71.2 ± 0.8 (3) [1 collapsed]``), and a cell with only
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

import csv
import io
import math
import statistics
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from peftlab.errors import PeftlabError, closest
from peftlab.lab.store import NOT_OK, load_rows

# Never row-distinguishing: bookkeeping, the seed (averaged over) and the task (the columns).
NON_RESULT_KEYS = ("output_dir", "resume", "overwrite", "seed", "task", "log_every", "checkpoint_every",
                   "eval_batch_size", "data_dir", "allow_pickle", "trust_remote_code", "threads", "report_to")
# Keys that cannot change an untrained model's metrics: the before-fine-tuning rows pool over them.
TRAINING_ONLY_KEYS = ("lr", "lr_ratio", "head_lr", "weight_decay", "warmup_ratio", "epochs", "batch_size",
                      "max_grad_norm", "max_train_samples", "dropout", "kasa_beta", "kasa_gamma", "kasa_reduction")
# Label columns come in this order when they vary; others follow alphabetically.
LABEL_ORDER = ("model", "method", "targets", "rank", "alpha", "lr", "lr_ratio", "head_lr", "epochs", "batch_size",
               "max_length", "weight_decay", "dropout")
UNSCALED_HINTS = ("loss", "perplexity", "ppl")
MARK = "†"
TESTS = {  # --test -> (equal_var of scipy.stats.ttest_ind, the footnote's name)
    "welch": (False, "Welch's t-test (unequal variances; scipy.stats.ttest_ind equal_var=False)"),
    "student": (True, "Student's t-test (pooled variance; scipy.stats.ttest_ind equal_var=True)"),
}
CORRECTIONS = ("bh", "none")
PARAM_CONVENTIONS = {
    "total": "#Param: all trainable parameters, the classification head included once (--params total).",
    "adapter": "#Param: the adapter's trainable parameters only, the classification head left out (--params adapter).",
    "yao": "#Param in Yao et al.'s convention (--params yao): adapter + 2 × classification head for adapter "
           "methods, all trainable parameters (weights + head once) for full fine-tuning.",
}
MAJORITY = "majority class"
# Task kinds with a majority class (the instruction tasks' majority_baseline is a placeholder 0).
MAJORITY_KINDS = ("classification", "regression")


# --------------------------------------------------------------------------- key=value filters


def parse_filter(text: str | None, *, what: str = "--where") -> dict[str, Any]:
    """``"method=lora,targets=q,k,v,lr_ratio=1"`` -> ``{"method": "lora", "targets": "q,k,v", "lr_ratio": 1.0}``.

    A comma piece without ``=`` continues the previous value (so ``targets=q,k,v`` works). Keys are config
    keys (closest valid key suggested); values are typed like the config's.
    """
    if not text or not text.strip():
        return {}
    from dataclasses import fields

    from peftlab.config import TrainConfig, _coerce

    names = [f.name for f in fields(TrainConfig)]
    pairs: list[list[str]] = []
    for piece in text.split(","):
        if "=" in piece:
            key, _, value = piece.partition("=")
            pairs.append([key.strip().replace("-", "_"), value.strip()])
        elif pairs and piece.strip():
            pairs[-1][1] += "," + piece.strip()
        elif piece.strip():
            raise PeftlabError(f"{what} '{text}': '{piece}' is not key=value",
                               fix=f'e.g. {what} "method=lora,lr_ratio=2"')
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key not in names:
            raise PeftlabError(f"unknown config key '{key}' in {what}{closest(key, names)}",
                               fix="use keys of `peftlab train --help` (method, targets, rank, lr, lr_ratio, task...)")
        typed = _coerce(TrainConfig, key, value, what)
        out[key] = ",".join(_canonical_targets(typed)) if key == "targets" else typed
    return out


def _canonical_targets(value) -> tuple[str, ...]:
    from peftlab.methods.targets import parse_targets

    return parse_targets(value)


def matches(config: dict, wanted: dict[str, Any]) -> bool:
    for key, value in wanted.items():
        have = config.get(key)
        if key == "targets" and have is not None:
            have = ",".join(_canonical_targets(have))
        if isinstance(value, float) and isinstance(have, (int, float)) and not isinstance(have, bool):
            if not math.isclose(float(have), value, rel_tol=1e-9, abs_tol=0.0):
                return False
        elif isinstance(value, str) and isinstance(have, str):
            if have.lower() != value.lower():
                return False
        elif have != value:
            return False
    return True


# --------------------------------------------------------------------------- runs


@dataclass
class RunRecord:
    key: str
    status: str
    config: dict
    result: dict | None
    task: str
    seed: int
    metric: str | None
    value: float | None
    before: bool  # an epochs-0 run: the untrained model


def collect(rows: Iterable[dict], *, which: str = "best", metric: str | None = None,
            where: dict[str, Any] | None = None) -> tuple[list[RunRecord], Counter]:
    """Finished/failed runs as records; also counts of the rows left out (pending, running)."""
    records, skipped = [], Counter()
    for row in rows:
        config = (row["result"] or {}).get("config") or row["config"] or {}
        before = int(config.get("epochs", 1)) == 0
        if where:  # the before-fine-tuning reference ignores filters on settings that only affect training
            wanted = {k: v for k, v in where.items() if not (before and k in TRAINING_ONLY_KEYS)}
            if not matches(config, wanted):
                continue
        if row["status"] in ("pending", "running"):
            skipped[row["status"]] += 1
            continue
        result = row["result"]
        name, value = None, None
        if result:
            name = metric or result.get("primary_metric")
            if before:
                section = result.get("before") or result.get("final") or {}
            else:
                section = result.get(which) or {}
            value = (section.get("metrics") or {}).get(name)
            if value is not None:
                value = float(value)
        records.append(RunRecord(key=row["key"], status=row["status"], config=config, result=result,
                                 task=str(config.get("task")), seed=int(config.get("seed", 0)), metric=name,
                                 value=value, before=before))
    return records, skipped


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
        from peftlab.tasks.metrics import LOWER_IS_BETTER

        return not any(metric in LOWER_IS_BETTER for metric in self.metrics.values())

    def avg(self, row: Row) -> float | None:
        return row.avg(self.tasks) if self.averageable else None

    @property
    def display_rows(self) -> list[Row]:
        """The rows as rendered: before fine-tuning, majority class, then the trained configs."""
        before = [r for r in self.rows if r.before]
        return before + ([self.majority] if self.majority else []) + [r for r in self.rows if not r.before]


def _group_config(config: dict, drop: Iterable[str]) -> dict:
    drop = set(drop)
    return {k: v for k, v in config.items() if k not in drop}


def _freeze(config: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))


def task_determined_keys(records: list[RunRecord]) -> dict[str, dict[str, Any]]:
    """Keys that take one value per task but differ across tasks (per-task settings): key -> {task: value}."""
    by_task: dict[str, dict[str, set]] = {}
    for rec in records:
        for key, value in rec.config.items():
            if key in NON_RESULT_KEYS:
                continue
            by_task.setdefault(rec.task, {}).setdefault(key, set()).add(_hashable(value))
    if len(by_task) < 2:
        return {}
    keys = set.intersection(*(set(d) for d in by_task.values()))
    out = {}
    for key in sorted(keys):
        per_task = {task: d[key] for task, d in by_task.items()}
        if all(len(v) == 1 for v in per_task.values()) and len({next(iter(v)) for v in per_task.values()}) > 1:
            out[key] = {task: next(iter(v)) for task, v in per_task.items()}
    return out


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def _task_order(tasks: Iterable[str]) -> list[str]:
    from peftlab.tasks.table import TASKS

    order = list(TASKS)
    return sorted(set(tasks), key=lambda t: (order.index(t) if t in order else len(order), t))


def _sort_value(key: str, value):
    if key == "method":
        from peftlab.methods.table import METHODS

        order = list(METHODS)
        return (0, order.index(value) if value in order else len(order), str(value))
    if isinstance(value, bool) or value is None:
        return (1, 0, str(value))
    if isinstance(value, (int, float)):
        return (0, float(value), "")
    return (1, 0, str(value))


def auto_scale(metric_names: Iterable[str]) -> float:
    names = [m for m in metric_names if m]
    if names and all(not any(h in m.lower() for h in UNSCALED_HINTS) for m in names):
        return 100.0
    return 1.0


def param_count(trainable: dict | None, convention: str, method: str | None) -> int | None:
    """A run's #Param under ``convention`` (total, adapter or yao) from result.json's ``trainable_params``."""
    trainable = trainable or {}
    if convention == "yao":
        if method == "full":  # Yao et al.'s full FT: every trainable weight, the head once
            return trainable.get("total")
        adapter, head = trainable.get("adapter"), trainable.get("head")
        return None if adapter is None or head is None else int(adapter) + 2 * int(head)
    return trainable.get(convention)


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
    trained = [r for r in records if not r.before]
    per_task = task_determined_keys(trained)
    tasks = _task_order(r.task for r in records)
    metrics: dict[str, str] = {}
    for rec in records:
        if rec.metric and rec.task not in metrics:
            metrics[rec.task] = rec.metric
    drop = set(NON_RESULT_KEYS) | set(per_task)

    groups: dict[tuple, Row] = {}
    seen_before: set[tuple] = set()
    for rec in records:
        if rec.before:
            config = _group_config(rec.config, drop | set(TRAINING_ONLY_KEYS))
        else:
            config = _group_config(rec.config, drop)
        gkey = (rec.before, _freeze(config))
        row = groups.setdefault(gkey, Row(config=config, label={}, before=rec.before))
        if rec.before:  # identical untrained models repeated across a training grid count once per seed
            dedupe = (gkey, rec.task, rec.seed)
            if dedupe in seen_before:
                continue
            seen_before.add(dedupe)
        cell = row.cells.setdefault(rec.task, Cell())
        if rec.status in NOT_OK:
            cell.excluded[rec.status] += 1
        elif rec.value is None or not math.isfinite(rec.value):
            cell.excluded["missing metric"] += 1
        else:
            cell.values.append(rec.value)
        if rec.result and not rec.before:
            count = param_count(rec.result.get("trainable_params"), params, rec.config.get("method"))
            if count is not None:
                row.params.add(int(count))

    trained_rows = [r for r in groups.values() if not r.before]
    before_rows = [r for r in groups.values() if r.before]
    label_keys = _varying_keys([r.config for r in trained_rows])
    if not label_keys and trained_rows:  # a single row still says what it is
        label_keys = ["method"]
    for row in trained_rows:
        row.label = {k: row.config.get(k) for k in label_keys}
    before_keys = _varying_keys([r.config for r in before_rows])
    for row in before_rows:
        extra = ", ".join(f"{k}={_fmt_value(row.config.get(k))}" for k in before_keys)
        row.name = "before fine-tuning" + (f" ({extra})" if extra else "")
        row.label = {k: None for k in label_keys}
    trained_rows.sort(key=lambda r: tuple(_sort_value(k, r.label.get(k)) for k in label_keys))
    before_rows.sort(key=lambda r: r.name)
    majority, majority_differ = _majority_row(records, label_keys)

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
    if baseline:
        wanted = parse_filter(baseline, what="--baseline")
        hits = [r for r in trained_rows if matches(r.config, wanted)]
        if len(hits) != 1:
            vary = ", ".join(label_keys) or "method"
            raise PeftlabError(
                f"--baseline '{baseline}' matches {len(hits)} rows of the table, not 1",
                fix=f"name one row by the keys that vary ({vary})" if hits else f"the rows vary in: {vary}")
        table.baseline, table.baseline_text = hits[0], baseline
        _significance(table)
    if majority_differ:
        ranges = ", ".join(f"{task} {lo * table.scale:.4g}–{hi * table.scale:.4g}"
                           for task, lo, hi in sorted(majority_differ, key=lambda d: tasks.index(d[0])))
        table.notes.append(f"{MAJORITY}: the runs' dev sets differ (max_eval_samples/eval_seed?), so does the "
                           f"majority-class score ({ranges}); the row shows the mean over runs")
    if per_task:
        settings = [f"{k} " + ", ".join(f"{t}={_fmt_value(v)}" for t, v in sorted(vals.items()))
                    for k, vals in per_task.items()]
        table.notes.append("per-task settings: " + "; ".join(settings))
    if skipped:
        unfinished = ", ".join(f"{n} {s}" for s, n in sorted(skipped.items()))
        table.notes.append(f"not in the table (unfinished): {unfinished}")
    return table


def _varying_keys(configs: list[dict]) -> list[str]:
    keys = sorted({k for c in configs for k in c})
    varying = [k for k in keys if len({_hashable(c.get(k)) for c in configs}) > 1]
    ordered = [k for k in LABEL_ORDER if k in varying]
    return ordered + [k for k in varying if k not in ordered]


def _majority_row(records: list[RunRecord], label_keys: list[str]) -> tuple[Row | None, list[tuple]]:
    """The majority-class row (None when no task has one) and the ``(task, lowest, highest)`` of the tasks
    whose runs disagree (different dev examples).

    Per task: every run's ``majority_baseline`` that scores the reported metric (the task's primary metric) of a
    GLUE-style task; instruction tasks (no classes) and other metrics (``--metric``) get no cell."""
    from peftlab.tasks.table import TASKS

    row = Row(config={}, label={k: None for k in label_keys}, majority=True, name=MAJORITY)
    for rec in records:
        result = rec.result or {}
        value = result.get("majority_baseline")
        task = TASKS.get(rec.task)
        if (value is None or task is None or task.kind not in MAJORITY_KINDS
                or rec.metric != result.get("primary_metric", task.primary_metric)):
            continue
        value = float(value)
        if math.isfinite(value):
            row.cells.setdefault(rec.task, Cell()).values.append(value)
    if not row.cells:
        return None, []
    differ = [(task, min(cell.values), max(cell.values)) for task, cell in row.cells.items()
              if min(cell.values) != max(cell.values)]
    return row, differ


def _significance(table: Table) -> None:
    """p of every non-baseline trained cell vs the baseline's cell of its task (``table.test``), then the
    correction over all of them together (``table.correction``) and the marks."""
    from scipy import stats

    equal_var = TESTS[table.test][0]
    base = table.baseline
    for row in table.rows:
        if row is base or row.reference:
            continue
        for task in table.tasks:
            cell, ref = row.cells.get(task), base.cells.get(task)
            if cell is None or not cell.values:
                continue
            if ref is None or cell.n < 2 or ref.n < 2:
                table.untested += 1
                continue
            with warnings.catch_warnings():  # constant groups: "precision loss"; their p is 0 or nan (footnote)
                warnings.simplefilter("ignore", RuntimeWarning)
                cell.p = float(stats.ttest_ind(cell.values, ref.values, equal_var=equal_var).pvalue)
            table.comparisons.append((row, task))
            if len(set(cell.values)) == 1 and len(set(ref.values)) == 1:
                table.constant += 1
    cells = [row.cells[task] for row, task in table.comparisons]
    defined = [cell for cell in cells if math.isfinite(cell.p)]  # nan: no variance in either group
    if table.correction == "bh" and defined:
        adjusted = stats.false_discovery_control([cell.p for cell in defined], method="bh")
        for cell, p_adj in zip(defined, adjusted):
            cell.p_adj = float(p_adj)
    for cell in defined:
        used = cell.p if table.correction == "none" else cell.p_adj
        cell.marked = used < table.alpha


# --------------------------------------------------------------------------- rendering


def _fmt_value(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def format_params(counts: set[int]) -> str:
    if not counts:
        return "–"
    low, high = _human(min(counts)), _human(max(counts))  # heads differ a little by task (number of labels)
    return low if low == high else f"{low}–{high}"


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}" if n / size < 100 else f"{n / size:.0f}{unit}"
    return str(n)


def format_p(p: float | None, alpha: float | None = None) -> str:
    """A p-value with two significant digits (more where rounding would put it on the other side of
    ``alpha``), ``<0.001`` below 0.001 (or below alpha, if smaller), ``n/a`` when undefined."""
    if p is None:
        return ""
    if not math.isfinite(p):
        return "n/a"
    floor = 0.001 if alpha is None else min(0.001, alpha)
    if p < floor:
        return f"<{floor:g}"
    for sig in (2, 3, 4, 6):
        text = f"{p:.{sig}g}"
        if alpha is None or (float(text) < alpha) == (p < alpha):
            return text
    return repr(p)


def format_significance(cell: Cell, alpha: float | None = None) -> str:
    """``p=0.0036 (adj 0.0072)``, ``p=0.0036`` without a correction, or '' for a cell without a test."""
    if cell.p is None:
        return ""
    text = f"p{'' if format_p(cell.p, alpha).startswith('<') else '='}{format_p(cell.p, alpha)}"
    if cell.p_adj is not None:
        text += f" (adj {format_p(cell.p_adj, alpha)})"
    return text


def format_cell(cell: Cell | None, scale: float, digits: int, *, pm: str = "±", mark: str = MARK,
                alpha: float | None = None) -> str:
    """``mean ± std (n)``, then † when marked, the p-values vs the baseline, and the runs left out."""
    if cell is None or (not cell.values and not cell.excluded):
        return "–"
    bad = ", ".join(f"{n} {status}" for status, n in sorted(cell.excluded.items()))
    if not cell.values:
        return ", ".join(f"{status} ({n})" if n > 1 else status for status, n in sorted(cell.excluded.items()))
    text = f"{cell.mean * scale:.{digits}f}"
    if cell.std is not None:
        text += f" {pm} {cell.std * scale:.{digits}f}"
    text += f" ({cell.n})"
    if cell.marked:
        text += mark
    if cell.p is not None:
        text += " " + format_significance(cell, alpha)
    if bad:
        text += f" [{bad}]"
    return text


def format_majority(cell: Cell | None, scale: float, digits: int) -> str:
    """The majority-class score: one number (the runs agree), else the mean and the range."""
    if cell is None or not cell.values:
        return "–"
    lo, hi = min(cell.values), max(cell.values)
    text = f"{cell.mean * scale:.{digits}f}"
    if lo != hi:
        text += f" ({lo * scale:.{digits}f}–{hi * scale:.{digits}f})"
    return text


def _header(table: Table) -> list[str]:
    from peftlab.tasks.table import TASKS

    names = [TASKS[t].glue_dir or t.upper() if t in TASKS else t for t in table.tasks]
    # A 10k offline subset (MNLI/QNLI/QQP) is never passed off as the full task: the column says so.
    names = [f"{n} ({table.datasets[t]})" if t in table.datasets else n for n, t in zip(names, table.tasks)]
    return table.label_keys + names + ["Avg", "#Param"]


BASELINE_SUFFIX = " (baseline)"


def _label_cells(table: Table, row: Row) -> list[str]:
    if row.reference:
        cells = [""] * len(table.label_keys)
        if cells:
            cells[0] = row.name
        return cells or [row.name]
    cells = [_fmt_value(row.label.get(k)) for k in table.label_keys]
    if row is table.baseline and cells:
        cells[0] += BASELINE_SUFFIX
    return cells


def _footnote(table: Table) -> list[str]:
    metric_names = sorted(set(table.metrics.values()))
    scaled = " ×100" if table.scale == 100 else (f" ×{table.scale:g}" if table.scale != 1 else "")
    which = "best epoch" if table.which == "best" else "final epoch"
    lines = [f"{'/'.join(metric_names) or 'metric'}{scaled} at the {which}: mean ± sample std (n seeds); "
             "diverged/collapsed/failed runs are counted in [brackets] and excluded from the mean; "
             "Avg is the mean over tasks of the cell means."]
    if table.baseline is not None:
        lines.append(_significance_footnote(table))
    if table.majority is not None:
        lines.append(f"{MAJORITY}: always predicting the dev set's most frequent class "
                     "(0 for correlation metrics: a constant prediction has none).")
    lines.append(PARAM_CONVENTIONS[table.params])
    lines.extend(table.notes)
    return lines


def _significance_footnote(table: Table) -> str:
    test = TESTS[table.test][1]
    m = len(table.comparisons)
    where = f'vs the baseline ({table.baseline_text}; its row reads "{BASELINE_SUFFIX.strip()}")'
    plural = "s" if m != 1 else ""
    if table.correction == "bh":
        text = (f"{MARK} BH-adjusted p < {table.alpha:g} {where}; p: two-sided {test} over seeds; "
                f"adj: Benjamini-Hochberg (BH) over the {m} comparison{plural} in the table "
                "(scipy.stats.false_discovery_control).")
    else:
        text = (f"{MARK} p < {table.alpha:g} {where}; p: two-sided {test} over seeds; "
                f"no multiple-comparison correction over the {m} comparison{plural}.")
    if table.constant:
        text += (f" {table.constant} comparison{'s' if table.constant != 1 else ''} without any spread in either "
                 "group: p is 0 where the means differ, n/a where they are equal"
                 + (" (n/a left out of the correction)." if table.correction == "bh" else "."))
    if table.untested:
        text += f" {table.untested} cell{'s' if table.untested != 1 else ''} without p: fewer than 2 runs there " \
                "or in the baseline's cell."
    return text


def render_rows(table: Table, digits: int, *, pm: str = "±", mark: str = MARK) -> list[list[str]]:
    out = []
    for row in table.display_rows:
        if row.majority:
            cells = [format_majority(row.cells.get(t), table.scale, digits) for t in table.tasks]
        else:
            cells = [format_cell(row.cells.get(t), table.scale, digits, pm=pm, mark=mark, alpha=table.alpha)
                     for t in table.tasks]
        avg = table.avg(row)
        out.append(_label_cells(table, row) + cells + ["–" if avg is None else f"{avg * table.scale:.{digits}f}",
                                                        "–" if row.reference else format_params(row.params)])
    return out


def render_markdown(table: Table, digits: int = 1) -> str:
    header = _header(table)
    if not table.label_keys:
        header = [""] + header
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for cells in render_rows(table, digits):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(_footnote(table)) + "\n"


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"$<$",
                  ">": r"$>$"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in text)


def render_latex(table: Table, digits: int = 1) -> str:
    header = _header(table)
    if not table.label_keys:
        header = [""] + header
    n_labels = max(1, len(table.label_keys))
    spec = "l" * n_labels + "c" * (len(header) - n_labels)
    lines = [f"% {line}" for line in _footnote(table)]
    lines += [r"\begin{tabular}{" + spec + "}", r"\toprule",
              " & ".join(latex_escape(h) for h in header) + r" \\", r"\midrule"]
    rendered = render_rows(table, digits, pm="\x00", mark="\x01")
    shown = table.display_rows
    for i, (row, cells) in enumerate(zip(shown, rendered)):
        text = [latex_escape(c).replace("\x00", r"$\pm$").replace("\x01", r"$^\dagger$").replace("–", "--")
                for c in cells]
        lines.append(" & ".join(text) + r" \\")
        if row.reference and (i + 1 < len(shown) and not shown[i + 1].reference):
            lines.append(r"\midrule")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def render_csv(table: Table) -> str:
    """Unrounded numbers (scaled like the table), one line per row; p-values vs the baseline (raw and, with a
    correction, adjusted). The majority-class row: mean, std and count of the runs' majority_baseline."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    label_keys = table.label_keys or ["row"]
    head = list(label_keys) + ["before_fine_tuning"]
    for task in table.tasks:
        head += [f"{task}_mean", f"{task}_std", f"{task}_n", f"{task}_excluded", f"{task}_p", f"{task}_p_adj"]
    head += ["avg", f"params_{table.params}", "baseline"]
    writer.writerow(head)
    for row in table.display_rows:
        if row.reference:
            labels = [row.name] + [""] * (len(label_keys) - 1)
        else:
            labels = [_fmt_value(row.label.get(k)) for k in label_keys] if table.label_keys else [""]
        line = labels + [int(row.before)]
        for task in table.tasks:
            cell = row.cells.get(task) or Cell()
            line += [_num(cell.mean, table.scale), _num(cell.std, table.scale), cell.n,
                     "; ".join(f"{n} {s}" for s, n in sorted(cell.excluded.items())),
                     "" if cell.p is None else repr(cell.p), "" if cell.p_adj is None else repr(cell.p_adj)]
        avg = table.avg(row)
        line += [_num(avg, table.scale), "" if row.reference or not row.params else max(row.params),
                 int(row is table.baseline)]
        writer.writerow(line)
    return buf.getvalue()


def _num(value: float | None, scale: float) -> str:
    return "" if value is None else repr(value * scale)


RENDERERS = {"md": render_markdown, "latex": render_latex, "csv": lambda table, digits=1: render_csv(table)}


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
        from peftlab.training.run_folder import atomic_write_text

        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
