"""peftlab side by side with the papers' Trainer pipelines on GLUE tasks.

    python benchmarks/against_trainer.py --model minilm-l6 --tasks rte,mrpc --repeats 2

Setups (:mod:`benchmarks.trainer_worker` says what each runs): ``pad128`` (Yao et al.'s pipeline:
``transformers.Trainer``, every example padded to T, random batches), ``longest`` (the KaSA authors' pipeline:
Trainer, each batch padded to its longest example, random batches), ``grouped`` (Trainer's best:
``group_by_length`` and ``DataCollatorWithPadding``), ``peftlab`` (``peftlab train --compile off``: dynamic
padding, length-grouped batches) and ``peftlab-compiled`` (the same with ``--compile on``). Same model, LoRA on q,
v, rank, batch, T, training subset, epochs, optimizer groups and schedule, precision (``--mixed-precision``) on
every side, one thread each; the dev metric on the full dev set.

How they are measured (:mod:`benchmarks.pairs`, as the decoder comparison): the pairs A:B of ``--pairs`` (default ``pad128:peftlab,longest:peftlab``; ``--compile`` adds ``pad128:peftlab-compiled``,
``longest:peftlab-compiled`` and ``peftlab:peftlab-compiled``) run two at a time, each pinned to its own core
with one thread, then again with the cores swapped; ``--repeats`` rounds of that, round r with the r-th
``--seeds`` seed (cyclically). A pair's ratio is B's examples/s over A's (= A's train s / B's: both train the
same examples) for each run made together, and their geometric mean: the side-by-side table prints both
orientations' ratios and the mean, as docs/BENCHMARKS.md quotes them, with each side's dev metric beside it and
whether both sides trained the same examples (digest) for the same optimizer steps. For the
``peftlab:peftlab-compiled`` pair the summary also estimates the compile's break-even: the compile time (the
compiled run's first step over the eager run's) over the per-step time it saves (mean steps after the first),
which is what :data:`peftlab.training.compile.AUTO_BREAK_EVEN_STEPS` is set from.

An older result of this benchmark (each setup run alone, round-robin: no ``pairs`` in its settings) is still
re-rendered as it was (:func:`rerender`).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repository root, not its own folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.cli import check_glue_tasks, main, parser, progress
from benchmarks.pairs import (OK_STATUSES, Comparison, add_pair_flags, common_settings, made_together, mean,
                              median, parse_setup_pairs, run_comparison)
from benchmarks.render import _env_line, _num, markdown_against_trainer, slug
from benchmarks.timing import paired_geomean
from benchmarks.trainer_worker import COMPILED_SETUP, PEFTLAB_SETUP, PEFTLAB_SETUPS, TRAINER_SETUPS
from peftlab.errors import PeftlabError

SETUPS = (*TRAINER_SETUPS, *PEFTLAB_SETUPS)
DEFAULT_PAIRS = "pad128:peftlab,longest:peftlab"

SETUP_TEXT = {
    "pad128": "transformers.Trainer, tokenised with padding=\"max_length\" (every example T tokens), random batches "
              "(Yao et al.'s pipeline)",
    "longest": "transformers.Trainer with DataCollatorWithPadding (each batch padded to its longest example), random "
               "batches (the KaSA authors' GLUE pipeline)",
    "grouped": "transformers.Trainer with train_sampling_strategy=\"group_by_length\" (group_by_length=True) and "
               "DataCollatorWithPadding (Trainer's best)",
    PEFTLAB_SETUP: "peftlab train --compile off: dynamic padding, length-grouped batches, cached tokenisation "
                   "(--pooling native)",
    COMPILED_SETUP: "peftlab train --compile on: the same, the train step's model compiled (torch.compile, inductor, "
                    "dynamic shapes)",
}
# How the side-by-side table names a setup (the issue's wording); pad128's T is filled in.
SETUP_NAMES = {
    "pad128": "Yao et al.'s pipeline (HF Trainer, pad to {T})",
    "longest": "the KaSA authors' pipeline (pad to the batch's longest, random batches)",
    "grouped": "HF Trainer with group_by_length",
    PEFTLAB_SETUP: "peftlab",
    COMPILED_SETUP: "peftlab --compile on",
}


def parse_pairs(text: str | None, compile_pairs: bool = False) -> list[tuple[str, str]]:
    """``--pairs A:B,...`` (default :data:`DEFAULT_PAIRS`). ``--compile`` adds the compiled setup against every
    Trainer setup of those pairs and against eager peftlab."""
    from benchmarks.decoder_worker import SETUPS as DECODER_SETUPS

    def not_a_decoder_setup(part: str) -> None:
        if part in DECODER_SETUPS and part not in SETUPS:
            raise PeftlabError(f"--pairs: '{part}' is a setup of the decoder tasks (math, commonsense, e2e), not "
                               "of GLUE tasks", fix=f"GLUE setups: {', '.join(SETUPS)}")

    pairs = parse_setup_pairs(text, DEFAULT_PAIRS, SETUPS, not_a_decoder_setup)
    if compile_pairs:
        trainers = [s for s in dict.fromkeys(s for pair in pairs for s in pair) if s in TRAINER_SETUPS]
        pairs += [(s, COMPILED_SETUP) for s in trainers] + [(PEFTLAB_SETUP, COMPILED_SETUP)]
    return list(dict.fromkeys(pairs))


def settings_from_args(args) -> dict[str, Any]:
    from peftlab.methods.table import METHODS

    check_glue_tasks(args.tasks)
    lora = METHODS["lora"]
    return {**common_settings(args), "pairs": [f"{a}:{b}" for a, b in parse_pairs(args.pairs, args.compile)],
            "eval_batch_size": 64, "dropout": 0.0, "lr": args.lr or lora.default_lr, "lr_ratio": args.lr_ratio,
            "head_lr": lora.default_head_lr, "warmup_ratio": 0.06, "max_grad_norm": 1.0,
            "eval": "the full dev set (validation split)"}


def run_against_trainer(args) -> dict[str, Any]:
    settings = settings_from_args(args)
    out_dir = Path(args.out_dir)
    name = args.name or f"against-trainer-{slug(settings['model'])}"
    keys = ("model", "train_examples", "epochs", "max_length", "batch_size", "eval_batch_size", "rank", "alpha",
            "dropout", "lr", "lr_ratio", "head_lr", "warmup_ratio", "max_grad_norm", "mixed_precision", "data_dir")
    bench = Comparison("against_trainer", "benchmarks.trainer_worker", SETUP_TEXT, keys, summarize_task,
                       markdown_pairs)
    return run_comparison(bench, settings, out_dir, name, progress(args.quiet))


def summarize_task(runs: list[dict], task: str, pair_names: list[str]) -> dict[str, Any]:
    """Per pair A:B: B's examples/s over A's for each pair of runs made together (in schedule order) and their
    geometric mean; each side's dev metric (mean over its runs), train s and examples/s; whether every run of the
    pair trained the same examples (digest, count) for the same optimizer steps; for peftlab:peftlab-compiled the
    compile's break-even (:func:`break_even`)."""
    from peftlab.tasks.table import TASKS

    metric = TASKS[task].primary_metric
    out: dict[str, Any] = {"task": task, "metric": metric, "pairs": {}}
    for pair in pair_names:
        first, second = pair.split(":")
        both = made_together(runs, task, pair)
        ratio = paired_geomean([by[second]["examples_per_s"] for by in both], [by[first]["examples_per_s"] for by in both])
        same = all(same_work(by[first], by[second]) for by in both)
        sides = {side: {"dev_metric": mean([(by[side].get("dev_metrics") or {}).get(metric) for by in both]),
                        "train_s": median([by[side]["train_s"] for by in both]),
                        "examples_per_s": median([by[side]["examples_per_s"] for by in both]),
                        "compiled": [((by[side].get("compile") or {}).get("compiled")) for by in both]
                        if side == COMPILED_SETUP else None}
                 for side in (first, second)}
        entry = {"first": first, "second": second, "runs": len(both), "examples_per_s_ratio": ratio,
                 "same_examples_and_steps": same if both else None, "sides": sides}
        if (first, second) == (PEFTLAB_SETUP, COMPILED_SETUP):
            entry["break_even"] = break_even([(by[first], by[second]) for by in both])
        out["pairs"][pair] = entry
    return out


