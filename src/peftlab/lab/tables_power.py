"""``peftlab report --power``: what each comparison with the baseline could detect, and the seeds a difference needs
(:func:`peftlab.lab.stats.power_of`), laid out in the table's scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import pandas as pd

from peftlab.lab.stats import MAX_SEEDS, POWER_TARGET

if TYPE_CHECKING:
    from peftlab.lab.table_model import Power, Row, Table

POWER_COLUMNS = ("power_sd", "detectable", "power_diff", "seeds_needed")  # the CSV's, per task: {task}_detectable


def power_csv_values(power: Power | None, scale: float) -> list:
    """Unrounded, in the table's scale; seeds_needed empty where undefined or beyond the search cap."""
    if power is None:
        return [""] * len(POWER_COLUMNS)
    return [repr(power.sd * scale), "" if power.detectable is None else repr(power.detectable * scale),
            repr(power.target * scale), "" if power.seeds_needed is None else power.seeds_needed]


def seeds_text(power: Power) -> str:
    if not power.sd > 0:
        return "n/a (no spread)"
    if power.target == 0:
        return "never (Δ = 0)"
    return str(power.seeds_needed) if power.seeds_needed is not None else f"> {MAX_SEEDS}"


def power_frame(table: Table, digits: int, label_cells: Callable[[Table, Row], list[str]]) -> pd.DataFrame:
    """One text line per comparison, in table order; ``label_cells`` gives a row's label columns."""
    scale, lines = table.scale, []
    paired = table.paired
    for row, task in table.comparisons:
        comparison = row.cells[task].comparison
        power = comparison.power
        lines.append(label_cells(table, row) + [
            task, str(power.n), f"{power.sd * scale:.{digits + 1}f}", f"{comparison.diff * scale:+.{digits}f}",
            "n/a (no spread)" if power.detectable is None else f"{power.detectable * scale:.{digits}f}",
            f"{power.target * scale:.{digits}f}", seeds_text(power)])
    head = list(table.label_keys or [""]) + [
        "task", "pairs" if paired else "seeds (smaller row)", "sd of differences" if paired else "pooled sd",
        "Δ observed", f"detectable Δ ({POWER_TARGET:.0%} power)", "Δ asked",
        f"{'pairs' if paired else 'seeds per row'} for {POWER_TARGET:.0%} power"]
    return pd.DataFrame(lines, columns=head, dtype=object)


def power_footnote(table: Table) -> str:
    design = ("paired t-test on the paired differences (df = pairs - 1, noncentrality Δ·√n / sd)" if table.paired
              else "two-sample t-test (pooled sd, df = n1 + n2 - 2, noncentrality Δ / (sd·√(1/n1 + 1/n2)); equal "
                   "seeds per row for the seeds needed)")
    asked = ("the observed |Δ|" if table.power_diff is None
             else f"Δ = {table.power_diff:g} (--power-diff)")
    note = " (the signed-rank test's own power is close: asymptotic efficiency 0.955 under normality)" \
        if table.test == "wilcoxon" else ""
    return (f"power (the table below): {POWER_TARGET:.0%} power of a two-sided {design} at alpha "
            f"{table.alpha:g} (uncorrected){note}, exact from the noncentral t (scipy.stats.nct); 'detectable Δ' "
            f"is the smallest true difference found with {POWER_TARGET:.0%} power at the observed sd and n; the "
            f"seeds are for {asked}, searched up to {MAX_SEEDS}. A non-significant cell with a detectable Δ larger "
            "than the effect of interest says the study is too small, not that the rows are alike.")
