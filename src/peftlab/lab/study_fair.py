"""Running the fair protocol (:mod:`peftlab.lab.study_protocol`): per task, rounds of rate searches, then every
row's pick and the design's fixed arms on the held-out seeds, each a sweep into the study's store. Every decision
is re-derived from the store by the same pure functions, so a rerun resumes where the last one stopped and the
report replays exactly these choices.
"""

from __future__ import annotations

from peftlab.errors import PeftlabError
from peftlab.lab import study_protocol as sp
from peftlab.lab.study_plan import with_rows


def search_state(design: sp.Design, task: str, row: sp.Row, steps: tuple[int, ...], extensions: int,
                 by_key: dict[str, dict]) -> sp.Search:
    """A row's search over ``steps`` as far as the store has it."""
    scores = []
    for step in steps:
        runs = with_rows(sp.search_configs(design, task, row, [step]), by_key)
        scores.append(sp.score_rate(row, step, design.protocol.grid_factor, {c["seed"]: run for c, run in runs}))
    return sp.Search(row, steps, tuple(scores), extensions)


def replay_searches(design: sp.Design, task: str, by_key: dict[str, dict], run_round=None) -> dict[str, sp.Search]:
    """Every row's search, round by round: run the round's grid (``run_round(round, configs)``; None: only read
    the store), then extend each row whose best rate sits at an edge. Returns the searches as they end (a search
    is unfinished when the store lacks some of its runs and ``run_round`` is None)."""
    protocol = design.protocol
    extra: dict[str, tuple[int, ...]] = {row.name: () for row in design.rows}
    for round_ in range(protocol.max_extensions + 1):
        steps = {row.name: sp.grid_steps(protocol, extra[row.name]) for row in design.rows}
        if run_round is not None:
            configs = [c for row in design.rows for c in sp.search_configs(design, task, row, steps[row.name])]
            by_key = run_round(round_, configs)
        searches = {row.name: search_state(design, task, row, steps[row.name], len(extra[row.name]), by_key)
                    for row in design.rows}
        wider = {row.name: sp.extend(searches[row.name], protocol) for row in design.rows}
        if all(step is None for step in wider.values()):
            break
        extra = {name: tried + (() if wider[name] is None else (wider[name],)) for name, tried in extra.items()}
    return searches


def heldout_arms(design: sp.Design, task: str, searches: dict[str, sp.Search]) -> tuple[sp.Arm, ...]:
    """Each row at its chosen rate, then the spec's extra arms: those at the paper's settings (kasa), the
    baseline's rate controls at the best swept row's rate (lambda: lambda 1 at its eta_QK and eta_V)."""
    arms = [sp.Arm(name, s.row.keys, s.best.rate) for name, s in searches.items() if s.best is not None]
    arms += sp.paper_arms(design, task)
    baseline, off = design.baseline_row(), best_off_diagonal(design, searches)
    if baseline is not None and off is not None:
        known = {(a.rate, design.swept_value(a.keys)) for a in arms}
        value = design.swept_value(baseline.keys)
        arms += [c for c in sp.rate_controls(design, off, baseline) if (c.rate, value) not in known]
    return tuple(arms)


def best_off_diagonal(design: sp.Design, searches: dict[str, sp.Search]) -> sp.Arm | None:
    """The swept row off the baseline (lambda > 1) whose chosen rate scored best on the selection seeds."""
    baseline = design.baseline_row()
    candidates = [s for s in searches.values() if baseline is not None and s.row.name != baseline.name and s.best]
    if not candidates:
        return None
    best = max(candidates, key=lambda s: s.best.mean)
    return sp.Arm(best.row.name, best.row.keys, best.best.rate)


def key_arms(design: sp.Design, searches: dict[str, sp.Search]) -> tuple[sp.Arm, sp.Arm] | None:
    """The W_k ablation: the baseline row's pick as it is, and with W_k trained too."""
    targets = sp.key_ablation_targets(design.base.get("targets", "q,v"))
    baseline = design.baseline_row()
    search = searches.get(baseline.name) if baseline is not None else None
    if not (design.key_ablation and targets and search and search.best):
        return None
    frozen = sp.Arm(search.row.name, search.row.keys, search.best.rate)
    return frozen, sp.Arm(f"{frozen.name} with W_k trained", {**frozen.keys, "targets": targets}, frozen.rate)


def run_task(study, design: sp.Design, task: str) -> None:
    """One task's searches and held-out stages through ``study.run_configs`` (a sweep per stage)."""

    def run_round(round_: int, configs: list[dict]) -> dict[str, dict]:
        study.run_configs(f"search-{task}-round{round_}", configs,
                          f"fair study, {task}: rate searches on the selection seeds, round {round_}")
        return study.rows_by_key()

    searches = replay_searches(design, task, {}, run_round)
    unfinished = [name for name, s in searches.items() if s.best is None]
    if unfinished:
        raise PeftlabError(f"the rate search of {', '.join(unfinished)} on {task} has no finished rate",
                           fix="see the runs' logs under <output dir>/runs/logs/, then rerun the same command")
    arms = heldout_arms(design, task, searches)
    study.run_configs(f"heldout-{task}", sp.heldout_configs(design, task, arms),
                      f"fair study, {task}: each row at its chosen rate on the held-out seeds")
    pair = key_arms(design, searches)
    if pair is not None:
        study.run_configs(f"key-{task}", sp.heldout_configs(design, task, list(pair), design.key_seed_list),
                          f"fair study, {task}: the W_k ablation at the lambda-1 pick, {len(design.key_seed_list)} "
                          "held-out seeds")


def plan_lines(design: sp.Design, split_sizes: dict[str, str]) -> list[str]:
    """What --dry-run prints: rows, their first rates, the splits, the caps, the run count."""
    p = design.protocol
    rows = [f"  {row.name}: " + ", ".join(f"{sp.rate_at(row, s, p.grid_factor):g}" for s in p.initial_steps())
            + f" (then x{p.grid_factor:g} past an edge, up to {p.max_extensions} more)" for row in design.rows]
    search = len(design.rows) * len(p.initial_steps()) * p.selection_seeds
    extra = (len(design.section.paper_arms) if design.paper_arms else 0) + len(design.section.controls)
    heldout = (len(design.rows) + extra) * design.heldout_seeds
    key = 2 * len(design.key_seed_list) if design.key_ablation else 0
    most = len(design.rows) * p.max_extensions * p.selection_seeds
    per_task = search + heldout + key
    return ["protocol: fair (each row at its own searched rate, to its plateau, scored on a test split no choice "
            "read)",
            "rows and their first rates (head rate tied to the module rate; head-only: its one rate):", *rows,
            *[f"splits of {task}: {text}" for task, text in split_sizes.items()],
            f"training: at most {design.base.get('epochs')} epochs; early stopping after {p.patience} evaluated "
            f"epoch(s) without a selection gain > {p.min_delta:g}",
            f"seeds: selection {p.selection_seed_list}; held-out {design.heldout_seed_list[0]}-"
            f"{design.heldout_seed_list[-1]}" + (f"; W_k ablation {len(design.key_seed_list)} seeds"
                                                 if key else ""),
            f"runs per task: {search} search + {heldout} held-out" + (f" + {key} W_k ablation" if key else "")
            + f" = {per_task} (+ up to {most} for grid extensions); {per_task * len(design.tasks)} for "
            f"{len(design.tasks)} task(s)"]
