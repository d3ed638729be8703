"""What a fixed-rate study found: figures, verdicts.json and REPORT.md, from its results store alone.

Every number comes from the store (``python -m studies.fixed_rate ... --report-only`` rewrites all of it; each
table is also a ``peftlab report`` of the same store, whose command REPORT.md prints beside it). Comparisons are
paired by seed (:func:`peftlab.lab.stats.compare`) over every run that finished, labelled runs (no_learning, collapsed,
diverged) at their value, each with its difference, 95 % CI and Holm-adjusted p over its section's family of
comparisons (the report names each family), and again without the labelled runs; a "loses nothing" claim needs TOST
equivalence within the design's margin; where nothing is found the smallest difference the design detects with
80 % power is stated. The comparisons are data first (verdicts.json); every sentence about them is written from
that data by :mod:`peftlab.lab.verdicts`, through the :class:`Slot` s of REPORT.md's lines.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from peftlab.io_utils import atomic_write_text
from peftlab.lab import verdicts as vt
from peftlab.lab.records import matches
from studies.fixed_rate import design as sd
from studies.fixed_rate.arms import (Arm, arm, command_head, command_tail, compare_arms, comparison_data,
                                     describe_arm, design_summary, first_epoch_value, holm_family, load_store_rows,
                                     metric_scale, number_text, write_json)


COMMAND = "python -m studies.fixed_rate"


@dataclass(frozen=True)
class Slot:
    """A place in REPORT.md's lines for sentences written from verdicts.json: ``kind`` says which, ``path`` where
    its data is (keys from the top of verdicts.json), ``text`` a family heading's first words."""

    kind: str  # comparison, family, lambda_verdict, key, kasa_verdict, sensitivity_verdict
    path: tuple[str, ...]
    text: str = ""

    def render(self, verdicts: dict) -> list[str]:
        data = verdicts
        for key in self.path:
            data = data[key]
        sensitivity = sensitivity_text(data) if self.kind in ("comparison", "key") else None
        if self.kind == "comparison":  # the sensitivity as an item under the comparison's
            return vt.comparison_lines(data) + ([f"  - {sensitivity}"] if sensitivity else [])
        if self.kind == "family":
            return [vt.family_heading(data, self.text)]
        if self.kind == "key":
            return vt.key_lines(data) + ([f"- {sensitivity}"] if sensitivity else [])
        if self.kind == "sensitivity_verdict":  # a paragraph of its own, after the verdict
            sentence = sensitivity_verdict(data)
            return ["", sentence] if sentence else []
        return [{"lambda_verdict": vt.lambda_verdict, "kasa_verdict": vt.kasa_verdict}[self.kind](data)]


def sensitivity_text(data: dict) -> str | None:
    """The same comparison with the labelled runs left out; None where none is in the pairs."""
    without = data.get("without_labels")
    if without is None:
        return None
    if without.get("diff") is None:
        return f"without the labelled runs: {vt.comparison_text(without)}"
    low, high = without["ci"]
    return (f"without the labelled runs: {vt.signed(without['diff'])} [95 % CI {vt.signed(low)}, {vt.signed(high)}] on "
            f"{without['n_pairs']} pairs, paired t {vt.p_text(without.get('p'))}, "
            f"Holm {vt.p_text(without.get('p_holm'))}: {vt.outcome(without)}")


def sensitivity_verdict(comparisons: dict[str, dict]) -> str | None:
    """Whether leaving the labelled runs out changes any verdict of the family; None when none holds one."""
    held = {k: d for k, d in comparisons.items() if d and d.get("without_labels") is not None}
    if not held:
        return None
    changed = [f"{k} ({vt.outcome(d)} with them, {vt.outcome(d['without_labels'])} without)" for k, d in held.items()
               if vt.direction(d) != vt.direction(d["without_labels"])]
    if not changed:
        return (f"Without the labelled runs no verdict changes ({len(held)} comparison"
                f"{'s' if len(held) != 1 else ''} held some).")
    return "Without the labelled runs the verdict changes for: " + "; ".join(changed) + "."


