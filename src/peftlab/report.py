"""``peftlab report STORE``: the papers' table from a results store, with honest statistics.

Rows are configs grouped without the seed (nor task, output folder, or settings that vary only with the
task, such as a per-task epoch count); columns are tasks (their primary metric, ``best`` epoch by default),
an Avg column (mean over tasks of the cell means, only for rows with every task, and left out when a column
is a lower-is-better metric such as eval_loss) and #Param. A cell is
``mean ± std (n)`` with the sample std (ddof=1) over seeds. Runs that diverged, collapsed or failed are
never averaged in: they are counted in the cell (``71.2 ± 0.8 (3) [1 collapsed]``), and a cell with only
such runs names them. Runs with ``epochs: 0`` form the before-fine-tuning row(s).

``--baseline "method=lora,targets=q,k,v,lr_ratio=1"`` picks a row; every other cell is compared with the
baseline's cell of the same task by Welch's t-test over seeds (``scipy.stats.ttest_ind(equal_var=False)``)
and marked † when p < ``--alpha``. The CSV carries the p-values.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from peftlab.errors import PeftlabError, closest
from peftlab.store import NOT_OK, load_rows

# Never row-distinguishing: bookkeeping, the seed (averaged over) and the task (the columns).
NON_RESULT_KEYS = ("output_dir", "resume", "overwrite", "seed", "task", "log_every", "checkpoint_every",
                   "eval_batch_size", "data_dir", "allow_pickle", "trust_remote_code")
# Keys that cannot change an untrained model's metrics: the before-fine-tuning rows pool over them.
TRAINING_ONLY_KEYS = ("lr", "lr_ratio", "head_lr", "weight_decay", "warmup_ratio", "epochs", "batch_size",
                      "max_grad_norm", "max_train_samples", "dropout", "kasa_beta", "kasa_gamma", "kasa_reduction")
# Label columns come in this order when they vary; others follow alphabetically.
LABEL_ORDER = ("model", "method", "targets", "rank", "alpha", "lr", "lr_ratio", "head_lr", "epochs", "batch_size",
               "max_length", "weight_decay", "dropout")
UNSCALED_HINTS = ("loss", "perplexity", "ppl")
MARK = "†"


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
    from peftlab.targets import parse_targets

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
    name: str = ""  # "before fine-tuning" for before rows

    def avg(self, tasks: list[str]) -> float | None:
        means = [self.cells[t].mean if t in self.cells else None for t in tasks]
        if not means or any(m is None for m in means):
            return None
        return statistics.fmean(means)


@dataclass
class Table:
    tasks: list[str]
    label_keys: list[str]
    rows: list[Row]
    metrics: dict[str, str]  # task -> metric name
    scale: float
    which: str
    params: str
    alpha: float
    baseline: Row | None = None
    baseline_text: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def averageable(self) -> bool:
        """Avg means something only over scores that all grow with quality (not accuracy with eval_loss)."""
        from peftlab.metrics import LOWER_IS_BETTER

        return not any(metric in LOWER_IS_BETTER for metric in self.metrics.values())

    def avg(self, row: Row) -> float | None:
        return row.avg(self.tasks) if self.averageable else None


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
    from peftlab.tasks import TASKS

    order = list(TASKS)
    return sorted(set(tasks), key=lambda t: (order.index(t) if t in order else len(order), t))


def _sort_value(key: str, value):
    if key == "method":
        from peftlab.methods import METHODS

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


def build_table(rows: Iterable[dict], *, which: str = "best", metric: str | None = None, params: str = "total",
                baseline: str | None = None, alpha: float = 0.05, where: str | None = None,
                scale: float | None = None) -> Table:
    if which not in ("best", "final"):
        raise PeftlabError(f"--which must be best or final, got '{which}'")
    if params not in ("total", "adapter"):
        raise PeftlabError(f"--params must be total or adapter, got '{params}'")
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
            count = (rec.result.get("trainable_params") or {}).get(params)
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

    table = Table(tasks=tasks, label_keys=label_keys, rows=before_rows + trained_rows, metrics=metrics,
                  scale=scale if scale is not None else auto_scale(metrics.values()), which=which, params=params,
                  alpha=alpha)
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


def _significance(table: Table) -> None:
    from scipy import stats

    base = table.baseline
    for row in table.rows:
        if row is base or row.before:
            continue
        for task, cell in row.cells.items():
            ref = base.cells.get(task)
            if ref is None or cell.n < 2 or ref.n < 2:
                continue
            p = float(stats.ttest_ind(cell.values, ref.values, equal_var=False).pvalue)
            cell.p = p
            cell.marked = math.isfinite(p) and p < table.alpha


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


def format_cell(cell: Cell | None, scale: float, digits: int, *, pm: str = "±", mark: str = MARK) -> str:
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
    if bad:
        text += f" [{bad}]"
    return text


def _header(table: Table) -> list[str]:
    from peftlab.tasks import TASKS

    names = [TASKS[t].glue_dir or t.upper() if t in TASKS else t for t in table.tasks]
    return table.label_keys + names + ["Avg", "#Param"]


def _label_cells(table: Table, row: Row) -> list[str]:
    if row.before:
        cells = [""] * len(table.label_keys)
        if cells:
            cells[0] = row.name
        return cells or [row.name]
    return [_fmt_value(row.label.get(k)) for k in table.label_keys]


def _footnote(table: Table) -> list[str]:
    metric_names = sorted(set(table.metrics.values()))
    scaled = " ×100" if table.scale == 100 else (f" ×{table.scale:g}" if table.scale != 1 else "")
    which = "best epoch" if table.which == "best" else "final epoch"
    lines = [f"{'/'.join(metric_names) or 'metric'}{scaled} at the {which}: mean ± sample std (n seeds); "
             "diverged/collapsed/failed runs are counted in [brackets] and excluded from the mean; "
             "Avg is the mean over tasks of the cell means."]
    if table.baseline is not None:
        lines.append(f"{MARK} p < {table.alpha:g} vs the baseline ({table.baseline_text}), Welch's t-test over seeds.")
    lines.extend(table.notes)
    return lines


def render_rows(table: Table, digits: int, *, pm: str = "±", mark: str = MARK) -> list[list[str]]:
    out = []
    for row in table.rows:
        cells = [format_cell(row.cells.get(t), table.scale, digits, pm=pm, mark=mark) for t in table.tasks]
        avg = table.avg(row)
        out.append(_label_cells(table, row) + cells + ["–" if avg is None else f"{avg * table.scale:.{digits}f}",
                                                        "–" if row.before else format_params(row.params)])
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
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


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
    for i, (row, cells) in enumerate(zip(table.rows, rendered)):
        text = [latex_escape(c).replace("\x00", r"$\pm$").replace("\x01", r"$^\dagger$").replace("–", "--")
                for c in cells]
        lines.append(" & ".join(text) + r" \\")
        if row.before and (i + 1 < len(table.rows) and not table.rows[i + 1].before):
            lines.append(r"\midrule")
    lines += [r"\bottomrule", r"\end{tabular}"]
    return "\n".join(lines) + "\n"


def render_csv(table: Table) -> str:
    """Unrounded numbers (scaled like the table), one line per row; p-values vs the baseline."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    label_keys = table.label_keys or ["row"]
    head = list(label_keys) + ["before_fine_tuning"]
    for task in table.tasks:
        head += [f"{task}_mean", f"{task}_std", f"{task}_n", f"{task}_excluded", f"{task}_p"]
    head += ["avg", f"params_{table.params}", "baseline"]
    writer.writerow(head)
    for row in table.rows:
        if row.before:
            labels = [row.name] + [""] * (len(label_keys) - 1)
        else:
            labels = [_fmt_value(row.label.get(k)) for k in label_keys] if table.label_keys else [""]
        line = labels + [int(row.before)]
        for task in table.tasks:
            cell = row.cells.get(task) or Cell()
            line += [_num(cell.mean, table.scale), _num(cell.std, table.scale), cell.n,
                     "; ".join(f"{n} {s}" for s, n in sorted(cell.excluded.items())),
                     "" if cell.p is None else repr(cell.p)]
        avg = table.avg(row)
        line += [_num(avg, table.scale), "" if row.before or not row.params else max(row.params),
                 int(row is table.baseline)]
        writer.writerow(line)
    return buf.getvalue()


