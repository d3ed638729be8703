"""Rendering a report :class:`~peftlab.lab.report.Table`: Markdown, LaTeX (booktabs) and CSV, through pandas.

The cells are formatted here (``mean ± std (n)``, the † mark, p-values, the runs left out); pandas lays them
out (``DataFrame.to_markdown`` via tabulate, ``to_latex``, ``to_csv``). The CSV carries unrounded numbers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pandas as pd

from peftlab.lab.records import fmt_value
from peftlab.lab.stats import TESTS

if TYPE_CHECKING:
    from peftlab.lab.report import Cell, Row, Table

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


# --------------------------------------------------------------------------- header, labels, footnote


def header(table: Table) -> list[str]:
    from peftlab.tasks.table import TASKS

    names = [TASKS[t].glue_dir or t.upper() if t in TASKS else t for t in table.tasks]
    # A 10k offline subset (MNLI/QNLI/QQP) is never passed off as the full task: the column says so.
    names = [f"{n} ({table.datasets[t]})" if t in table.datasets else n for n, t in zip(names, table.tasks)]
    labels = table.label_keys or [""]  # a table of reference rows only still has a label column
    return labels + names + ["Avg", "#Param"]


def _label_cells(table: Table, row: Row) -> list[str]:
    if row.reference:
        cells = [""] * len(table.label_keys)
        if cells:
            cells[0] = row.name
        return cells or [row.name]
    cells = [fmt_value(row.label.get(k)) for k in table.label_keys]
    if row is table.baseline and cells:
        cells[0] += BASELINE_SUFFIX
    return cells


def footnote(table: Table) -> list[str]:
    metric_names = sorted(set(table.metrics.values()))
    scaled = " ×100" if table.scale == 100 else (f" ×{table.scale:g}" if table.scale != 1 else "")
    which = "best epoch" if table.which == "best" else "final epoch"
    lines = [f"{'/'.join(metric_names) or 'metric'}{scaled} at the {which}: mean ± sample std (n seeds); "
             "diverged/collapsed/failed runs (and pruned tune trials) are counted in [brackets] and excluded from the mean; "
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


# --------------------------------------------------------------------------- the three formats


def render_frame(table: Table, digits: int, *, pm: str = "±", mark: str = MARK) -> pd.DataFrame:
    """The table as text cells, one line per displayed row (reference rows first), columns = :func:`header`."""
    lines = []
    for row in table.display_rows:
        if row.majority:
            cells = [format_majority(row.cells.get(t), table.scale, digits) for t in table.tasks]
        else:
            cells = [format_cell(row.cells.get(t), table.scale, digits, pm=pm, mark=mark, alpha=table.alpha)
                     for t in table.tasks]
        avg = table.avg(row)
        lines.append(_label_cells(table, row) + cells + ["–" if avg is None else f"{avg * table.scale:.{digits}f}",
                                                          "–" if row.reference else format_params(row.params)])
    return pd.DataFrame(lines, columns=header(table), dtype=object)


def render_markdown(table: Table, digits: int = 1) -> str:
    frame = render_frame(table, digits).map(lambda text: text.replace("|", "\\|"))
    body = frame.to_markdown(index=False, tablefmt="github", disable_numparse=True)
    return body + "\n\n" + "\n".join(footnote(table)) + "\n"


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"$<$",
                  ">": r"$>$"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in text)


def _latex_cell(text: str) -> str:
    # ± and † are rendered as placeholders first, so that escaping never touches the math they become
    return latex_escape(text).replace("\x00", r"$\pm$").replace("\x01", r"$^\dagger$").replace("–", "--")


def render_latex(table: Table, digits: int = 1) -> str:
    """A booktabs tabular, the footnote as ``%`` comments above it, a rule below the reference rows."""
    frame = render_frame(table, digits, pm="\x00", mark="\x01").map(_latex_cell)
    frame.columns = [latex_escape(name) for name in frame.columns]
    n_labels = max(1, len(table.label_keys))
    spec = "l" * n_labels + "c" * (frame.shape[1] - n_labels)
    lines = frame.to_latex(index=False, escape=False, column_format=spec).rstrip("\n").splitlines()
    references = sum(row.reference for row in table.display_rows)
    if 0 < references < len(table.display_rows):  # the reference rows lead: a rule between them and the configs
        first = lines.index(r"\midrule") + 1
        lines.insert(first + references, r"\midrule")
    return "\n".join([f"% {line}" for line in footnote(table)] + lines) + "\n"


def render_csv(table: Table) -> str:
    """Unrounded numbers (scaled like the table), one line per row; p-values vs the baseline (raw and, with a
    correction, adjusted). The majority-class row: mean, std and count of the runs' majority_baseline."""
    label_keys = table.label_keys or ["row"]
    head = list(label_keys) + ["before_fine_tuning"]
    for task in table.tasks:
        head += [f"{task}_mean", f"{task}_std", f"{task}_n", f"{task}_excluded", f"{task}_p", f"{task}_p_adj"]
    head += ["avg", f"params_{table.params}", "baseline"]
    lines = []
    for row in table.display_rows:
        if row.reference:
            labels = [row.name] + [""] * (len(label_keys) - 1)
        else:
            labels = [fmt_value(row.label.get(k)) for k in label_keys] if table.label_keys else [""]
        line = labels + [int(row.before)]
        for task in table.tasks:
            cell = row.cells.get(task)
            if cell is None:
                line += ["", "", 0, "", "", ""]
                continue
            line += [_num(cell.mean, table.scale), _num(cell.std, table.scale), cell.n,
                     "; ".join(f"{n} {s}" for s, n in sorted(cell.excluded.items())),
                     "" if cell.p is None else repr(cell.p), "" if cell.p_adj is None else repr(cell.p_adj)]
        line += [_num(table.avg(row), table.scale), "" if row.reference or not row.params else max(row.params),
                 int(row is table.baseline)]
        lines.append(line)
    # repr() keeps every digit of the floats (a p-value read back equals scipy's)
    return pd.DataFrame(lines, columns=head, dtype=object).to_csv(index=False, lineterminator="\n")


def _num(value: float | None, scale: float) -> str:
    return "" if value is None else repr(value * scale)


RENDERERS = {"md": render_markdown, "latex": render_latex, "csv": lambda table, digits=1: render_csv(table)}
