"""REPORT.md and verdicts.json of a fair study, from its store alone: per task each row's rate search, its
held-out test score, steps and plateau, and the paired comparisons of the design's families (Holm within each).
The search is replayed from the store by the same functions that ran it, and every sentence is written from
verdicts.json (:mod:`peftlab.lab.verdicts`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from peftlab.io_utils import atomic_write_text
from peftlab.lab import stats
from peftlab.lab import study_protocol as sp
from peftlab.lab import verdicts as vt
from peftlab.lab.records import auto_scale
from peftlab.lab.study_fair import heldout_arms, key_arms, replay_searches
from peftlab.lab.study_plan import with_rows
from peftlab.lab.table_model import Cell

SECTION_FILE = "SECTION.md"  # the report's task sections, as docs/RESULTS.md embeds them


def arm_cell(design: sp.Design, task: str, arm: sp.Arm, by_key: dict, seeds: list[int]) -> tuple[Cell, list[dict]]:
    """The arm's held-out runs: a Cell of every finished run at its test value, and the runs themselves."""
    cell, runs = Cell(), []
    for config, row in with_rows(sp.heldout_configs(design, task, [arm], seeds), by_key):
        if row is None or row["status"] in ("pending", "running"):
            continue
        result = row.get("result") or {}
        cell.add_run(row["status"], config["seed"], ((result.get("best") or {}).get("metrics") or {})
                     .get(result.get("primary_metric")))
        runs.append(row)
    return cell, runs


def comparison_data(name: str, a: tuple[str, Cell], b: tuple[str, Cell], margin: float | None, scale: float,
                    family: str) -> dict:
    """One paired comparison as verdicts.json holds it (table points: the metric x ``scale``)."""
    data = {"name": name, "a": a[0], "b": b[0], "family": family, "margin": None if margin is None else margin * scale,
            "labels": {"a": _labels(a[1]), "b": _labels(b[1])}, "diff": None,
            "n_pairs": len(set(a[1].seeds) & set(b[1].seeds))}
    if data["n_pairs"] < 2:
        return data
    c = stats.compare(a[1], b[1], test="paired", margin=margin)
    power = stats.power_of(a[1], b[1], c, alpha=vt.ALPHA, target=None)
    data.update(diff=c.diff * scale, ci=[c.ci_low * scale, c.ci_high * scale], p=c.p, tost_p=c.tost_p,
                detectable_80=None if power.detectable is None else power.detectable * scale)
    return data


def metric_scale(rows: list[dict]) -> float:
    names = {(r.get("result") or {}).get("primary_metric") for r in rows}
    return auto_scale(n for n in names if n)


def _labels(cell: Cell) -> dict[str, int]:
    return {s: cell.statuses.count(s) for s in sorted(set(cell.statuses)) if s != "ok"}


def holm(family: list[dict]) -> None:
    """Holm over one family's differences, and over its equivalence tests apart; marks in place."""
    for key, adjusted in (("p", "p_holm"), ("tost_p", "tost_p_holm")):
        present = [d for d in family if d.get(key) is not None]
        for d, p in zip(present, stats.adjust([d[key] for d in present], "holm") or []):
            d[adjusted] = p
    for d in family:
        d["significant"] = d.get("p_holm") is not None and d["p_holm"] < vt.ALPHA
        d["equivalent"] = d.get("tost_p_holm") is not None and d["tost_p_holm"] < vt.ALPHA


def row_record(search: sp.Search, cell: Cell, runs: list[dict], scale: float) -> dict:
    steps = [int((r.get("result") or {}).get("optimizer_steps") or 0) for r in runs]
    plateaus = [((r.get("result") or {}).get("plateau") or {}).get("verdict", "n/a") for r in runs]
    return {"row": search.row.name if search else None,
            "rates": [{"rate": s.rate, "selection_mean": None if s.mean is None else s.mean * scale,
                       "labels": list(s.labels)} for s in (search.scores if search else ())],
            "chosen_rate": search.best.rate if search and search.best else None,
            "at_edge": search.at_edge if search else None,
            "test_mean": None if cell.mean is None else cell.mean * scale,
            "test_std": None if cell.std is None else cell.std * scale, "n": cell.n, "labels": _labels(cell),
            "steps_median": statistics.median(steps) if steps else None, "steps_range": [min(steps), max(steps)]
            if steps else None, "plateau": {v: plateaus.count(v) for v in sorted(set(plateaus))}}


