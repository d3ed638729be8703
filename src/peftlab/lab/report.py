"""``peftlab report PATH...``: the papers' table from results stores or run folders, with a reviewer's statistics.

Rows are configs grouped without the seed (:mod:`peftlab.lab.report_rows`), columns tasks, then Avg and #Param. A
cell averages every *finished* run at its value, labelled ones too: a run is never left out for how it came out,
its label is counted in [brackets] with the cell's median and range, so a bimodal cell never reads as a bare mean.
Failed runs and pruned tune trials did not finish: counted as "left out", never averaged. ``--baseline`` compares
every other cell with the baseline's (:mod:`peftlab.lab.stats`); the footnote (:mod:`peftlab.lab.tables`) says
what every mark and number means.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

from peftlab.argtypes import assignments, bounded_int, output_file, positive_float, text
from peftlab.errors import PeftlabError, closest
from peftlab.io_utils import atomic_write_text
from peftlab.lab.provenance import require_one_code, summarize
from peftlab.lab.records import (
    NON_RESULT_KEYS, RunRecord, auto_scale, collect, drop_superseded_pruned, fmt_value, load_rows, matches,
    parse_filter, parse_seeds, rows_of_seeds, task_determined_keys, task_order)
from peftlab.lab.report_rows import grouped_rows, labelled_rows, majority_row, records_frame, require_one_test_set
from peftlab.lab.stats import CI_METHODS, CORRECTIONS, TESTS, compare_with_baseline
from peftlab.lab.table_model import Row, Table
from peftlab.lab.tables import MAJORITY, PARAM_CONVENTIONS, RENDERERS


def build_table(rows: Iterable[dict], *, which: str = "best", metric: str | None = None, params: str = "total",
                baseline: str | None = None, alpha: float = 0.05, where: str | None = None,
                scale: float | None = None, test: str = "auto", correction: str = "bh", ci: str = "t",
                equivalence_margin: float | None = None, power: bool = False, power_diff: float | None = None,
                allow_mixed_code: bool = False) -> Table:
    """The table of ``rows`` (:func:`~peftlab.lab.records.load_rows`); the options are ``peftlab report``'s."""
    _check_options(which=which, params=params, test=test, correction=correction, ci=ci, alpha=alpha,
                   baseline=baseline, equivalence_margin=equivalence_margin, power=power, power_diff=power_diff)
    records, skipped, superseded = _finished_records(rows, which=which, metric=metric, where=where)
    code = summarize(rec.result for rec in records)
    require_one_code(code, allow_mixed=allow_mixed_code)
    per_task = task_determined_keys([r for r in records if not r.before])
    metrics: dict[str, str] = {}
    for rec in filter(lambda rec: rec.metric, records):
        metrics.setdefault(rec.task, rec.metric)

    frame, configs = records_frame(records, drop=set(NON_RESULT_KEYS) | set(per_task), params=params)
    majority, majority_differ = majority_row(frame)
    # methods in the order the runs list them (the sweep's grid order); other keys by value
    method_order = list(dict.fromkeys(str(rec.config.get("method")) for rec in records))
    before_rows, trained_rows, label_keys = labelled_rows(grouped_rows(frame, configs), method_order)
    if majority is not None:
        majority.label = {k: None for k in label_keys}
    table = Table(tasks=task_order(r.task for r in records), label_keys=label_keys, rows=before_rows + trained_rows,
                  metrics=metrics, scale=scale if scale is not None else auto_scale(metrics.values()), which=which,
                  params=params, alpha=alpha, test_requested=test, test=test, correction=correction, ci=ci,
                  margin=equivalence_margin, power=power or power_diff is not None, power_diff=power_diff,
                  majority=majority, code=code, superseded_pruned=superseded)
    if baseline:
        table.baseline, table.baseline_text = _baseline_row(trained_rows, label_keys, baseline), baseline
        compare_with_baseline(table)
    _add_notes(table, records, majority_differ, per_task, skipped)
    return table


