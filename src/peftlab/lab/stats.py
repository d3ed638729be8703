"""Significance against a baseline row: two-sample t-tests over seeds and a multiple-comparison correction.

``--test welch`` (default; ``scipy.stats.ttest_ind(equal_var=False)``) or ``student`` (pooled variance,
``equal_var=True``, KaSA's "independent two-sample t-test"); ``--correction bh`` (default) adjusts all the
table's p-values together by Benjamini-Hochberg (``scipy.stats.false_discovery_control``), ``none`` keeps
them raw. Two groups without any spread give p = 0 (different means) or nan (equal means: left out of the
correction).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from peftlab.lab.report import Table

TESTS = {  # --test -> (equal_var of scipy.stats.ttest_ind, the footnote's name)
    "welch": (False, "Welch's t-test (unequal variances; scipy.stats.ttest_ind equal_var=False)"),
    "student": (True, "Student's t-test (pooled variance; scipy.stats.ttest_ind equal_var=True)"),
}
CORRECTIONS = ("bh", "none")


def t_test_p(values: list[float], reference: list[float], test: str) -> float:
    """Two-sided p of ``values`` vs ``reference`` (nan when neither group has any spread and the means agree)."""
    from scipy import stats

    with warnings.catch_warnings():  # constant groups: "precision loss"; their p is 0 or nan (footnote)
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(stats.ttest_ind(values, reference, equal_var=TESTS[test][0]).pvalue)


def benjamini_hochberg(p_values: list[float]) -> list[float]:
    from scipy import stats

    return [float(p) for p in stats.false_discovery_control(p_values, method="bh")]


def compare_with_baseline(table: Table) -> None:
    """p of every non-baseline trained cell vs the baseline's cell of its task (``table.test``), then the
    correction over all of them together (``table.correction``) and the marks (p or adjusted p < alpha)."""
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
            cell.p = t_test_p(cell.values, ref.values, table.test)
            table.comparisons.append((row, task))
            if len(set(cell.values)) == 1 and len(set(ref.values)) == 1:
                table.constant += 1
    cells = [row.cells[task] for row, task in table.comparisons]
    defined = [cell for cell in cells if math.isfinite(cell.p)]  # nan: no variance in either group
    if table.correction == "bh" and defined:
        for cell, p_adj in zip(defined, benjamini_hochberg([cell.p for cell in defined])):
            cell.p_adj = p_adj
    for cell in defined:
        used = cell.p if table.correction == "none" else cell.p_adj
        cell.marked = used < table.alpha