def sigma_vs_adam(runs: list[dict]) -> float | None:
    """Median over runs and modules of max |sigma - sigma_init| / (optimizer steps x rate): how far KaSA's
    singular values moved against the farthest Adam could move them (about one rate per step)."""
    ratios = []
    for row in runs:
        result = row.get("result") or {}
        learned, init = result.get("kasa_sigma"), result.get("kasa_sigma_init")
        bound = float(result.get("optimizer_steps") or 0) * float(result.get("lr") or 0)
        if not isinstance(learned, dict) or not isinstance(init, dict) or not bound:
            continue
        for name, values in learned.items():
            start = init.get(name)
            if isinstance(start, list) and len(start) == len(values):
                ratios.append(max(abs(a - b) for a, b in zip(values, start)) / bound)
    return statistics.median(ratios) if ratios else None


# --------------------------------------------------------------------------- per task: data, then text


def task_data(design: sp.Design, task: str, store_rows: list[dict]) -> dict:
    """Everything the task's section says, as verdicts.json holds it."""
    by_key = {row["key"]: row for row in store_rows}
    scale = metric_scale([r for r in store_rows if (r.get("config") or {}).get("task") == task])
    margin = design.equivalence_margin / scale
    searches = replay_searches(design, task, by_key)
    finished = {n: s for n, s in searches.items() if s.best is not None}
    arms = heldout_arms(design, task, finished)
    cells = {arm.name: arm_cell(design, task, arm, by_key, design.heldout_seed_list) for arm in arms}
    rows = {arm.name: row_record(searches.get(arm.name), *cells[arm.name], scale) | {"rate": arm.rate}
            for arm in arms}
    data = {"task": task, "scale": scale, "rows": rows, "unfinished_searches": sorted(set(searches) - set(finished)),
            "families": {}}

    def pair(name, a, b, family):
        if a not in cells or b not in cells:
            return None
        keys = [{row["key"] for row in cells[arm][1]} for arm in (a, b)]
        if keys[0] and keys[0] == keys[1]:  # a row's pick is the paper's setting: one arm, nothing to compare
            return {"name": name, "a": a, "b": b, "family": family, "same_runs": True, "diff": None,
                    "n_pairs": len(keys[0])}
        return comparison_data(name, (a, cells[a][0]), (b, cells[b][0]), margin, scale, family)

    def key_family(family) -> list:  # the baseline's pick with W_k frozen − with W_k trained
        frozen_trained = key_arms(design, finished) if design.key_ablation else None
        if frozen_trained is None:
            return []
        (frozen, trained), seeds = frozen_trained, design.key_seed_list
        qv, qkv = (arm_cell(design, task, arm, by_key, seeds)[0] for arm in frozen_trained)
        return [comparison_data(f"W_k frozen ({frozen.name}) − W_k trained", (frozen.name, qv), (trained.name, qkv),
                                margin, scale, family.family)]

    families = {f.name: key_family(f) if f.compare == "key_ablation" else family_data(design, f, finished, pair)
                for f in design.section.families}
    kasa_arms = [a.name for a in arms if a.keys.get("method") == "kasa" and a.name in cells]
    if kasa_arms:
        data["sigma_vs_adam"] = {n: sigma_vs_adam(cells[n][1]) for n in kasa_arms}
    for name, family in families.items():
        present = [d for d in family if d is not None]
        holm(present)
        if present:
            data["families"][name] = {d["name"]: d for d in present}
    return data


def family_data(design: sp.Design, family, searches: dict, pair) -> list:
    """A spec family's comparisons: its listed pairs, or each swept row against the baseline (``baseline``)."""
    if family.compare == "baseline":
        return baseline_family(design, family.family, searches, pair)
    return [pair(name, a, b, family.family) for a, b, name in family.pairs]


def baseline_family(design: sp.Design, family: str, searches: dict, pair) -> list:
    """Each swept row against the baseline (both at their own rates), and the best swept row against the baseline
    at its rate controls (lambda: at its eta_QK and at its eta_V); named as
    :func:`peftlab.lab.verdicts.lambda_verdict` reads them."""
    from peftlab.lab.study_fair import best_off_diagonal

    baseline = design.baseline_row()
    diagonal = baseline.name if baseline is not None else None
    off = best_off_diagonal(design, searches)
    out = [pair(f"{r.name} − {diagonal}", r.name, diagonal, family)
           for r in design.rows if r.name != diagonal and off is not None and r.name != off.name]
    if off is not None:
        out.append(pair(f"off_vs_diag: {off.name} (best lambda > 1) − {diagonal}", off.name, diagonal, family))
        for key, control in zip(("off_vs_same_eta_qk", "off_vs_same_eta_v"), design.section.controls):
            out.append(pair(f"{key}: {off.name} − {control}", off.name, control, family))
    return out