def _num(value: float | None, scale: float) -> str:
    return "" if value is None else repr(value * scale)


RENDERERS = {"md": render_markdown, "latex": render_latex, "csv": lambda table, digits=1: render_csv(table)}


# --------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "report", help="table of a results store: mean ± std over seeds per config and task",
        description="Rows: configs without the seed; columns: tasks (primary metric), Avg, #Param. Diverged, "
                    "collapsed and failed runs are counted, never averaged in.")
    parser.add_argument("stores", nargs="+", metavar="STORE",
                        help="results.sqlite of a sweep (or its output folder); several are merged")
    parser.add_argument("--format", choices=sorted(RENDERERS), default=None,
                        help="md, latex or csv (default: from --out's suffix, else md)")
    parser.add_argument("--out", default=None, help="write to this file instead of stdout")
    parser.add_argument("--which", choices=("best", "final"), default="best",
                        help="the best epoch's metrics (default, as the papers report) or the final epoch's")
    parser.add_argument("--metric", default=None, help="report this metric instead of each task's primary metric")
    parser.add_argument("--params", choices=("total", "adapter"), default="total",
                        help="#Param: all trainable parameters (default) or only the adapter's")
    parser.add_argument("--baseline", default=None, metavar="K=V,...",
                        help='row to test every other against, e.g. "method=lora,targets=q,k,v,lr_ratio=1"')
    parser.add_argument("--alpha", type=float, default=0.05, help="significance level of the marks (default 0.05)")
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
                        baseline=args.baseline, alpha=args.alpha, where=args.where, scale=args.scale)
    text = RENDERERS[fmt](table, args.digits)
    if args.out:
        from peftlab.runfiles import atomic_write_text

        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