def render_lines(lines: list, verdicts: dict) -> list[str]:
    """REPORT.md's lines with every :class:`Slot` written from ``verdicts`` (verdicts.json's data)."""
    out: list[str] = []
    for line in lines:
        out += line.render(verdicts) if isinstance(line, Slot) else [line]
    return out


# --------------------------------------------------------------------------- the lambda study


def task_match(design: sd.Design, task: str, **extra) -> dict:
    """The config keys that identify one arm of the task (the design's base, the task, and ``extra``)."""
    keys = ("model", "method", "targets", "epochs", "max_train_samples", "rank", "alpha", "head_lr", "pooling")
    match = {k: v for k, v in design.base.items() if k in keys}
    return {**match, "task": task, **extra}


def cell_arm(design: sd.Design, rows: list[dict], task: str, name: str, cell: sd.Cell, seeds: list[int],
             **extra) -> Arm:
    return arm(name, rows, task_match(design, task, lr=cell.lr, lr_ratio=cell.ratio, **extra), seeds)


def cell_name(cell: sd.Cell) -> str:
    if cell.diagonal:
        return f"lambda 1 at eta {cell.lr:g}"
    return f"lambda {cell.ratio:g} at eta_QK {cell.lr:g} (eta_V {cell.eta_v:g})"


def lambda_task_section(design: sd.Design, rows: list[dict], task: str, root: Path) -> tuple[list[str], dict]:
    scale = metric_scale([r for r in rows if (r.get("config") or {}).get("task") == task])
    margin = design.equivalence_margin / scale
    heldout, epochs = design.heldout_seed_list, design.epochs
    lines = [f"## {task}", ""]
    data: dict = {"task": task}
    picks_file = root / f"picks-{task}.json"
    grid_seeds = design.selection_seed_list or heldout
    grid = [(c, cell_arm(design, rows, task, cell_name(c), c, grid_seeds, epochs=epochs))
            for c in sd.grid_cells(design)]
    lines += grid_lines(design, grid, len(grid_seeds), scale, data)
    if not design.selection_seeds:  # confirmatory: every lambda > 1 cell against its lambda-1 controls
        return lines + confirmatory_lines(design, task, grid, scale, data), data
    if not picks_file.is_file():
        return lines + ["(no picks yet: the grid has not finished)", ""], data
    picks = json.loads(picks_file.read_text())
    diag_cell = sd.Cell(**picks["diagonal"]["cell"]) if picks.get("diagonal") else None
    off_cell = sd.Cell(**picks["off_diagonal"]["cell"]) if picks.get("off_diagonal") else None
    lines.append(f"Picks on the selection seeds: best lambda-1 cell **{cell_name(diag_cell) if diag_cell else '–'}**, "
                 f"best lambda > 1 cell **{cell_name(off_cell) if off_cell else '–'}**.")
    lines.append("")
    family: dict = {}
    if diag_cell and off_cell:
        diag = cell_arm(design, rows, task, "best lambda 1", diag_cell, heldout, epochs=epochs)
        off = cell_arm(design, rows, task, "best lambda > 1", off_cell, heldout, epochs=epochs)
        family["off_vs_diag"] = (compare_arms(off, diag, margin), off, diag)
        for label, control in (picks.get("controls") or {}).items():
            c = sd.Cell(**control)
            if c == diag_cell:  # the control is the best lambda-1 cell itself: one comparison, counted once
                same = {"same_eta_qk": "eta_QK", "same_eta_v": "eta_V"}[label]
                lines += [f"(The lambda-1 control at the same {same} is the best lambda-1 cell itself.)", ""]
                continue
            what = {"same_eta_qk": "lambda 1 at the same eta_QK", "same_eta_v": "lambda 1 at the same eta_V"}[label]
            ctrl = cell_arm(design, rows, task, what, c, heldout, epochs=epochs)
            family[f"off_vs_{label}"] = (compare_arms(off, ctrl, margin), off, ctrl)
        holm_family(family, margin)
        lines += [f"On the {len(heldout)} held-out seeds: best lambda 1 {describe_arm(diag, scale)}; best lambda > 1 "
                  f"{describe_arm(off, scale)}.", ""]
        over = f"the {len(family)} held-out comparisons of {task}'s best lambda > 1 cell"
        data["comparisons"] = {
            key: comparison_data(f"{a.name} ({cell_name(off_cell)}) − {b.name} ({_arm_cell(key, diag_cell, picks)})",
                                 c, a, b, scale, family=over, margin=design.equivalence_margin)
            for key, (c, a, b) in family.items()}
        path = ("tasks", task, "comparisons")
        lines += [Slot("family", path, "Held-out comparisons"), ""] + [Slot("comparison", path + (k,)) for k in family]
        lines += ["", Slot("lambda_verdict", path), Slot("sensitivity_verdict", path), ""]
    data["picks"] = {"diagonal": picks.get("diagonal"), "off_diagonal": picks.get("off_diagonal")}
    data.setdefault("comparisons", {})
    lines += key_section(design, rows, task, diag_cell, scale, margin, data)
    lines += plateau_section(design, rows, task, diag_cell, off_cell, scale, data)
    return lines, data