def task_lines(design: sp.Design, data: dict) -> list[str]:
    """The task's section, written from its verdicts.json data."""
    lines = [f"## {data['task']}", "", "Each row's rate search (selection mean of each rate, the chosen one in bold) "
             "and its held-out runs (test split):", "",
             "| row | rates tried: selection mean | edge | rate | test mean ± std (n) | labels | optimizer steps, "
             "median (range) | plateau |", "|---|---|---|---|---|---|---|---|"]
    for name, r in data["rows"].items():
        tried = ", ".join((f"**{t['rate']:g}: {t['selection_mean']:.1f}**" if t["rate"] == r["chosen_rate"]
                           else f"{t['rate']:g}: {t['selection_mean']:.1f}") if t["selection_mean"] is not None
                          else f"{t['rate']:g}: –" for t in r["rates"]) or "fixed (not searched)"
        test = "–" if r["test_mean"] is None else f"{r['test_mean']:.1f}" + (
            f" ± {r['test_std']:.1f}" if r["test_std"] is not None else "") + f" ({r['n']})"
        labels = ", ".join(f"{n} {s}" for s, n in r["labels"].items()) or "–"
        steps = "–" if r["steps_median"] is None else f"{r['steps_median']:g} ({r['steps_range'][0]}–" \
                                                      f"{r['steps_range'][1]})"
        plateau = ", ".join(f"{n} {v}" for v, n in r["plateau"].items()) or "–"
        lines.append(f"| {name} | {tried} | {r['at_edge'] or 'no'} | {r['rate']:g} | {test} | {labels} | {steps} | "
                     f"{plateau} |")
    if data["unfinished_searches"]:
        lines += ["", f"Searches not finished yet: {', '.join(data['unfinished_searches'])}."]
    specs = {f.name: f for f in design.section.families}
    for name, family in data["families"].items():
        lines += ["", vt.family_heading(family, specs[name].intro), ""]
        for d in family.values():
            lines += vt.key_lines(d) if specs[name].compare == "key_ablation" else vt.comparison_lines(d)
        if specs[name].verdict == "kasa":
            lines += ["", vt.kasa_verdict(family)]
        if specs[name].verdict == "lambda":
            lines += ["", vt.lambda_verdict({k.split(":")[0]: d for k, d in family.items()})]
    movement = {k: v for k, v in (data.get("sigma_vs_adam") or {}).items() if v is not None}
    if movement:
        lines += ["", "KaSA's singular values: median over runs and modules of max |sigma − sigma_init| / (optimizer "
                      "steps × rate), the share of the farthest Adam could move them: "
                  + ", ".join(f"{k} {v:.3g}" for k, v in movement.items()) + ". Steps run here: "
                  + ", ".join(f"{k} {data['rows'][k]['steps_median']:g}" for k in movement
                              if data["rows"].get(k, {}).get("steps_median") is not None)
                  + f" (median); the paper's: about {paper_steps(design, data['task'])} "
                    "(its epochs of the full training set at its batch size)."]
    return lines + [""]


def paper_steps(design: sp.Design, task: str) -> str:
    """The paper's optimizer steps on the task, as its spec states them (kasa: epochs x training set / batch)."""
    return str((design.spec.paper_settings.get(task) or {}).get("steps", "n/a"))


