"""Every cell against the baseline's cell of its task: a test, the difference with its 95 % CI, equivalence
(TOST), a multiple-comparison correction and power, all scipy's but Holm's step-down (no dependency has it).

Runs of different rows at the same seed train on the same subset and are scored on the same dev set, so the
paired tests match cells by seed. ``--ci bootstrap`` resamples with a fixed seed, so a table is reproducible.
TOST's p is the larger one-sided p (intersection-union). Labelled runs are in every comparison at their value;
:func:`without_labels` repeats the test without them, a family of its own for the correction.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from peftlab.lab.table_model import Cell, Comparison, Power, Table

SHORT_NAMES = {"paired": "paired t", "wilcoxon": "Wilcoxon signed-rank", "welch": "Welch t", "student": "Student t"}
TESTS = {  # --test -> the footnote's name
    "auto": "paired when the rows share seeds, else Welch's",
    "paired": "paired t-test over the seeds both cells ran, matched by seed (scipy.stats.ttest_rel)",
    "wilcoxon": "Wilcoxon signed-rank test over the seeds both cells ran, matched by seed (scipy.stats.wilcoxon)",
    "welch": "Welch's t-test (unequal variances; scipy.stats.ttest_ind equal_var=False)",
    "student": "Student's t-test (pooled variance; scipy.stats.ttest_ind equal_var=True)",
}
PAIRED_TESTS = ("paired", "wilcoxon")
CORRECTIONS = {  # --correction -> the footnote's name
    "bh": "Benjamini-Hochberg (BH; false discovery rate, scipy.stats.false_discovery_control)",
    "holm": "Holm's step-down (family-wise error rate)",
    "none": "no multiple-comparison correction",
}
CI_METHODS = {  # --ci -> the footnote's name
    "t": "t interval",
    "bootstrap": "BCa bootstrap (scipy.stats.bootstrap, 9,999 resamples, seed 0)",
}
CI_LEVEL = 0.95
POWER_TARGET = 0.8
BOOTSTRAP_RESAMPLES = 9999
BOOTSTRAP_SEED = 0
MAX_SEEDS = 10_000  # --power's seeds-needed search stops here ("> 10000")


# --------------------------------------------------------------------------- which test


def choose_test(table: Table) -> None:
    """``table.test`` from ``table.test_requested``; ``auto`` pairs when the compared rows share seeds."""
    if table.test_requested != "auto":
        table.test = table.test_requested
        return
    unshared = testable = 0
    for _, _, cell, ref in _cells_to_compare(table):
        if ref is not None and cell.n >= 2 and ref.n >= 2:
            testable += 1
            unshared += len(set(cell.seeds) & set(ref.seeds)) < 2
    if unshared:
        table.test = "welch"
        table.test_reason = (f"--test auto chose Welch's: {unshared} of {testable} comparisons share fewer than 2 "
                             "seeds with the baseline (--test paired pairs the others)")
    else:
        table.test = "paired"
        table.test_reason = "--test auto chose it: the compared rows share seeds"


def _cells_to_compare(table: Table):
    """``(row, task, cell, the baseline's cell)`` of every trained cell with values but the baseline's."""
    base = table.baseline
    for row in table.rows:
        if row is base or row.reference:
            continue
        for task in table.tasks:
            cell = row.cells.get(task)
            if cell is not None and cell.values:
                yield row, task, cell, base.cells.get(task)


def paired_values(cell: Cell, reference: Cell) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The two cells' values at the seeds both ran (ascending), and those seeds."""
    mine, theirs = cell.per_seed(), reference.per_seed()
    seeds = sorted(set(mine) & set(theirs))
    return (np.array([mine[s] for s in seeds], dtype=float), np.array([theirs[s] for s in seeds], dtype=float),
            seeds)


def untestable(cell: Cell, reference: Cell | None, test: str) -> str | None:
    """Why ``cell`` gets no p against ``reference`` under ``test`` (None: it gets one)."""
    if reference is None or not reference.values:
        return "no runs in the baseline's cell"
    if test in PAIRED_TESTS:
        if len(set(cell.seeds) & set(reference.seeds)) < 2:
            return "fewer than 2 seeds in common with the baseline's cell"
    elif cell.n < 2 or reference.n < 2:
        return "fewer than 2 runs there or in the baseline's cell"
    return None


# --------------------------------------------------------------------------- one comparison


def _p_value(test: str, x: np.ndarray, y: np.ndarray, alternative: str = "two-sided") -> float:
    from scipy import stats

    # constant inputs make scipy warn ("precision loss", "sample size too small"); the footnote says so
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if test == "paired":
            return float(stats.ttest_rel(x, y, alternative=alternative).pvalue)
        if test == "wilcoxon":
            try:
                return float(stats.wilcoxon(x, y, alternative=alternative).pvalue)
            except ValueError:  # every difference is zero
                return math.nan
        return float(stats.ttest_ind(x, y, equal_var=test == "student", alternative=alternative).pvalue)


def _interval(test: str, ci: str, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    from scipy import stats

    paired = test in PAIRED_TESTS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if ci == "bootstrap":
            result = stats.bootstrap((x - y,) if paired else (x, y), np.mean if paired else _mean_difference,
                                     n_resamples=BOOTSTRAP_RESAMPLES, confidence_level=CI_LEVEL,
                                     rng=np.random.default_rng(BOOTSTRAP_SEED))
            low, high = result.confidence_interval
        elif paired:
            low, high = stats.ttest_rel(x, y).confidence_interval(CI_LEVEL)
        else:
            low, high = stats.ttest_ind(x, y, equal_var=test == "student").confidence_interval(CI_LEVEL)
    return float(low), float(high)


def _mean_difference(a, b, axis=-1):
    return np.mean(a, axis=axis) - np.mean(b, axis=axis)


def compare(cell: Cell, reference: Cell, *, test: str, ci: str = "t", margin: float | None = None) -> Comparison:
    """``cell`` against ``reference`` (``margin`` in the metric's own scale)."""
    if test in PAIRED_TESTS:
        x, y, seeds = paired_values(cell, reference)
        differences = x - y
        diff, n_pairs = float(np.mean(differences)), len(seeds)
        constant = len(set(differences.tolist())) == 1
    else:
        x, y = np.array(cell.values, dtype=float), np.array(reference.values, dtype=float)
        diff, n_pairs = float(np.mean(x) - np.mean(y)), None
        constant = len(set(cell.values)) == 1 and len(set(reference.values)) == 1
    low, high = _interval(test, ci, x, y)
    out = Comparison(test=test, diff=diff, ci_low=low, ci_high=high, p=_p_value(test, x, y), n_pairs=n_pairs,
                     constant=constant)
    if margin is not None and not constant:  # no spread, no t: so no equivalence test either (tost_p None)
        # H0: diff <= -M (rejected by "greater" against baseline - M) and H0: diff >= +M ("less" against + M)
        out.tost_p = max(_p_value(test, x, y - margin, "greater"), _p_value(test, x, y + margin, "less"))
    return out


def without_labels(cell: Cell, reference: Cell, *, test: str, ci: str = "t") -> Comparison | None:
    """The same test with the labelled runs left out of both cells; None when none is in the comparison, or
    when what is left cannot be tested."""
    mine, theirs = cell.ok_only(), reference.ok_only()
    if not labelled_in(cell, reference, test) or not mine.values or untestable(mine, theirs, test):
        return None
    return compare(mine, theirs, test=test, ci=ci)


def labelled_in(cell: Cell, reference: Cell, test: str) -> bool:
    """Whether a labelled run is among the values the test compares (paired: at a seed both cells ran)."""
    if test not in PAIRED_TESTS:
        return bool(cell.labelled_values or reference.labelled_values)
    common = set(cell.seeds) & set(reference.seeds)
    return any(seed in common for c in (cell, reference) for seed, status in zip(c.seeds, c.statuses)
               if status != "ok")


# --------------------------------------------------------------------------- corrections


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979): with the m p-values sorted ascending, the i-th (from 0)
    becomes min(1, max over j <= i of (m - j) * p_(j)); the family-wise error rate holds under any dependence."""
    p = np.asarray(p_values, dtype=float)
    order = np.argsort(p, kind="stable")
    scaled = (len(p) - np.arange(len(p))) * p[order]
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(1.0, np.maximum.accumulate(scaled))
    return [float(v) for v in adjusted]


def adjust(p_values: list[float], correction: str) -> list[float] | None:
    """Adjusted p-values (None for ``none``); nan p-values are left out of the family and stay nan."""
    from scipy import stats

    if correction == "none":
        return None
    p = np.asarray(p_values, dtype=float)
    out = np.full(len(p), math.nan)
    defined = np.isfinite(p)
    if defined.any():
        out[defined] = stats.false_discovery_control(p[defined]) if correction == "bh" else holm(p[defined])
    return [float(v) for v in out]


# --------------------------------------------------------------------------- power (noncentral t)


def t_power(difference: float, sd: float, n1: int, n2: int | None, alpha: float) -> float:
    """Power of the two-sided t-test at ``alpha`` for a true ``difference``: paired (``n2`` None: n1 pairs, sd of
    the differences) or two-sample (n1 and n2 seeds, pooled sd), from ``scipy.stats.nct``."""
    from scipy import stats

    if n2 is None:
        df, nc = n1 - 1, difference * math.sqrt(n1) / sd
    else:
        df, nc = n1 + n2 - 2, difference / (sd * math.sqrt(1 / n1 + 1 / n2))
    critical, nc = stats.t.ppf(1 - alpha / 2, df), abs(nc)
    # P(T > c) + P(T < -c); the lower tail as the upper tail of nct(-nc) (scipy's cdf far below a large nc is nan)
    return float(stats.nct.sf(critical, df, nc) + stats.nct.sf(critical, df, -nc))


def detectable_difference(sd: float, n1: int, n2: int | None, alpha: float, power: float = POWER_TARGET) -> float:
    """The smallest true difference detected with ``power`` (root of :func:`t_power` by scipy's brentq)."""
    from scipy import optimize

    high = sd
    while t_power(high, sd, n1, n2, alpha) < power:
        high *= 2
    return float(optimize.brentq(lambda d: t_power(d, sd, n1, n2, alpha) - power, 0.0, high, xtol=sd * 1e-10))


def seeds_needed(difference: float, sd: float, *, paired: bool, alpha: float,
                 power: float = POWER_TARGET) -> int | None:
    """The fewest seeds (pairs; or per row, two-sample) with ``power`` at ``difference``; None past MAX_SEEDS
    (power grows with n: a doubling search, then bisection)."""
    def enough(n: int) -> bool:
        return t_power(difference, sd, n, None if paired else n, alpha) >= power

    low, high = 1, 2  # enough(low) is False by convention (one seed has no spread)
    while not enough(high):
        if high >= MAX_SEEDS:
            return None
        low, high = high, min(2 * high, MAX_SEEDS)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return high


def power_of(cell: Cell, reference: Cell, comparison: Comparison, *, alpha: float,
             target: float | None) -> Power:
    """``--power`` for one comparison (``target`` in the metric's own scale; None: the observed difference)."""
    wanted = abs(comparison.diff) if target is None else target
    if comparison.test in PAIRED_TESTS:
        x, y, _ = paired_values(cell, reference)
        n1, n2, design = len(x), None, "paired"
        sd = float(np.std(x - y, ddof=1))
    else:
        n1, n2, design = cell.n, reference.n, "two-sample"
        sd = math.sqrt(((n1 - 1) * np.var(cell.values, ddof=1) + (n2 - 1) * np.var(reference.values, ddof=1))
                       / (n1 + n2 - 2))
    spread = sd > 0  # else power is undefined
    needed = seeds_needed(wanted, sd, paired=n2 is None, alpha=alpha) if spread and wanted > 0 else None
    return Power(design, min(n1, n2 or n1), sd, detectable_difference(sd, n1, n2, alpha) if spread else None, wanted,
                 needed)


# --------------------------------------------------------------------------- the table


def compare_with_baseline(table: Table) -> None:
    """Every non-baseline trained cell against the baseline's cell of its task, then the correction over all of
    them, the marks, equivalence and power; and the comparisons without labelled runs (corrected apart)."""
    choose_test(table)
    margin = None if table.margin is None else table.margin / table.scale
    target = None if table.power_diff is None else table.power_diff / table.scale
    for row, task, cell, ref in _cells_to_compare(table):
        reason = untestable(cell, ref, table.test)
        if reason:
            table.untested[reason] += 1
            continue
        cell.comparison = compare(cell, ref, test=table.test, ci=table.ci, margin=margin)
        if table.power:
            cell.comparison.power = power_of(cell, ref, cell.comparison, alpha=table.alpha, target=target)
        table.comparisons.append((row, task))
        table.constant += cell.comparison.constant
        cell.comparison.without_labels = without_labels(cell, ref, test=table.test, ci=table.ci)
    found = [row.cells[task].comparison for row, task in table.comparisons]
    _correct(found, table.correction, table.alpha)
    # the sensitivity comparisons are a family of their own: they restate the same questions
    _correct([c.without_labels for c in found if c.without_labels is not None], table.correction, table.alpha)
    if margin is not None:
        tost = [math.nan if c.tost_p is None else c.tost_p for c in found]
        adjusted = adjust(tost, table.correction)
        for i, comparison in enumerate(found):
            used = tost[i] if adjusted is None else adjusted[i]
            comparison.tost_p_adj = None if adjusted is None or comparison.tost_p is None else adjusted[i]
            comparison.equivalent = math.isfinite(used) and used < table.alpha


def _correct(found: list[Comparison], correction: str, alpha: float) -> None:
    """``p_adj`` and the marks of ``found``, corrected together."""
    adjusted = adjust([c.p for c in found], correction)
    for i, comparison in enumerate(found):
        comparison.p_adj = None if adjusted is None or not math.isfinite(comparison.p) else adjusted[i]
        used = comparison.p if adjusted is None else adjusted[i]
        comparison.marked = math.isfinite(used) and used < alpha