def _finished_records(rows: Iterable[dict], *, which: str, metric: str | None,
                      where: str | None) -> tuple[list[RunRecord], dict[str, int], int]:
    """The records to report, the unfinished runs counted by status, and how many pruned trials were
    superseded; refuses an empty table and runs of one task scored on different examples."""
    filters = parse_filter(where)
    records, skipped = collect(rows, which=which, metric=metric, where=filters)
    if not records:
        detail = f" ({', '.join(f'{n} {s}' for s, n in skipped.items())})" if skipped else ""
        raise PeftlabError(f"no finished runs to report{detail}" + (" match --where" if filters else ""),
                           fix="run the sweep first (peftlab sweep SPEC.yaml), or loosen --where")
    if metric and all(rec.value is None for rec in records):
        have = sorted({m for rec in records for m in ((rec.result or {}).get(which) or {}).get("metrics", {})})
        raise PeftlabError(f"--metric {metric}: no finished run has it", fix="use one they have: "
                           + (", ".join(have[:12]) or "none recorded") + (", ..." if len(have) > 12 else ""))
    records, superseded = drop_superseded_pruned(records)
    require_one_test_set(records)
    return records, skipped, superseded


def _add_notes(table: Table, records: list[RunRecord], majority_differ: list[tuple], per_task: dict,
               skipped: dict[str, int]) -> None:
    """The notes under the table: the datasets that are not GLUE's own, each task's caveats (result.json
    ``report_notes``), a majority class that differs between runs, settings that vary only with the task, and the
    unfinished runs left out."""
    for rec in records:
        dataset = (rec.result or {}).get("dataset")
        if dataset and dataset != "glue":
            table.datasets[rec.task] = dataset
    if table.datasets:
        table.notes.append("; ".join(f"{t}: dataset {d}" + (" (10k subsets of GLUE train, 90/10 train/dev; not the "
                                                              "full task)" if d == "glue_subsets" else "")
                                     for t, d in sorted(table.datasets.items())))
    for rec in records:
        for note in (rec.result or {}).get("report_notes") or []:
            if f"{rec.task}: {note}" not in table.notes:
                table.notes.append(f"{rec.task}: {note}")
    if majority_differ:
        ranges = ", ".join(f"{task} {lo * table.scale:.4g}–{hi * table.scale:.4g}"
                           for task, lo, hi in sorted(majority_differ, key=lambda d: table.tasks.index(d[0])))
        table.notes.append(f"{MAJORITY}: the runs' dev sets differ (max_eval_samples/eval_seed?), so does the "
                           f"majority-class score ({ranges}); the row shows the mean over runs")
    if per_task:
        settings = [f"{k} " + ", ".join(f"{t}={fmt_value(v)}" for t, v in sorted(vals.items()))
                    for k, vals in per_task.items()]
        table.notes.append("per-task settings: " + "; ".join(settings))
    if skipped:
        unfinished = ", ".join(f"{n} {s}" for s, n in sorted(skipped.items()))
        table.notes.append(f"not in the table (unfinished): {unfinished}")


def _baseline_row(trained_rows: list[Row], label_keys: list[str], baseline: str) -> Row:
    """The one trained row ``--baseline`` names; anything else is refused in one line."""
    hits = [r for r in trained_rows if matches(r.config, parse_filter(baseline, what="--baseline"))]
    if len(hits) != 1:
        vary = ", ".join(label_keys) or "method"
        raise PeftlabError(
            f"--baseline '{baseline}' matches {len(hits)} rows of the table, not 1",
            fix=f"name one row by the keys that vary ({vary})" if hits else f"the rows vary in: {vary}")
    return hits[0]


