"""A study's arms (one config's runs over a seed list) and their paired comparisons, as text and as data.

An arm holds every finished run at its value (ok, and those labelled no_learning, collapsed or diverged: a run
is never dropped for how it came out; the labels are counted beside the arm). Comparisons are
:func:`peftlab.lab.stats.compare` (paired t, CI, TOST) with Holm over a section's family of comparisons, the power
of each (scipy's noncentral t), and the same comparison without the labelled runs (a family of its own). Their data
(:func:`comparison_data`) is what verdicts.json holds and :mod:`peftlab.lab.verdicts` writes sentences from
(through :mod:`studies.fixed_rate.report`'s slots).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from peftlab.io_utils import atomic_write_text
from peftlab.lab import stats
from peftlab.lab.records import auto_scale, matches
from peftlab.lab.table_model import Cell, Comparison
from studies.fixed_rate import design as sd

ALPHA = 0.05


# --------------------------------------------------------------------------- arms: a config's runs over seeds


@dataclass
class Arm:
    """One config's runs on a seed list: every finished run at its value (paired by seed), labelled or not."""

    name: str
    cell: Cell  # values + seeds + statuses of the finished runs; labelled runs without a value; crashed runs
    missing: int  # seeds without a finished run (not run yet, or skipped)

    @property
    def n(self) -> int:
        return self.cell.n

    @property
    def failed(self) -> int:
        """Runs that did not train: labelled (averaged in at their value) or crashed (left out)."""
        return self.cell.labelled + sum(self.cell.excluded.values())

    @property
    def runs(self) -> int:
        """Every run on the seed list that ended, whatever it ended as."""
        return self.cell.n + sum(self.cell.no_value.values()) + sum(self.cell.excluded.values())


def best_value(result: dict) -> float | None:
    return ((result.get("best") or {}).get("metrics") or {}).get(result.get("primary_metric"))


def first_epoch_value(result: dict) -> float | None:
    """The dev metric after the first epoch (speed of learning): the epoch-end evaluation of epoch 1."""
    log = result.get("epochs_log") or []
    return (log[0].get("metrics") or {}).get(result.get("primary_metric")) if log else None


def arm(name: str, rows: Iterable[dict], match: dict, seeds: list[int], value_of=best_value,
        unless: Iterable[dict] = ()) -> Arm:
    """The runs whose config matches ``match`` (floats compared with tolerance) and none of ``unless``, on
    ``seeds``; each run's value is ``value_of(result)`` (default: the best epoch's primary metric), and
    :meth:`Cell.add_run` places it. ``unless`` holds the other arms that ``match`` would also take in (a row that
    sets more keys, e.g. KaSA at the paper's rates beside KaSA at the defaults): a run belongs to one arm only.
    Pruned tune trials are no run of the arm (they stopped early by design)."""
    cell, found = Cell(), set()
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
        cell.add_run(row["status"], int(seed), value_of(row.get("result") or {}))
    return Arm(name, cell, len(set(seeds) - found))


def compare_arms(a: Arm, b: Arm, margin: float | None) -> Comparison | None:
    """``a`` minus ``b``, paired by seed (every seed both finished with a value); None with fewer than 2 pairs."""
    common = set(a.cell.seeds) & set(b.cell.seeds)
    if len(common) < 2:
        return None
    return stats.compare(a.cell, b.cell, test="paired", margin=margin)


def holm_family(family: dict[str, tuple[Comparison | None, Arm, Arm]], margin: float | None) -> None:
    """Holm over a section's family of comparisons (the difference tests; the equivalence tests as their own
    family), then marks, equivalence verdicts and power (scipy's noncentral t), in place; then each comparison
    without its labelled runs (``without_labels``), Holm over those as a family of their own."""
    present = [v for v in family.values() if v[0] is not None]
    _holm([c for c, _, _ in present], "p", "p_adj")
    _holm([c for c, _, _ in present], "tost_p", "tost_p_adj")
    for c, a, b in present:
        c.marked = c.p_adj is not None and c.p_adj < ALPHA
        c.equivalent = margin is not None and c.tost_p_adj is not None and c.tost_p_adj < ALPHA
        c.power = stats.power_of(a.cell, b.cell, c, alpha=ALPHA, target=None)
        c.without_labels = stats.without_labels(a.cell, b.cell, test="paired")
    sensitivity = [c.without_labels for c, _, _ in present if c.without_labels is not None]
    _holm(sensitivity, "p", "p_adj")
    for c in sensitivity:
        c.marked = c.p_adj is not None and c.p_adj < ALPHA


def _holm(comparisons: list[Comparison], attr: str, adjusted: str) -> None:
    """``adjusted`` = Holm's adjustment of ``attr`` over the comparisons that have one."""
    have = [c for c in comparisons if getattr(c, attr) is not None]
    if have:
        for c, value in zip(have, stats.adjust([getattr(c, attr) for c in have], "holm")):
            setattr(c, adjusted, value)