def grid_lines(design: sd.Design, grid: list[tuple[sd.Cell, Arm]], seeds: int, scale: float, data: dict) -> list[str]:
    """The grid's table (every cell's runs, labelled ones at their value) and the failed runs by lambda."""
    lines = [f"Grid on {'the selection seeds' if design.selection_seeds else 'the held-out seeds'} "
             f"({seeds} per cell; a cell with a failed seed ranks below every cell whose seeds all trained):", "",
             "| cell | eta_QK | lambda | eta_V | mean ± std (n) | failed |", "|---|---|---|---|---|---|"]
    for c, a in grid:
        lines.append(f"| {cell_name(c)} | {c.lr:g} | {c.ratio:g} | {c.eta_v:g} | {describe_arm(a, scale)} | "
                     f"{a.failed}/{a.runs} |")
    by_ratio: dict[float, list[int]] = {}
    for c, a in grid:
        total = by_ratio.setdefault(c.ratio, [0, 0])
        total[0] += a.failed
        total[1] += a.runs
    data["failed_by_lambda"] = {f"{r:g}": f"{f}/{n}" for r, (f, n) in sorted(by_ratio.items())}
    return lines + ["", "Runs that failed to learn, by lambda: "
                    + ", ".join(f"lambda {r}: {v}" for r, v in data["failed_by_lambda"].items()) + ".", ""]


def confirmatory_lines(design: sd.Design, task: str, grid: list[tuple[sd.Cell, Arm]], scale: float,
                       data: dict) -> list[str | Slot]:
    """Every lambda > 1 cell against its lambda-1 controls (same eta_QK, same eta_V), on the held-out seeds."""
    margin = design.equivalence_margin / scale
    family = {}
    arms = {c: a for c, a in grid}
    for c, a in grid:
        if c.diagonal:
            continue
        for label, rate in (("same_eta_qk", c.lr), ("same_eta_v", c.eta_v)):
            control = next((d for d in arms if d.diagonal and math.isclose(d.lr, rate)), None)
            if control is not None:
                family[f"{cell_name(c)} vs {label}"] = (compare_arms(a, arms[control], margin), a, arms[control])
    holm_family(family, margin)
    over = f"the {len(family)} held-out comparisons of {task}'s lambda > 1 cells with their lambda-1 controls"
    data["comparisons"] = {k: comparison_data(f"{a.name} − {b.name}", c, a, b, scale, family=over,
                                              margin=design.equivalence_margin) for k, (c, a, b) in family.items()}
    path = ("tasks", task, "comparisons")
    return [Slot("family", path, "Held-out comparisons"), ""] + [Slot("comparison", path + (k,)) for k in family] + [""]


def _arm_cell(key: str, diag_cell: sd.Cell, picks: dict) -> str:
    if key == "off_vs_diag":
        return cell_name(diag_cell)
    control = (picks.get("controls") or {}).get(key[len("off_vs_"):])
    return cell_name(sd.Cell(**control)) if control else "?"