def _check_options(*, which, params, test, correction, ci, alpha, baseline, equivalence_margin, power,
                   power_diff) -> None:
    for flag, value, choices in (("--which", which, ("best", "final")), ("--params", params, PARAM_CONVENTIONS),
                                 ("--test", test, TESTS), ("--correction", correction, CORRECTIONS),
                                 ("--ci", ci, CI_METHODS)):
        if value not in choices:
            listed = " or ".join(choices) if len(choices) == 2 else ", ".join(choices)
            raise PeftlabError(f"{flag} must be {listed}, got '{value}'{closest(value, choices)}")
    if not 0 < alpha < 1:
        raise PeftlabError(f"--alpha must be in (0, 1), got {alpha}")
    for flag, value in (("--equivalence-margin", equivalence_margin), ("--power-diff", power_diff)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise PeftlabError(f"{flag} must be a positive number of metric points (the table's scale), "
                               f"got {value}", fix=f"e.g. {flag} 1.0 for one accuracy point")
    wanted = [flag for flag, on in (("--equivalence-margin", equivalence_margin is not None),
                                    ("--power", power or power_diff is not None)) if on]
    if wanted and not baseline:
        raise PeftlabError(f"{' and '.join(wanted)} compare rows with a baseline, but no --baseline was given",
                           fix='name the row to compare with, e.g. --baseline "method=lora,targets=q,k,v"')


# --------------------------------------------------------------------------- CLI


MAX_DIGITS = 15  # a float64 holds 15-17 significant digits: more decimals print noise


def decimals(value: str) -> int:
    """``--digits``: a number of decimals a float can mean."""
    return bounded_int(value, 0, MAX_DIGITS, f"a number of decimals from 0 to {MAX_DIGITS}")


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "report", help="table of results stores or run folders: mean ± std over seeds per config and task",
        description="Rows: configs without the seed; columns: tasks (primary metric), Avg, #Param. Every finished "
                    "run is averaged at its value, also those labelled no_learning, collapsed or diverged: the "
                    "labels are counted in [brackets] with the cell's median and range; runs that crashed or were "
                    "pruned are counted there as left out. With --baseline, every other cell shows its difference "
                    "to the baseline with a 95% CI, the p-value (and the corrected one) and, for paired tests, its "
                    "number of pairs; where labelled runs are in it, also the same comparison without them. Under "
                    "the table: which code (commits, dirty trees) the runs ran.")
    parser.add_argument("stores", nargs="+", metavar="PATH",
                        help="results.sqlite of a sweep (or its output folder), or run folders of peftlab train "
                             "(holding result.json; e.g. runs/*/); several are merged")
    parser.add_argument("--format", choices=sorted(RENDERERS), default=None,
                        help="md, latex or csv (default: from --out's suffix, else md)")
    parser.add_argument("--out", type=output_file, default=None, help="write to this file instead of stdout")
    parser.add_argument("--which", choices=("best", "final"), default="best",
                        help="the best epoch's metrics (default, as the papers report) or the final epoch's")
    parser.add_argument("--metric", type=text, default=None,
                        help="report this metric instead of each task's primary metric (lm_eval/<task>/<metric>: "
                             "lm-evaluation-harness's, e.g. lm_eval/arc_easy/acc, from result.json \"lm_eval\")")
    parser.add_argument("--params", choices=tuple(PARAM_CONVENTIONS), default="total",
                        help="#Param convention: total = all trainable parameters, head included (default); "
                             "adapter = without the head; yao = Yao et al.'s: adapter + 2 x head for adapter "
                             "methods (LoRA {q,v} r=8 on RoBERTa-base: 294,912 + 2 x 592,130 = 1.48M), the total "
                             "for full fine-tuning")
    parser.add_argument("--where", type=assignments, default=None, metavar="K=V,...",
                        help='only runs matching, e.g. "model=minilm-l6"')
    parser.add_argument("--seeds", default=None, metavar="A-B,C",
                        help="only runs of these seeds, e.g. 100-109 (a study's held-out seeds) or 0,1,2")
    parser.add_argument("--digits", type=decimals, default=1,
                        help=f"decimals in md/latex, 0 to {MAX_DIGITS} (default 1)")
    parser.add_argument("--scale", type=positive_float, default=None,
                        help="multiply metrics by this (default: 100 for accuracy-like metrics, else 1)")
    add_comparison_options(parser)
    parser.add_argument("--allow-mixed-code", action="store_true",
                        help="build the table even when its runs come from more than one commit (or unrecorded "
                             "code); without it such a table is refused. The footnote lists what it mixes")
    parser.set_defaults(func=run_cli)


