"""A study's arms (one config's runs over a seed list) and their paired comparisons, as text and as data.

An arm keeps the ok runs (values with their seeds: what is averaged and paired) apart from the seeds that
failed to learn; comparisons are :func:`peftlab.lab.stats.compare` (paired t, CI, TOST) with Holm over a
task's family of comparisons and the power of each (scipy's noncentral t).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from peftlab.io_utils import atomic_write_text
from peftlab.lab import stats
from peftlab.lab import study_design as sd
from peftlab.lab.records import auto_scale, matches
from peftlab.lab.table_model import FAILED_TO_LEARN, Cell, Comparison

ALPHA = 0.05


# --------------------------------------------------------------------------- arms: a config's runs over seeds


@dataclass
class Arm:
    """One config's runs on a seed list: the ok values (paired by seed), and the seeds that failed."""

    name: str
    cell: Cell  # ok runs: values + seeds (what is averaged and paired)
    failed: int  # no_learning / collapsed / diverged / failed
    missing: int  # seeds without a finished run (not run yet, or skipped)

    @property
    def n(self) -> int:
        return self.cell.n


def best_value(result: dict) -> float | None:
    return ((result.get("best") or {}).get("metrics") or {}).get(result.get("primary_metric"))


def first_epoch_value(result: dict) -> float | None:
    """The dev metric after the first epoch (speed of learning): the epoch-end evaluation of epoch 1."""
    log = result.get("epochs_log") or []
    return (log[0].get("metrics") or {}).get(result.get("primary_metric")) if log else None


def arm(name: str, rows: Iterable[dict], match: dict, seeds: list[int], value_of=best_value,
        unless: Iterable[dict] = ()) -> Arm:
    """The runs whose config matches ``match`` (floats compared with tolerance) and none of ``unless``, on
    ``seeds``; each run's value is ``value_of(result)`` (default: the best epoch's primary metric). ``unless``
    holds the other arms that ``match`` would also take in (a row that sets more keys, e.g. KaSA at the
    paper's rates beside KaSA at the defaults): a run belongs to one arm only."""
    cell, failed, found = Cell(), 0, set()
    unless = list(unless)
    for row in rows:
        config = row.get("config") or {}
        seed = config.get("seed")
        if seed not in seeds or row.get("status") in ("pending", "running") or not matches(config, match):
            continue
        if any(matches(config, other) for other in unless):
            continue
        if row.get("status") == "pruned" or (row.get("result") or {}).get("stopped_early"):
            continue
        found.add(seed)
        result = row.get("result") or {}
        value = value_of(result)
        if row["status"] == "ok" and isinstance(value, (int, float)) and math.isfinite(value):
            cell.values.append(float(value))
            cell.seeds.append(int(seed))
        else:
            failed += 1
            cell.excluded[row["status"]] += 1
            if row["status"] in FAILED_TO_LEARN and isinstance(value, (int, float)) and math.isfinite(value):
                cell.failed_values.append(float(value))
    return Arm(name, cell, failed, len(set(seeds) - found))


def compare_arms(a: Arm, b: Arm, margin: float | None) -> Comparison | None:
    """``a`` minus ``b``, paired by seed; None with fewer than 2 pairs."""
    common = set(a.cell.seeds) & set(b.cell.seeds)
    if len(common) < 2:
        return None
    return stats.compare(a.cell, b.cell, test="paired", margin=margin)


def holm_family(family: dict[str, tuple[Comparison | None, Arm, Arm]], margin: float | None) -> None:
    """Holm over a task's family of comparisons (the difference tests; the equivalence tests as their own
    family), then marks, equivalence verdicts and power (scipy's noncentral t), in place."""
    present = {k: v for k, v in family.items() if v[0] is not None}
    for attr, adj in (("p", "p_adj"), ("tost_p", "tost_p_adj")):
        keys = [k for k, v in present.items() if getattr(v[0], attr) is not None]
        if keys:
            for key, value in zip(keys, stats.adjust([getattr(present[k][0], attr) for k in keys], "holm")):
                setattr(present[key][0], adj, value)
    for c, a, b in present.values():
        c.marked = c.p_adj is not None and c.p_adj < ALPHA
        c.equivalent = margin is not None and c.tost_p_adj is not None and c.tost_p_adj < ALPHA
        c.power = stats.power_of(a.cell, b.cell, c, alpha=ALPHA, target=None)