def key_section(design, rows, task, diag_cell, scale, margin, data) -> list[str | Slot]:
    targets = sd.key_ablation_targets(design.base.get("targets", "q,v"))
    if not (design.key_ablation and targets and diag_cell):
        return []
    heldout = design.heldout_seed_list
    qv = cell_arm(design, rows, task, design.base.get("targets", "q,v"), diag_cell, heldout, epochs=design.epochs)
    match = {**task_match(design, task, lr=diag_cell.lr, lr_ratio=1.0, epochs=design.epochs), "targets": targets}
    qkv = arm(targets, rows, match, heldout)
    if not qkv.n:
        return ["W_k ablation: not run (skipped or unfinished).", ""]
    family = {"freeze_wk": (compare_arms(qv, qkv, margin), qv, qkv)}
    holm_family(family, margin)
    name = f"W_k frozen ({qv.name}) − W_k trained ({targets}), both at {cell_name(diag_cell)}, held-out seeds"
    data["freeze_wk"] = comparison_data(name, *family["freeze_wk"], scale, margin=design.equivalence_margin,
                                        family="this comparison alone (a family of 1)")
    return [Slot("key", ("tasks", task, "freeze_wk")), ""]


def plateau_section(design, rows, task, diag_cell, off_cell, scale, data) -> list[str | Slot]:
    if not (design.plateau_epochs and diag_cell and off_cell):
        return []
    seeds, epochs = design.plateau_seed_list, design.plateau_epochs
    lines = [f"Plateau arm ({epochs} epochs, dev evaluations during training, seeds {seeds[0]}-{seeds[-1]}):", ""]
    arms = {}
    for key, cell in (("diag", diag_cell), ("off", off_cell)):
        match = task_match(design, task, lr=cell.lr, lr_ratio=cell.ratio, epochs=epochs)
        arms[key] = (arm(cell_name(cell), rows, match, seeds), arm(cell_name(cell), rows, match, seeds,
                                                                    first_epoch_value))
    if not arms["diag"][0].n or not arms["off"][0].n:
        return lines + ["(not run: skipped or unfinished)", ""]
    family = {"quality": (compare_arms(arms["off"][0], arms["diag"][0], None), arms["off"][0], arms["diag"][0]),
              "speed": (compare_arms(arms["off"][1], arms["diag"][1], None), arms["off"][1], arms["diag"][1])}
    holm_family(family, None)
    for key in ("diag", "off"):
        best, first = arms[key]
        lines.append(f"- {best.name}: best over {epochs} epochs {describe_arm(best, scale)}; after epoch 1 "
                     f"{describe_arm(first, scale)}")
    names = {"quality": f"final quality (best epoch of {epochs}), lambda > 1 − lambda 1",
             "speed": "speed (after epoch 1), lambda > 1 − lambda 1"}
    over = f"{task}'s 2 plateau comparisons (final quality and speed)"
    data["plateau"] = {k: comparison_data(names[k], c, a, b, scale, margin=None, family=over)
                       for k, (c, a, b) in family.items()}
    path = ("tasks", task, "plateau")
    return lines + ["", Slot("family", path, "Plateau comparisons"), ""] + [Slot("comparison", path + (k,))
                                                                           for k in family] + [""]


# --------------------------------------------------------------------------- the kasa study


def before_value(result: dict) -> float | None:
    section = result.get("before") or result.get("final") or {}
    return (section.get("metrics") or {}).get(result.get("primary_metric"))


def sigma_movement(rows: list[dict], match: dict, seeds: list[int], unless: list[dict] = ()) -> float | None:
    """Median over runs of |learned sigma - its init| / |init| (KaSA's singular values: does the method engage?);
    ``unless`` as in :func:`studies.fixed_rate.arms.arm`."""
    import statistics

    ratios = []
    for row in rows:
        config, result = row.get("config") or {}, row.get("result") or {}
        if config.get("seed") not in seeds or row.get("status") != "ok" or not matches(config, match):
            continue
        if any(matches(config, other) for other in unless):
            continue
        learned, init = result.get("kasa_sigma"), result.get("kasa_sigma_init")
        if not isinstance(learned, dict) or not isinstance(init, dict):
            continue
        for name, values in learned.items():
            start = init.get(name)
            if isinstance(values, list) and isinstance(start, list) and len(start) == len(values):
                norm = math.sqrt(sum(v * v for v in start))
                if norm:
                    ratios.append(math.sqrt(sum((a - b) ** 2 for a, b in zip(values, start))) / norm)
    return statistics.median(ratios) if ratios else None