def same_work(a: dict, b: dict) -> bool:
    """Both runs trained the same examples (digest of the raw examples, count) for the same optimizer steps."""
    return (a.get("train_examples_digest") is not None and a.get("train_examples_digest") == b.get("train_examples_digest")
            and a["examples"] == b["examples"] and a.get("optimizer_steps") == b.get("optimizer_steps"))


def break_even(pairs: list[tuple[dict, dict]]) -> dict[str, Any] | None:
    """From eager:compiled runs made together: compile s = the compiled first step - the eager first step; the
    per-step saving = eager - compiled mean step after the first; break-even steps = compile s / saving (None when
    compiling saves nothing per step). Medians over the pairs."""
    rows = []
    for eager, compiled in pairs:
        e, c = eager.get("compile") or {}, compiled.get("compile") or {}
        if not c.get("compiled") or e.get("first_step_s") is None or c.get("first_step_s") is None:
            continue
        steps = eager.get("optimizer_steps") or 0
        if steps < 2:
            continue
        per_step = [(run["train_step_s"] - record["first_step_s"]) / (steps - 1)
                    for run, record in ((eager, e), (compiled, c))]
        rows.append({"compile_s": c["first_step_s"] - e["first_step_s"], "eager_step_s": per_step[0],
                     "compiled_step_s": per_step[1]})
    if not rows:
        return None
    compile_s = median([r["compile_s"] for r in rows])
    eager_step, compiled_step = median([r["eager_step_s"] for r in rows]), median([r["compiled_step_s"] for r in rows])
    saving = eager_step - compiled_step
    return {"pairs": len(rows), "compile_s": compile_s, "eager_step_s": eager_step, "compiled_step_s": compiled_step,
            "step_speedup": eager_step / compiled_step if compiled_step else None,
            "break_even_steps": compile_s / saving if saving > 0 else None}


