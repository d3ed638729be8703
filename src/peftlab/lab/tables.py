"""Rendering a report :class:`~peftlab.lab.table_model.Table`: Markdown, LaTeX (booktabs) and CSV (unrounded).
The cells are formatted here; pandas lays them out (``to_markdown``, ``to_latex``, ``to_csv``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

from peftlab.lab.provenance import code_line
from peftlab.lab.records import fmt_value
from peftlab.lab.stats import CI_LEVEL, CI_METHODS, CORRECTIONS, PAIRED_TESTS, SHORT_NAMES, TESTS
from peftlab.lab.table_model import FAILED_TO_LEARN
from peftlab.lab.tables_power import POWER_COLUMNS, power_csv_values, power_footnote, power_frame
from peftlab.lab.verdicts import label_counts

if TYPE_CHECKING:
    from peftlab.lab.table_model import Cell, Comparison, Row, Table

MARK = "†"
BASELINE_SUFFIX = " (baseline)"
MAJORITY = "majority class"
PARAM_CONVENTIONS = {
    "total": "#Param: all trainable parameters, the classification head included once (--params total).",
    "adapter": "#Param: the adapter's trainable parameters only, the classification head left out (--params adapter).",
    "yao": "#Param in Yao et al.'s convention (--params yao): adapter + 2 × classification head for adapter "
           "methods, all trainable parameters (weights + head once) for full fine-tuning.",
}


# --------------------------------------------------------------------------- one cell


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


def _signed(value: float, scale: float, digits: int) -> str:
    return "n/a" if not math.isfinite(value) else f"{value * scale:+.{digits}f}"


def format_comparison(comparison: Comparison, scale: float, digits: int, *, alpha: float | None = None,
                      margin: float | None = None) -> str:
    """``Δ +5.0 (CI +2.1, +7.9) p=0.0036 (adj 0.0072), 3 pairs[, equivalent within 1]``."""
    text = (f"Δ {_signed(comparison.diff, scale, digits)} (CI {_signed(comparison.ci_low, scale, digits)}, "
            f"{_signed(comparison.ci_high, scale, digits)})")
    p = format_p(comparison.p, alpha)
    text += f" p{'' if p.startswith('<') else '='}{p}"
    if comparison.p_adj is not None:
        text += f" (adj {format_p(comparison.p_adj, alpha)})"
    if comparison.n_pairs is not None:
        text += f", {comparison.n_pairs} pair{'s' if comparison.n_pairs != 1 else ''}"
    if comparison.equivalent and margin is not None:
        text += f", equivalent within {margin:g}"
    return text


def format_cell(cell: Cell | None, scale: float, digits: int, *, pm: str = "±", mark: str = MARK,
                alpha: float | None = None, margin: float | None = None) -> str:
    """``mean ± std (n)`` over every finished run, then † when marked, the comparison with the baseline, and in
    [brackets] the labels (with the median and range where labelled runs are averaged in, and the comparison
    without them) and the runs left out."""
    if cell is None or (not cell.values and not cell.excluded and not cell.no_value):
        return "–"
    notes = []
    if cell.labels:
        notes.append(label_counts(cell.labels, cell.no_value))
    if cell.labelled_values:  # labelled runs averaged in: how the values spread
        notes.append(f"median {cell.median * scale:.{digits}f}, range {min(cell.values) * scale:.{digits}f}–"
                     f"{max(cell.values) * scale:.{digits}f}")
    sensitivity = cell.comparison.without_labels if cell.comparison is not None else None
    if sensitivity is not None:
        notes.append("without labels: " + format_comparison(sensitivity, scale, digits, alpha=alpha))
    if cell.excluded:
        notes.append("left out: " + ", ".join(f"{n} {reason}" for reason, n in sorted(cell.excluded.items())))
    if not cell.values:  # nothing measured: only what became of the runs
        return "; ".join(notes)
    text = f"{cell.mean * scale:.{digits}f}"
    if cell.std is not None:
        text += f" {pm} {cell.std * scale:.{digits}f}"
    text += f" ({cell.n})"
    if cell.comparison is not None:
        text += (mark if cell.comparison.marked else "") + " " + format_comparison(
            cell.comparison, scale, digits, alpha=alpha, margin=margin)
    return text + (f" [{'; '.join(notes)}]" if notes else "")


def format_majority(cell: Cell | None, scale: float, digits: int) -> str:
    """The majority-class score: one number (the runs agree), else the mean and the range."""
    if cell is None or not cell.values:
        return "–"
    lo, hi = min(cell.values), max(cell.values)
    text = f"{cell.mean * scale:.{digits}f}"
    if lo != hi:
        text += f" ({lo * scale:.{digits}f}–{hi * scale:.{digits}f})"
    return text


# --------------------------------------------------------------------------- header, labels, footnote


def header(table: Table) -> list[str]:
    from peftlab.tasks.table import task_title

    names = [task_title(t) for t in table.tasks]
    # A 10k offline subset (MNLI/QNLI/QQP) is never passed off as the full task: the column says so.
    names = [f"{n} ({table.datasets[t]})" if t in table.datasets else n for n, t in zip(names, table.tasks)]
    labels = table.label_keys or [""]  # a table of reference rows only still has a label column
    return labels + names + ["Avg", "#Param"]


def _label_cells(table: Table, row: Row, *, suffix: str = BASELINE_SUFFIX) -> list[str]:
    if row.reference:
        return [row.name] + [""] * (len(table.label_keys) - 1)
    cells = [fmt_value(row.label.get(k)) for k in table.label_keys]
    if row is table.baseline and cells:
        cells[0] += suffix
    return cells


def footnote(table: Table) -> list[str]:
    metric_names = sorted(set(table.metrics.values()))
    scaled = " ×100" if table.scale == 100 else (f" ×{table.scale:g}" if table.scale != 1 else "")
    which = "best epoch" if table.which == "best" else "final epoch"
    lines = [f"{'/'.join(metric_names) or 'metric'}{scaled} at the {which}: mean ± sample std (n seeds) of every "
             f"finished run at its value, ok or labelled ({'/'.join(FAILED_TO_LEARN)}; no_learning: best dev "
             "metric never clearly above chance). No run is left out for how it came out: [brackets] count the "
             "labels, with the cell's median and range (min–max) where labelled runs are averaged in; a labelled "
             "run without a value counts as 'no value' (it cannot be paired); runs that crashed (failed) or were "
             "pruned by a tune did not finish: 'left out'. Avg is the mean over tasks of the cell means."]
    if table.superseded_pruned:
        n = table.superseded_pruned
        lines.append(f"{n} pruned tune trial{'s' if n != 1 else ''} not counted: a complete run of the same config "
                     "and seed is in the table.")
    if table.baseline is not None:
        lines.append(_significance_footnote(table))
        if table.margin is not None:
            lines.append(_equivalence_footnote(table))
        if table.power:
            lines.append(power_footnote(table))
    if table.majority is not None:
        lines.append(f"{MAJORITY}: always predicting the dev set's most frequent class "
                     "(0 for correlation metrics: a constant prediction has none).")
    lines.append(PARAM_CONVENTIONS[table.params])
    lines.extend(table.notes)
    lines.append(code_line(table.code))
    return lines


def _correction_name(table: Table) -> str:
    return {"bh": "BH-adjusted ", "holm": "Holm-adjusted ", "none": ""}[table.correction]


def _significance_footnote(table: Table) -> str:
    m = len(table.comparisons)
    plural = "s" if m != 1 else ""
    where = f'vs the baseline ({table.baseline_text}; its row reads "{BASELINE_SUFFIX.strip()}")'
    paired = table.test in PAIRED_TESTS
    text = (f"{MARK} {_correction_name(table)}p < {table.alpha:g} {where}. Δ: cell minus baseline"
            f"{' (mean of the paired differences)' if paired else ' (difference of the means)'} with its "
            f"{CI_LEVEL:.0%} CI ({CI_METHODS[table.ci]}"
            f"{' of the paired differences' if paired else ''}). p: two-sided {TESTS[table.test]}")
    text += f"; {table.test_reason}" if table.test_reason else ""
    text += "; each cell states its number of pairs." if paired else "."
    if table.correction == "none":
        text += f" {CORRECTIONS['none'].capitalize()} over the {m} comparison{plural}."
    else:
        text += f" adj: {CORRECTIONS[table.correction]} over the {m} comparison{plural} in the table."
    if table.constant:
        text += (f" {table.constant} comparison{'s' if table.constant != 1 else ''} without any spread "
                 f"({'of the paired differences' if paired else 'in either group'}): p is 0 where they differ, "
                 "n/a where they are equal" + (" (n/a left out of the correction)." if table.correction != "none"
                                                else "."))
    for reason, n in sorted(table.untested.items()):
        text += f" {n} cell{'s' if n != 1 else ''} without p: {reason}."
    sensitive = sum(row.cells[task].comparison.without_labels is not None for row, task in table.comparisons)
    if sensitive:
        adjusted = f"; {_correction_name(table)}among themselves" if table.correction != "none" else ""
        text += (" without labels: the same test with the labelled runs of both cells left out, where a comparison "
                 f"holds any ({sensitive} of {m}{adjusted}).")
    return text


def _equivalence_footnote(table: Table) -> str:
    m, margin = sum(row.cells[task].comparison.tost_p is not None for row, task in table.comparisons), table.margin
    found = sum(row.cells[task].comparison.equivalent for row, task in table.comparisons)
    kind = SHORT_NAMES[table.test]
    adjusted = (f"{_correction_name(table)}over the {m} equivalence test{'s' if m != 1 else ''}"
                if table.correction != "none" else "uncorrected")
    return (f"equivalent within {margin:g}: TOST, two one-sided {kind}-tests (alternative 'greater' "
            f"against baseline − {margin:g} and 'less' against baseline + {margin:g}, in the table's points); "
            f"shown where the larger one-sided p, {adjusted}, is < {table.alpha:g} ({found} of {m} cells). No other "
            "cell is shown equivalent: a difference that is not significant is not evidence of no difference.")


# --------------------------------------------------------------------------- the three formats


def render_frame(table: Table, digits: int, *, pm: str = "±", mark: str = MARK) -> pd.DataFrame:
    """The table as text cells, one line per displayed row (reference rows first), columns = :func:`header`."""
    lines = []
    for row in table.display_rows:
        if row.majority:
            cells = [format_majority(row.cells.get(t), table.scale, digits) for t in table.tasks]
        else:
            cells = [format_cell(row.cells.get(t), table.scale, digits, pm=pm, mark=mark, alpha=table.alpha,
                                 margin=table.margin) for t in table.tasks]
        avg = table.avg(row)
        lines.append(_label_cells(table, row) + cells + ["–" if avg is None else f"{avg * table.scale:.{digits}f}",
                                                          "–" if row.reference else format_params(row.params)])
    return pd.DataFrame(lines, columns=header(table), dtype=object)


def _markdown(frame: pd.DataFrame) -> str:
    frame = frame.map(lambda text: text.replace("|", "\\|"))
    return frame.to_markdown(index=False, tablefmt="github", disable_numparse=True)


def render_markdown(table: Table, digits: int = 1) -> str:
    text = _markdown(render_frame(table, digits)) + "\n\n" + "\n".join(footnote(table)) + "\n"
    if table.power and table.comparisons:
        text += "\nPower (--power):\n\n" + _markdown(power_frame(table, digits, _label_cells)) + "\n"
    return text


# One pass (str.translate), so that the math the placeholders \x00 (±) and \x01 (†) become is never escaped again.
_LATEX = str.maketrans({"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                        "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"$<$",
                        ">": r"$>$", "\x00": r"$\pm$", "\x01": r"$^\dagger$", "–": "--", "Δ": r"$\Delta$", "−": "$-$"})


def _latex_cell(text: str) -> str:
    return text.translate(_LATEX)


def _latex_tabular(frame: pd.DataFrame, n_labels: int) -> list[str]:
    frame = frame.map(_latex_cell)
    frame.columns = [_latex_cell(name) for name in frame.columns]
    spec = "l" * n_labels + "c" * (frame.shape[1] - n_labels)
    return frame.to_latex(index=False, escape=False, column_format=spec).rstrip("\n").splitlines()


def render_latex(table: Table, digits: int = 1) -> str:
    """A booktabs tabular, the footnote as ``%`` comments above it, a rule below the reference rows; with
    --power a second tabular (the power of each comparison) after it."""
    n_labels = max(1, len(table.label_keys))
    lines = _latex_tabular(render_frame(table, digits, pm="\x00", mark="\x01"), n_labels)
    references = sum(row.reference for row in table.display_rows)
    if 0 < references < len(table.display_rows):  # the reference rows lead: a rule between them and the configs
        first = lines.index(r"\midrule") + 1
        lines.insert(first + references, r"\midrule")
    lines = [f"% {line}" for line in footnote(table)] + lines
    if table.power and table.comparisons:
        lines += ["", "% Power (--power)"] + _latex_tabular(power_frame(table, digits, _label_cells), n_labels + 1)
    return "\n".join(lines) + "\n"


CELL_COLUMNS = ("mean", "std", "n", "labels", "no_value", "excluded", "median", "min", "max", "diff", "ci_low",
                "ci_high", "n_pairs", "p", "p_adj", "diff_without_labels", "n_pairs_without_labels",
                "p_without_labels", "p_adj_without_labels")
TOST_COLUMNS = ("tost_p", "tost_p_adj", "equivalent")


def render_csv(table: Table) -> str:
    """Unrounded numbers (scaled like the table), one line per row: per task the cell's numbers (CELL_COLUMNS),
    the equivalence test with --equivalence-margin, the power with --power."""
    label_keys = table.label_keys or ["row"]
    extra = (TOST_COLUMNS if table.margin is not None else ()) + (POWER_COLUMNS if table.power else ())
    head = list(label_keys) + ["before_fine_tuning"]
    for task in table.tasks:
        head += [f"{task}_{name}" for name in CELL_COLUMNS + extra]
    head += ["avg", f"params_{table.params}", "baseline"]
    lines = []
    for row in table.display_rows:
        line = (_label_cells(table, row, suffix="") or [""]) + [int(row.before)]
        for task in table.tasks:
            line += _csv_cell(table, row.cells.get(task), extra)
        line += [_num(table.avg(row), table.scale), "" if row.reference or not row.params else max(row.params),
                 int(row is table.baseline)]
        lines.append(line)
    return pd.DataFrame(lines, columns=head, dtype=object).to_csv(index=False, lineterminator="\n")


def _csv_cell(table: Table, cell: Cell | None, extra: tuple[str, ...]) -> list:
    if cell is None:
        return ["", "", 0] + [""] * (len(CELL_COLUMNS) - 3 + len(extra))
    out = [_num(cell.mean, table.scale), _num(cell.std, table.scale), cell.n, _counts(cell.labels),
           _counts(cell.no_value), _counts(cell.excluded), _num(cell.median, table.scale),
           _num(min(cell.values) if cell.values else None, table.scale),
           _num(max(cell.values) if cell.values else None, table.scale)]
    c = cell.comparison
    if c is None:
        return out + [""] * (len(CELL_COLUMNS) - len(out) + len(extra))
    # repr() keeps every digit of the floats (a p-value read back equals scipy's)
    out += [_num(c.diff, table.scale), _num(c.ci_low, table.scale), _num(c.ci_high, table.scale),
            "" if c.n_pairs is None else c.n_pairs, repr(c.p), "" if c.p_adj is None else repr(c.p_adj)]
    s = c.without_labels
    out += ["", "", "", ""] if s is None else [
        _num(s.diff, table.scale), "" if s.n_pairs is None else s.n_pairs, repr(s.p),
        "" if s.p_adj is None else repr(s.p_adj)]
    if table.margin is not None:
        out += ["" if c.tost_p is None else repr(c.tost_p), "" if c.tost_p_adj is None else repr(c.tost_p_adj),
                int(c.equivalent)]
    if table.power:
        out += power_csv_values(c.power, table.scale)
    return out


def _counts(counts) -> str:
    return "; ".join(f"{n} {s}" for s, n in sorted(counts.items()) if n)


def _num(value: float | None, scale: float) -> str:
    return "" if value is None else repr(value * scale)


RENDERERS = {"md": render_markdown, "latex": render_latex, "csv": lambda table, digits=1: render_csv(table)}