def number_text(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def flag(key: str) -> str:
    return key.replace("_", "-")


def study_command(design: sp.Design, root) -> str:
    """The `peftlab study` command whose options give ``design`` back (``design_from_args``'s inverse), every knob
    spelled out, so the command beside a number needs no defaults looked up."""
    p, section, base = design.protocol, design.section, dict(design.base)
    words = [design.spec.command(), f"--task {','.join(design.tasks)}"]
    words += [f"--{flag(k)} {base.pop(k)}" for k in ("model", "targets", "epochs", "max_train_samples")]
    words += [f"--{flag(k)} {number_text(getattr(p, k))}" for k in ("selection_samples", "patience", "min_delta",
                                                                   "selection_seeds", "grid_factor", "grid_width",
                                                                   "max_extensions")]
    if base.get("max_eval_samples") is not None:
        words.append(f"--max-eval-samples {base.pop('max_eval_samples')}")
    if base.get("report_to") == "none":
        base.pop("report_to")
    if "method" in section.options:
        words.append(f"--method {base.pop('method')}")
    if section.swept:
        values = [design.swept_value(r.keys) for r in design.rows if r is not design.baseline_row()]
        words.append(f"--{flag(section.swept['option'])} " + ",".join(f"{v:g}" for v in values))
    else:
        words.append("--rows " + ",".join(r.name for r in design.rows))
    words += [f"--key-seeds {design.key_seeds}"] if "key_seeds" in section.options else []
    words += [] if design.key_ablation or not section.key_ablation else ["--no-key-ablation"]
    words += [] if design.paper_arms or not section.paper_arms else ["--no-paper-arms"]
    centres = {r.centre for r in design.rows}
    if len(centres) == 1:  # one centre for every row: --rate-centre gives it back (whether given or resolved)
        words.append(f"--rate-centre {centres.pop():g}")
    words += [f"--{flag(k)} {number_text(getattr(design, k))}"
              for k in ("heldout_seeds", "heldout_seed_start", "equivalence_margin")]
    if base:
        words.append("--set " + ",".join(f"{k}={number_text(v)}" for k, v in sorted(base.items())))
    return " ".join(words + [f"--output-dir {root}"])


def write_fair_report(paths, design: sp.Design) -> Path:
    """verdicts.json, then REPORT.md written from it (read back), in the study folder; returns REPORT.md."""
    from peftlab.lab import provenance
    from peftlab.lab.records import load_rows
    from peftlab.lab.store_schema import busy_seconds

    rows = load_rows([paths.store]) if paths.store.is_file() else []
    finished = [r for r in rows if r.get("status") not in ("pending", "running")]
    verdicts = {"kind": design.kind, "protocol": "fair", "tasks": {t: task_data(design, t, rows)
                                                                   for t in design.tasks}}
    atomic_write_text(paths.root / "verdicts.json", json.dumps(verdicts, indent=2, default=str) + "\n")
    verdicts = json.loads((paths.root / "verdicts.json").read_text())  # every sentence from the file's numbers
    summary = provenance.summarize(r.get("result") for r in rows)
    run_seconds = sum(float(r.get("seconds") or 0) for r in finished)
    p = design.protocol
    title = design.section.title
    lines = [f"# Study: {title}", "", f"Model {design.base['model']}; reproduce: `{study_command(design, paths.root)} "
             "--report-only` (every number below is read from the store; without --report-only the same command "
             "reruns whatever the store lacks).", "",
             f"- protocol: each row's module rate searched on selection seeds {p.selection_seed_list} over rates "
             f"x{p.grid_factor:g} apart around its default, extended past an edge up to {p.max_extensions} times; the "
             "head's rate tied to the module rate in every row; each run trained to its plateau (early stopping "
             f"after {p.patience} evaluated epochs without a selection gain > {p.min_delta:g}, at most "
             f"{design.base['epochs']} epochs)",
             f"- splits: {design.base['max_train_samples']} training examples per seed from the training split less "
             f"a selection split of {p.selection_samples} (stratified, disjoint from every training subset); the dev "
             "set is the test split, read only for the numbers below",
             f"- held-out seeds {design.heldout_seed_list[0]}-{design.heldout_seed_list[-1]}; every finished run "
             "stays in its comparison at its test value (labels are shown, never a reason to drop a seed)",
             "", f"Compute: {len(finished)} runs, {run_seconds / 3600:.2f} h of run time, "
             f"{busy_seconds(finished) / 3600:.2f} h wall (while any of its runs ran: the pauses between sessions left "
             "out).",
             f"{provenance.code_line(summary)[:1].upper()}{provenance.code_line(summary)[1:]}.", ""]
    sections = [line for task in design.tasks for line in task_lines(design, verdicts["tasks"][task])]
    report = paths.root / "REPORT.md"
    atomic_write_text(report, "\n".join(lines + sections).rstrip() + "\n")
    # the same sections, a heading level down, for docs/RESULTS.md to hold verbatim between markers naming this
    # file (tests/test_results_doc.py checks they are equal): the results page cannot drift from the numbers
    atomic_write_text(paths.root / SECTION_FILE, "\n".join(("#" + line if line.startswith("## ") else line)
                                                          for line in sections).rstrip() + "\n")
    return report