# --------------------------------------------------------------------------- data and text


def comparison_data(name: str, c: Comparison | None, a: Arm, b: Arm, scale: float, *, margin: float | None,
                    family: str) -> dict:
    """One comparison as verdicts.json holds it (in the table's points): what :mod:`peftlab.lab.verdicts` writes
    its sentence from. ``margin``: the equivalence margin in points (None: no TOST); ``family``: what Holm was
    applied over, as the report names it."""
    data = {"name": name, "a": a.name, "b": b.name, "family": family, "margin": margin,
            "labels": {"a": dict(a.cell.labels), "b": dict(b.cell.labels)},
            "no_value": {"a": dict(a.cell.no_value), "b": dict(b.cell.no_value)},
            "left_out": {"a": dict(a.cell.excluded), "b": dict(b.cell.excluded)},
            **_numbers(c, scale, len(set(a.cell.seeds) & set(b.cell.seeds)))}
    data["without_labels"] = None
    if c is not None and c.without_labels is not None:
        data["without_labels"] = _numbers(c.without_labels, scale, c.without_labels.n_pairs)
    elif c is not None and stats.labelled_in(a.cell, b.cell, "paired"):  # too few pairs left without the labels
        ok = set(a.cell.ok_only().seeds) & set(b.cell.ok_only().seeds)
        data["without_labels"] = _numbers(None, scale, len(ok))
    return data


def _numbers(c: Comparison | None, scale: float, n_pairs: int) -> dict:
    if c is None:  # not testable: the pairs there are
        return {"diff": None, "ci": None, "n_pairs": n_pairs, "p": None, "p_holm": None, "significant": False,
                "tost_p_holm": None, "equivalent": False, "detectable_80": None}
    return {"diff": c.diff * scale, "ci": [c.ci_low * scale, c.ci_high * scale], "n_pairs": c.n_pairs, "p": c.p,
            "p_holm": c.p_adj, "significant": c.marked, "tost_p_holm": c.tost_p_adj, "equivalent": c.equivalent,
            "detectable_80": None if c.power is None or c.power.detectable is None else c.power.detectable * scale}


def fmt(value: float, scale: float, digits: int = 1) -> str:
    return f"{value * scale:.{digits}f}"


def describe_arm(a: Arm, scale: float) -> str:
    """``14.2 ± 2.7 (n=10; 4 no_learning; median 12.0, range 3.8–18.1)``: every finished run at its value, the
    labels counted, the median and range where labelled runs are averaged in, and the runs left out."""
    cell = a.cell
    notes = [", ".join(f"{n} {label}" + (f" ({cell.no_value[label]} no value)" if cell.no_value[label] else "")
                       for label, n in sorted(cell.labels.items()))] if cell.labels else []
    if cell.excluded:
        notes.append("left out: " + ", ".join(f"{n} {reason}" for reason, n in sorted(cell.excluded.items())))
    if not cell.values:
        return f"no run with a value ({'; '.join(notes + [f'{a.missing} missing'])})"
    if cell.labelled_values:  # labelled runs in the mean: how the values spread, after their counts
        notes.insert(1, f"median {fmt(cell.median, scale)}, range {fmt(min(cell.values), scale)}–"
                        f"{fmt(max(cell.values), scale)}")
    text = fmt(cell.mean, scale) + (f" ± {fmt(cell.std, scale)}" if cell.std is not None else "")
    return f"{text} ({'; '.join([f'n={cell.n}'] + notes)})"


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
    if design.shape == "grid":
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


# --------------------------------------------------------------------------- the command beside the numbers


def number_text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def command_head(design, prog: str, knobs: list[str]) -> tuple[list[str], dict]:
    """The start of the study command that gives ``design`` back: the shared config's options, then
    ``knobs``; returns the words and the base keys not spelled out yet."""
    base = dict(design.base)
    words = [prog, f"--task {','.join(design.tasks)}", f"--model {base.pop('model')}",
             f"--targets {base.pop('targets')}", f"--epochs {base.pop('epochs')}",
             f"--max-train-samples {base.pop('max_train_samples')}", *knobs]
    if base.get("max_eval_samples") is not None:
        words.append(f"--max-eval-samples {base.pop('max_eval_samples')}")
    if base.get("report_to") == "none":
        base.pop("report_to")
    return words, base


def command_tail(design, base: dict, root) -> list[str]:
    """The end of that command: the held-out seeds, the margin, the other shared keys (--set), the folder."""
    words = [f"--heldout-seeds {design.heldout_seeds}", f"--heldout-seed-start {design.heldout_seed_start}",
             f"--equivalence-margin {number_text(design.equivalence_margin)}"]
    if base:
        words.append("--set " + ",".join(f"{k}={number_text(v)}" for k, v in sorted(base.items())))
    return words + [f"--output-dir {root}"]