def kasa_task_section(design: sd.Design, rows: list[dict], task: str) -> tuple[list[str], dict]:
    scale = metric_scale([r for r in rows if (r.get("config") or {}).get("task") == task])
    seeds, margin = design.heldout_seed_list, design.equivalence_margin / scale
    arms: dict[str, Arm] = {}
    matches_of = {name: {k: v for k, v in sd.kasa_row_config(design, task, name).items() if k != "report_to"}
                  for name in design.rows}

    def more_specific(name: str, epochs: int) -> list[dict]:
        """The other rows whose match includes this row's (KaSA at the paper's settings within plain KaSA's)."""
        mine = matches_of[name].items()
        return [{**m, "epochs": epochs} for other, m in matches_of.items()
                if other != name and mine <= m.items() and m != matches_of[name]]

    for name in design.rows:
        arms[name] = arm(name, rows, matches_of[name], seeds, unless=more_specific(name, design.epochs))
    for name in sd.long_rows(design):
        arms[f"{name}@{design.long_epochs}ep"] = arm(f"{name} ({design.long_epochs} epochs)", rows,
                                                     {**matches_of[name], "epochs": design.long_epochs},
                                                     sd.long_seed_list(design),
                                                     unless=more_specific(name, design.long_epochs))
    before = arm("before fine-tuning", rows, {"task": task, "model": design.base["model"], "epochs": 0}, seeds,
                 before_value)
    lines = [f"## {task}", "", f"On seeds {seeds[0]}-{seeds[-1]}:", "",
             "| row | mean ± std (n) |", "|---|---|", f"| before fine-tuning | {describe_arm(before, scale)} |"]
    lines += [f"| {a.name} | {describe_arm(a, scale)} |" for a in arms.values()]
    family = {}
    for a, b, name in design.spec.pairs:
        a, b = (n.replace("@long", f"@{design.long_epochs}ep") for n in (a, b))
        if a in arms and b in arms:
            name = name.replace("{long}", str(design.long_epochs))
            family[name] = (compare_arms(arms[a], arms[b], margin), arms[a], arms[b])
    holm_family(family, margin)
    over = f"the {len(family)} comparisons of {task} below"
    data = {"task": task, "comparisons": {k: comparison_data(k, c, a, b, scale, margin=design.equivalence_margin,
                                                             family=over) for k, (c, a, b) in family.items()}}
    path = ("tasks", task, "comparisons")
    lines += ["", Slot("family", path, "Comparisons"), ""] + [Slot("comparison", path + (k,)) for k in family]
    movement = {}
    for name in design.rows:
        if matches_of[name].get("method") == "kasa":
            movement[name] = sigma_movement(rows, matches_of[name], seeds, more_specific(name, design.epochs))
    if any(v is not None for v in movement.values()):
        lines += ["", "KaSA's learned singular values, median relative change ||sigma - sigma_init|| / "
                      "||sigma_init|| per adapted module: "
                  + ", ".join(f"{k} {v:.3g}" for k, v in movement.items() if v is not None) + "."]
        data["sigma_movement"] = movement
    lines += ["", Slot("kasa_verdict", path), Slot("sensitivity_verdict", path), ""]
    return lines, data


# --------------------------------------------------------------------------- the report


def study_command(design: sd.Design, root) -> str:
    """The command line whose options give ``design`` back (``design_from_args``'s inverse): every knob spelled
    out, so the command beside a number needs no defaults looked up."""
    words, base = command_head(design, f"{COMMAND} {design.kind}", [])
    if design.shape == "grid":
        words += [f"--method {base.pop('method')}", "--lr-grid " + ",".join(map(number_text, design.lr_grid)),
                  "--ratios " + ",".join(map(number_text, design.ratios)),
                  "--diagonal " + ",".join(map(number_text, design.diagonal)),
                  f"--selection-seeds {design.selection_seeds}", f"--top-k {design.top_k}",
                  f"--plateau-epochs {design.plateau_epochs}", f"--plateau-seeds {design.plateau_seeds}",
                  f"--evals-per-epoch {design.evals_per_epoch}"]
        words += [] if design.key_ablation else ["--no-key-ablation"]
        words += [] if design.search_comparison else ["--no-search"]
    else:
        words += [f"--{key.replace('_', '-')} {number_text(base.pop(key))}" for key in ("lr", "head_lr")
                  if key in base]
        words += ["--rows " + ",".join(design.rows), f"--long-epochs {design.long_epochs}",
                  f"--long-seeds {design.plateau_seeds}"]
    return " ".join(words + command_tail(design, base, root))