# --------------------------------------------------------------------------- text


def fmt(value: float, scale: float, digits: int = 1) -> str:
    return f"{value * scale:.{digits}f}"


def fmt_p(p: float | None) -> str:
    if p is None or not math.isfinite(p):
        return "n/a"
    return "<0.001" if p < 0.001 else f"{p:.2g}" if p < 0.1 else f"{p:.2f}"


def describe_arm(a: Arm, scale: float) -> str:
    if not a.cell.values:
        return f"no ok run ({a.failed} failed, {a.missing} missing)"
    text = f"{fmt(a.cell.mean, scale)}"
    if a.cell.std is not None:
        text += f" ± {fmt(a.cell.std, scale)}"
    text += f" (n={a.n})"
    if a.failed:
        values = a.cell.all_values
        text += (f" [{a.failed} failed to learn; median {fmt(sorted(values)[len(values) // 2], scale)}, "
                 f"range {fmt(min(values), scale)}–{fmt(max(values), scale)}]")
    return text


def describe_comparison(c: Comparison | None, scale: float, margin: float | None = None) -> str:
    if c is None:
        return "not testable (fewer than 2 seeds with both runs ok)"
    text = (f"Δ = {c.diff * scale:+.2f} [95 % CI {c.ci_low * scale:+.2f}, {c.ci_high * scale:+.2f}], "
            f"{c.n_pairs} pairs, paired t p = {fmt_p(c.p)} (Holm {fmt_p(c.p_adj)})")
    if margin is not None and c.tost_p_adj is not None:
        text += (f"; equivalent within ±{margin:g}" if c.equivalent
                 else f"; not shown equivalent within ±{margin:g} (TOST Holm p = {fmt_p(c.tost_p_adj)})")
    if not c.marked and c.power is not None and c.power.detectable is not None:
        text += f"; 80 % power to detect |Δ| ≥ {c.power.detectable * scale:.2f}"
    return text


def direction(c: Comparison | None) -> str:
    """significant-better | significant-worse | no-difference"""
    if c is None or not c.marked:
        return "no-difference"
    return "better" if c.diff > 0 else "worse"


def load_store_rows(path: Path) -> list[dict]:
    from peftlab.lab.records import load_rows

    return load_rows([path]) if path.is_file() else []


def write_json(path: Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def metric_scale(rows: list[dict]) -> float:
    names = {(r.get("result") or {}).get("primary_metric") for r in rows}
    return auto_scale(n for n in names if n)


def design_summary(design: sd.Design) -> list[str]:
    base = ", ".join(f"{k}={v}" for k, v in sorted(design.base.items()))
    lines = [f"- tasks: {', '.join(design.tasks)}; shared config: {base}"]
    if design.kind == "lambda":
        lines.append(f"- grid: lambda in {{{', '.join(f'{r:g}' for r in design.ratios)}}} at eta_QK in "
                     f"{{{', '.join(f'{r:g}' for r in design.lr_grid)}}}; the diagonal lambda = 1 at "
                     f"{{{', '.join(f'{r:g}' for r in design.diagonal)}}}")
        lines.append(f"- selection seeds {design.selection_seed_list or 'none (confirmatory: every cell held out)'}; "
                     f"held-out seeds {design.heldout_seed_list[0]}-{design.heldout_seed_list[-1]}")
    else:
        lines.append(f"- rows: {', '.join(design.rows)}"
                     + (f"; LoRA and paper-KaSA also at {design.long_epochs} epochs" if design.long_epochs else ""))
        lines.append(f"- seeds {design.heldout_seed_list[0]}-{design.heldout_seed_list[-1]}")
    lines += [f"- {note}" for note in design.notes]
    return lines