def rerender(result: dict) -> str:
    if "pairs" not in result["settings"]:  # an older result: each setup alone, round-robin
        result["summary"] = [summarize_sequential(result["runs"], task, result["settings"]["setups"])
                             for task in result["settings"]["tasks"]]
        return markdown_against_trainer(result)
    result["summary"] = [summarize_task(result["runs"], task, result["settings"]["pairs"])
                         for task in result["settings"]["tasks"]]
    return markdown_pairs(result)


def _times(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def ratio_cell(ratio: dict | None) -> str:
    """``1.87x, 1.91x (geometric mean 1.89x)``: each run made together, then their mean (the issue's format)."""
    if not ratio or ratio.get("geomean") is None:
        return "-"
    each = ", ".join(_times(r) for r in ratio["ratios"])
    return each if ratio["n"] == 1 else f"{each} (geometric mean {_times(ratio['geomean'])})"


def pair_name(pair: dict, max_length: int) -> str:
    return f"{SETUP_NAMES[pair['second']]} vs {SETUP_NAMES[pair['first']]}".replace("{T}", str(max_length))


def markdown_pairs(result: dict) -> str:
    s = result["settings"]
    precision = s["mixed_precision"] if s["mixed_precision"] != "no" else "fp32"
    tasks = [row["task"] for row in result["summary"]]
    lines = [
        f"## peftlab vs the papers' Trainer pipelines: {s['model']}, LoRA q,v r={s['rank']} alpha {s['alpha']:g}, "
        f"batch {s['batch_size']}, max length {s['max_length']}, {s['train_examples']} training examples, "
        f"{s['epochs']} epoch(s), {precision}",
        "",
        _env_line(result["environment"]),
        f"Each pair at the same time, one core and one thread each (cores {', '.join(map(str, result['cores']))}), "
        f"then with the cores swapped; {s['repeats']} round(s), seeds {', '.join(map(str, s['seeds']))}. Ratio: B's "
        "examples/s over A's (= A's train s / B's: the same examples), one per pair of runs made together, and their "
        "geometric mean. Train s: each pipeline's own timer of its epoch loops. AdamW, q at "
        f"{s['lr']:g}, v at {s['lr_ratio']:g} x that, head {s['head_lr']:g}, linear schedule, warm-up "
        f"{s['warmup_ratio']:g}. Dev metric on {s['eval']}.",
        "",
        "Setups: " + "; ".join(f"**{k}** = {v}" for k, v in result["setups"].items()) + ".",
        "",
        "| pair | " + " | ".join(t.upper() for t in tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for pair in s["pairs"]:
        rows = [row["pairs"].get(pair) for row in result["summary"]]
        named = next((p for p in rows if p), None) or dict(zip(("first", "second"), pair.split(":")))
        lines.append(f"| {pair_name(named, s['max_length'])} | "
                     + " | ".join(ratio_cell((p or {}).get("examples_per_s_ratio")) for p in rows) + " |")
    lines += ["", "Both sides of each pair (dev metric: mean over its runs):", "",
              "| task | pair A:B | runs | A dev metric | B dev metric | A train s | B train s | same examples and steps |",
              "|---|---|---:|---|---|---:|---:|---|"]
    for row in result["summary"]:
        for pair, d in row["pairs"].items():
            a, b = d["sides"][d["first"]], d["sides"][d["second"]]
            same = {True: "yes", False: "**no**", None: "-"}[d["same_examples_and_steps"]]
            lines.append(f"| {row['task']} | {pair} | {d['runs']} | {row['metric']} {_num(a['dev_metric'], '.4f')} | "
                         f"{row['metric']} {_num(b['dev_metric'], '.4f')} | {_num(a['train_s'], '.1f')} | "
                         f"{_num(b['train_s'], '.1f')} | {same} |")
    lines += compile_lines(result)
    lines += ["", "Runs:", "", "| task | round | pair | core | setup | status | train s | ex/s | dev metrics |",
              "|---|---:|---|---:|---|---|---:|---:|---|"]
    for r in result["runs"]:
        metrics = ", ".join(f"{k} {v:.4f}" for k, v in (r.get("dev_metrics") or {}).items()
                            if isinstance(v, (int, float))) or r.get("error", "-")[:120]
        lines.append(f"| {r['task']} | {r['round']} | {r['pair']} | {r.get('core', '-')} | {r['setup']} | "
                     f"{r['status']} | {_num(r.get('train_s'), '.1f')} | {_num(r.get('examples_per_s'), '.1f')} | "
                     f"{metrics} |")
    lines.append("")
    return "\n".join(lines)


def compile_lines(result: dict) -> list[str]:
    """The compiled setup's runs: whether each compiled, its graphs; the break-even of the eager:compiled pair."""
    compiled = [r for r in result["runs"] if r["setup"] == COMPILED_SETUP and r.get("status") in OK_STATUSES]
    if not compiled:
        return []
    lines = ["", "Compiled runs (`--compile on`): compiled / fell back, graphs compiled (after the first step: more "
             "means recompiles), first step s (its compilation included).", "",
             "| task | pair | compiled | graphs (after the first step) | first step s |", "|---|---|---|---:|---:|"]
    for r in compiled:
        c = r.get("compile") or {}
        state = "yes" if c.get("compiled") else f"**no**: {c.get('fallback') or c.get('reason')}"
        lines.append(f"| {r['task']} | {r['pair']} | {state} | {c.get('graphs', '-')} "
                     f"({c.get('graphs_after_first_step', '-')}) | {_num(c.get('first_step_s'), '.1f')} |")
    rows = [(row["task"], row["pairs"].get(f"{PEFTLAB_SETUP}:{COMPILED_SETUP}")) for row in result["summary"]]
    rows = [(task, p["break_even"]) for task, p in rows if p and p.get("break_even")]
    if rows:
        lines += ["", "Break-even of the compile (peftlab:peftlab-compiled; medians over its pairs): compile s = the "
                  "compiled first step - the eager one; step s = the mean step after the first.", "",
                  "| task | compile s | eager step s | compiled step s | step speed-up | break-even steps |",
                  "|---|---:|---:|---:|---:|---:|"]
        for task, b in rows:
            lines.append(f"| {task} | {_num(b['compile_s'], '.1f')} | {_num(b['eager_step_s'], '.3f')} | "
                         f"{_num(b['compiled_step_s'], '.3f')} | {_times(b['step_speedup'])} | "
                         f"{_num(b['break_even_steps'], '.0f')} |")
    return lines


# --------------------------------------------------------------------------- older results (round-robin)


def summarize_sequential(runs: list[dict], task: str, setups: list[str]) -> dict[str, Any]:
    """An older result's summary (each setup alone, round-robin): per setup medians over repeats, and peftlab /
    each Trainer setup as the geometric mean of per-repeat train-time ratios."""
    from peftlab.tasks.table import TASKS

    metric = TASKS[task].primary_metric
    ok = [r for r in runs if r["task"] == task and r.get("status") in OK_STATUSES]
    out: dict[str, Any] = {"task": task, "metric": metric, "setups": {}, "peftlab_vs": {}}
    for setup in setups:
        mine = [r for r in ok if r["setup"] == setup]
        values = [r["dev_metrics"].get(metric) for r in mine if r["dev_metrics"].get(metric) is not None]
        slots = median([r.get("train_token_slots") for r in mine])
        real = median([r.get("train_real_tokens") for r in mine])
        out["setups"][setup] = {
            "runs": len(mine), "train_s_per_epoch": median([r["train_s"] / max(1, r["epochs"]) for r in mine]),
            "examples_per_s": median([r.get("examples_per_s") for r in mine]),
            "peak_rss_mb": median([r.get("peak_rss_mb") for r in mine]),
            "process_wall_s": median([r.get("process_wall_s") for r in mine]),
            "metric_mean": statistics.fmean(values) if values else None,
            "metric_std": statistics.stdev(values) if len(values) > 1 else None,
            "token_slots": slots, "real_token_share": real / slots if slots and real is not None else None,
        }
    by_repeat: dict[int, dict] = {}
    for r in ok:
        by_repeat.setdefault(r["repeat"], {})[r["setup"]] = r
    complete = [by for by in by_repeat.values() if PEFTLAB_SETUP in by]
    for setup in setups:
        if setup == PEFTLAB_SETUP or PEFTLAB_SETUP not in setups:
            continue
        pairs = [by for by in complete if setup in by]
        out["peftlab_vs"][setup] = {
            "examples_per_s_ratio": paired_geomean([by[setup]["train_s"] for by in pairs],
                                                   [by[PEFTLAB_SETUP]["train_s"] for by in pairs]),
            "process_wall_ratio": paired_geomean([by[setup]["process_wall_s"] for by in pairs],
                                                 [by[PEFTLAB_SETUP]["process_wall_s"] for by in pairs])}
    return out


def make_parser():
    made = parser(__doc__, __file__, with_threads=False)  # one thread per run, one core each
    add_pair_flags(made, tasks=["rte", "mrpc"], model="minilm-l6", pairs=DEFAULT_PAIRS, train_examples=1000,
                   max_length=128, batch_size=32, lr=None, lr_ratio=2.0)
    made.add_argument("--compile", action="store_true",
                      help="add peftlab --compile on (setup peftlab-compiled) against pad128, longest and eager "
                           "peftlab (its compile time and break-even too)")
    return made


def cli_main(argv: list[str] | None = None) -> int:
    return main(make_parser(), run_against_trainer, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