def write_report(paths, design: sd.Design, *, seconds: float | None = None) -> Path:
    """REPORT.md (+ verdicts.json, tables/, figures/) in the study folder, from its store; returns REPORT.md."""
    from peftlab.lab import provenance

    rows = load_store_rows(paths.store)
    summary = provenance.summarize(r.get("result") for r in rows)
    title = design.section.title
    finished = [r for r in rows if r.get("status") not in ("pending", "running")]
    run_seconds = sum(float(r.get("seconds") or 0) for r in finished)
    lines = [f"# Study: {title}", "", f"Model {design.base['model']}; reproduce: `{study_command(design, paths.root)} "
             f"--report-only` (every number below is read from `{paths.store.name}`; without --report-only the "
             "same command reruns whatever the store lacks).",
             "", *design_summary(design), "",
             f"Compute: {len(finished)} runs, {run_seconds / 3600:.2f} h of run time"
             + (f", {seconds / 3600:.2f} h wall for this invocation" if seconds else "") + ".",
             f"{provenance.code_line(summary)[:1].upper()}{provenance.code_line(summary)[1:]}.", ""]
    verdicts = {"kind": design.kind, "tasks": {}}
    for task in design.tasks:
        section, data = (lambda_task_section(design, rows, task, paths.root) if design.shape == "grid"
                         else kasa_task_section(design, rows, task))
        lines += section
        verdicts["tasks"][task] = data
    lines += ["## Figures", ""]
    for name, command in write_figures(paths, design, rows):
        lines += ([f"![{name}](figures/{name})", "", f"`{command}`", ""] if command.startswith("peftlab")
                  else [f"{name}: {command}", ""])
    write_json(paths.root / "verdicts.json", verdicts)
    # every sentence about a comparison is written from verdicts.json as written, so it cannot drift from it
    lines = render_lines(lines, json.loads((paths.root / "verdicts.json").read_text()))
    report = paths.root / "REPORT.md"
    atomic_write_text(report, "\n".join(lines).rstrip() + "\n")
    return report


def write_figures(paths, design: sd.Design, rows: list[dict]) -> list[str]:
    """The study's figures, each also a `peftlab plot` of the store (the command is in REPORT.md): the
    eta_QK x eta_V grid per task and the plateau arm's learning curves (lambda), KaSA's learned change of its
    singular values (kasa). Returns (file name, command) pairs of the figures written."""
    from peftlab.errors import PeftlabError
    from peftlab.lab.plot import make_plot
    from peftlab.lab.records import rows_of_seeds

    out = paths.root / "figures"
    store = paths.store
    made: list[tuple[str, str]] = []
    targets = design.base.get("targets", "q,v")

    def plot(name: str, kind: str, seeds: list[int], where: str, **options) -> None:
        chosen = rows_of_seeds(rows, [(min(seeds), max(seeds))])
        try:
            make_plot(chosen, kind=kind, out=out / name, where=where, **options)
        except PeftlabError as err:  # e.g. nothing finished yet: the report says so instead of a figure
            made.append((name, f"not drawn: {err.what}"))
            return
        extra = "".join(f" --{k.replace('_', '-')} {v}" for k, v in options.items())
        made.append((name, f"peftlab plot {store} --kind {kind} --seeds {min(seeds)}-{max(seeds)} "
                           f'--where "{where}"{extra} --out {name}'))

    if design.shape == "grid":
        seeds = design.selection_seed_list or design.heldout_seed_list
        plot("lr_grid.png", "lr-grid", seeds, f"targets={targets},epochs={design.epochs}")
        if design.plateau_epochs and design.selection_seeds:
            plot("plateau_curves.png", "curves", design.plateau_seed_list,
                 f"targets={targets},epochs={design.plateau_epochs}")
    else:
        plot("kasa_sigma.png", "sigma", design.heldout_seed_list, f"method=kasa,epochs={design.epochs}")
    return made