def add_comparison_options(parser) -> None:
    """The options of the comparisons with a baseline row (lab/stats.py)."""
    stats = parser.add_argument_group(
        "comparisons with a baseline row",
        "Seeds pair the rows: at one seed every row trains on the same subset and is scored on the same dev set.")
    stats.add_argument("--baseline", default=None, metavar="K=V,...",
                       help='row to compare every other with, e.g. "method=lora,targets=q,k,v,lr_ratio=1"')
    stats.add_argument("--test", choices=tuple(TESTS), default="auto",
                       help="auto (default): paired when the compared rows share seeds, else welch (the footnote "
                            "says which); paired = paired t-test over the seeds present in both cells, matched "
                            "by seed (scipy ttest_rel; each cell states its number of pairs); wilcoxon = "
                            "Wilcoxon signed-rank on the same pairs (non-parametric); welch = unpaired, unequal "
                            "variances (ttest_ind equal_var=False); student = unpaired, pooled variance "
                            "(equal_var=True; KaSA's)")
    stats.add_argument("--ci", choices=tuple(CI_METHODS), default="t",
                       help="95%% CI of each difference to the baseline: t (default; t interval of the paired "
                            "differences, or of the difference of means for welch/student) or bootstrap "
                            "(scipy.stats.bootstrap, BCa, 9,999 resamples, seeded: reproducible)")
    stats.add_argument("--correction", choices=tuple(CORRECTIONS), default="bh",
                       help="multiple-comparison correction over all the table's comparisons (and, apart, its "
                            "equivalence tests): bh = Benjamini-Hochberg, false discovery rate (default); holm = "
                            "Holm's step-down, family-wise error (for claims about every cell); none. The † "
                            "marks use the adjusted p")
    stats.add_argument("--alpha", type=float, default=0.05,
                       help="significance level of the † marks, the equivalence tests and --power (default 0.05)")
    stats.add_argument("--equivalence-margin", type=float, default=None, metavar="M",
                       help="equivalence test (TOST) against +-M metric points in the table's scale (e.g. 1 = one "
                            "accuracy point at x100): two one-sided tests of the --test kind (paired: ttest_rel "
                            "alternative greater vs baseline-M and less vs baseline+M); a cell says 'equivalent "
                            "within M' only when both pass after the correction, never otherwise")
    stats.add_argument("--power", action="store_true",
                       help="also print, per comparison, the smallest difference detectable with 80%% power "
                            "(two-sided, at --alpha) from the observed sd of the paired differences and the number "
                            "of pairs, and the seeds needed for --power-diff; exact, from scipy's noncentral t "
                            "(scipy.stats.nct). Sizes a study from a pilot store")
    stats.add_argument("--power-diff", type=float, default=None, metavar="D",
                       help="the difference (metric points, table scale) --power gives the seeds needed for "
                            "(default: each comparison's observed difference); implies --power")


def run_cli(args) -> int:
    fmt = args.format or {".tex": "latex", ".csv": "csv"}.get(Path(args.out or "").suffix.lower(), "md")
    rows = load_rows(args.stores)
    if args.seeds is not None:
        rows = rows_of_seeds(rows, parse_seeds(args.seeds))
    table = build_table(rows, which=args.which, metric=args.metric, params=args.params,
                        baseline=args.baseline, alpha=args.alpha, where=args.where, scale=args.scale,
                        test=args.test, correction=args.correction, ci=args.ci,
                        equivalence_margin=args.equivalence_margin, power=args.power, power_diff=args.power_diff,
                        allow_mixed_code=args.allow_mixed_code)
    rendered = RENDERERS[fmt](table, args.digits)
    if args.out:
        atomic_write_text(args.out, rendered)
        print(f"wrote {args.out}")
    else:
        print(rendered, end="")
        if fmt == "md":  # a `peftlab tune` store: its trials, winner and compute after the table
            from peftlab.lab.tune.summary import summaries_beside

            for summary in summaries_beside(args.stores):
                print("\n" + summary, end="")
    return 0

