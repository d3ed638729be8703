"""peftlab's decoder fine-tuning against the papers' decoder pipeline, in training tokens/s at equal loss.

    python benchmarks/against_trainer_decoder.py --tasks math --model smollm2-135m --batch-size 4

Setups (:mod:`benchmarks.decoder_worker` says what each runs): ``llm-adapters`` (LLM-Adapters' / KaSA's
``finetune.py``: ``transformers.Trainer`` + ``DataCollatorForSeq2Seq``, padding to the longest, random batches),
``peftlab`` (length-grouped batches padded to their longest) and ``peftlab-packed`` (``--packing``). Same model,
LoRA on q_proj and v_proj, rank, alpha, dropout, batch size, the same seeded examples and token sequences (prompt
masked), epochs, AdamW at one learning rate with a linear warm-up/decay, precision, one thread each.

How they are measured (:mod:`benchmarks.pairs`): the pairs given by ``--pairs`` (default every pair of the
three) run two at a time, each pinned to its own core, then again with the cores swapped; ``--repeats`` rounds of
that, round r with the r-th ``--seeds`` seed (cyclically). A pair's ratio is the geometric mean over its runs of
the second setup's tokens/s over the first's, each ratio from two runs made at the same time. Tokens: the examples'
real tokens (prompt and response), counted the same way on every side, over each run's training-loop seconds.
Equal loss: each side's mean training loss and its loss on a fixed probe after training (the first
``probe_examples`` training examples, the same function on both sides) are printed beside the rates. Also per
setup: the token slots its batches computed (÷ real tokens: what padding cost), the FLOPs they computed (padding
and each row's attention square included) ÷ the real tokens' model FLOPs, the model FLOP/s of the real tokens
(:mod:`benchmarks.flops`) and its share of that core's GEMM peak.

The GLUE comparison is :mod:`benchmarks.against_trainer`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repository root, not its own folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.cli import main, parser, progress
from benchmarks.decoder_worker import GROUPED_SETUP, PACKED_SETUP, SETUPS, TRAINER_SETUP
from benchmarks.pairs import (OK_STATUSES, Comparison, add_pair_flags, common_settings, made_together, mean,
                              median, parse_setup_pairs, run_comparison)
from benchmarks.render import _env_line, _num, _ratio, slug
from benchmarks.timing import paired_geomean

DECODER_TASKS = {"math": "gsm8k", "commonsense": "boolq", "e2e": None}  # task -> the one set its evaluation scores
DEFAULT_PAIRS = f"{TRAINER_SETUP}:{GROUPED_SETUP},{TRAINER_SETUP}:{PACKED_SETUP},{GROUPED_SETUP}:{PACKED_SETUP}"
DROPOUT, WARMUP_RATIO, MAX_GRAD_NORM, PROBE_EXAMPLES = 0.05, 0.06, 1.0, 32  # LLM-Adapters' dropout
SETUP_TEXT = {
    TRAINER_SETUP: "LLM-Adapters' / KaSA's finetune.py: transformers.Trainer + peft LoRA (q_proj, v_proj) + "
                   "DataCollatorForSeq2Seq(padding=True, pad_to_multiple_of=8): every batch padded to its longest "
                   "example, batches drawn at random",
    GROUPED_SETUP: "peftlab train: length-grouped batches, each padded to its longest example",
    PACKED_SETUP: "peftlab train --packing: each batch one unpadded row (DataCollatorWithFlattening, position_ids "
                  "restarting per example), each example attending on its own (per-example SDPA), batches drawn at "
                  "random",
}


def parse_pairs(text: str | None) -> list[tuple[str, str]]:
    return parse_setup_pairs(text, DEFAULT_PAIRS, SETUPS)


def settings_from_args(args) -> dict[str, Any]:
    from peftlab.errors import unknown

    for task in args.tasks:
        if task not in DECODER_TASKS:
            raise unknown("decoder task", task, list(DECODER_TASKS), where="--tasks")
    return {**common_settings(args), "pairs": [f"{a}:{b}" for a, b in parse_pairs(args.pairs)], "lr": args.lr,
            "dropout": DROPOUT, "warmup_ratio": WARMUP_RATIO, "max_grad_norm": MAX_GRAD_NORM,
            "probe_examples": min(PROBE_EXAMPLES, args.train_examples)}


def run_against_trainer_decoder(args) -> dict[str, Any]:
    settings = settings_from_args(args)
    name = args.name or f"against-trainer-{'-'.join(settings['tasks'])}-{slug(settings['model'])}-b{settings['batch_size']}"
    keys = ("model", "train_examples", "epochs", "max_length", "batch_size", "rank", "alpha", "dropout", "lr",
            "warmup_ratio", "max_grad_norm", "mixed_precision", "data_dir", "probe_examples")
    bench = Comparison("against_trainer_decoder", "benchmarks.decoder_worker", SETUP_TEXT, keys, summarize_task,
                       markdown_against_trainer_decoder, task_spec=lambda task: {"eval_set": DECODER_TASKS[task]})
    return run_comparison(bench, settings, Path(args.out_dir), name, progress(args.quiet))


def summarize_task(runs: list[dict], task: str, pair_names: list[str]) -> dict[str, Any]:
    """Per setup: medians (tokens/s, train s, model GFLOP/s, share of the GEMM peak) and mean losses over its runs;
    per pair A:B: the geometric mean of B's tokens/s over A's, over the runs made side by side."""
    ok = [r for r in runs if r["task"] == task and r.get("status") in OK_STATUSES]
    out: dict[str, Any] = {"task": task, "setups": {}, "pairs": {}}
    for setup in SETUPS:
        mine = [r for r in ok if r["setup"] == setup]
        if not mine:
            continue
        shares = [r["model_gflops"] / r["gemm_peak"]["peak_gflops"] for r in mine
                  if r.get("model_gflops") and (r.get("gemm_peak") or {}).get("peak_gflops")]
        out["setups"][setup] = {
            "runs": len(mine), "tokens_per_s": median([r.get("tokens_per_s") for r in mine]),
            "train_s": median([r.get("train_s") for r in mine]),
            "real_tokens": median([r.get("train_real_tokens") for r in mine]),
            "slots_per_real_token": median([r["train_token_slots"] / r["train_real_tokens"] for r in mine
                                             if r.get("train_real_tokens")]),
            "flops_per_model_flop": median([(r.get("model_flops") or {}).get("executed_per_model_flop")
                                             for r in mine]),
            "train_loss": mean([r.get("train_loss") for r in mine]),
            "probe_loss": mean([r.get("probe_loss") for r in mine]),
            "model_gflops": median([r.get("model_gflops") for r in mine]), "of_peak": median(shares),
            "peak_gflops": median([(r.get("gemm_peak") or {}).get("peak_gflops") for r in mine]),
        }
    for pair in pair_names:
        first, second = pair.split(":")
        both = made_together(runs, task, pair)
        ratio = paired_geomean([by[second]["tokens_per_s"] for by in both], [by[first]["tokens_per_s"] for by in both])
        same = all(by[first]["train_real_tokens"] == by[second]["train_real_tokens"]
                   and (by[first].get("model_flops") or {}).get("total") == (by[second].get("model_flops") or {}).get("total")
                   for by in both)
        out["pairs"][pair] = {"tokens_per_s_ratio": ratio, "same_tokens_and_flops": same if both else None}
    return out


def rerender(result: dict) -> str:
    result["summary"] = [summarize_task(result["runs"], task, result["settings"]["pairs"])
                         for task in result["settings"]["tasks"]]
    return markdown_against_trainer_decoder(result)


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def markdown_against_trainer_decoder(result: dict) -> str:
    s = result["settings"]
    precision = s["mixed_precision"] if s["mixed_precision"] != "no" else "fp32"
    lines = [
        f"## peftlab vs the papers' decoder pipeline: {s['model']}, LoRA q,v rank {s['rank']}, micro-batch "
        f"{s['batch_size']}, max length {s['max_length']}, {s['train_examples']} training examples, {s['epochs']} "
        f"epoch(s), {precision}",
        "",
        _env_line(result["environment"]),
        f"Pairs run side by side, one core and one thread each (cores {', '.join(map(str, result['cores']))}), then "
        f"with the cores swapped; {s['repeats']} round(s), seeds {', '.join(map(str, s['seeds']))}. AdamW at "
        f"{s['lr']:g}, linear schedule, warm-up {s['warmup_ratio']:g}, LoRA dropout {s['dropout']:g}. Tokens: the "
        "examples' real tokens over each run's training-loop seconds. Probe loss: the mean loss on the response "
        f"tokens of the first {s['probe_examples']} training examples after training (the same function on every "
        "side). Slots ÷ real: the token positions the batches computed per real token; FLOPs ÷ model: the FLOPs "
        "they computed (padding, each row's attention square) per FLOP of the real tokens (benchmarks.flops).",
        "",
        "Setups: " + "; ".join(f"**{k}** = {v}" for k, v in result["setups"].items()) + ".",
        "",
        "| task | setup | runs | tokens/s | train s | slots ÷ real | FLOPs ÷ model | train loss | probe loss | "
        "model GFLOP/s | of GEMM peak |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["summary"]:
        for setup, d in row["setups"].items():
            lines.append(f"| {row['task']} | {setup} | {d['runs']} | {_num(d['tokens_per_s'], '.1f')} | "
                         f"{_num(d['train_s'], '.1f')} | {_num(d['slots_per_real_token'], '.3f')} | "
                         f"{_num(d['flops_per_model_flop'], '.3f')} | "
                         f"{_num(d['train_loss'], '.4f')} | {_num(d['probe_loss'], '.4f')} | "
                         f"{_num(d['model_gflops'], '.1f')} | {_percent(d['of_peak'])} |")
    lines += ["", "| task | pair A:B | B tokens/s ÷ A tokens/s [min, max] | same tokens and FLOPs |", "|---|---|---:|---|"]
    for row in result["summary"]:
        for pair, d in row["pairs"].items():
            same = {True: "yes", False: "**no**", None: "-"}[d["same_tokens_and_flops"]]
            lines.append(f"| {row['task']} | {pair} | {_ratio(d['tokens_per_s_ratio'])} | {same} |")
    lines += ["", "Runs:", "", "| task | round | pair | cores | setup | status | tokens/s | train s | train loss | "
              "probe loss |", "|---|---:|---|---:|---|---|---:|---:|---:|---:|"]
    for r in result["runs"]:
        lines.append(f"| {r['task']} | {r['round']} | {r['pair']} | {r.get('core', '-')} | {r['setup']} | "
                     f"{r['status'] if r['status'] != 'failed' else 'failed: ' + r.get('error', '')[:80]} | "
                     f"{_num(r.get('tokens_per_s'), '.1f')} | {_num(r.get('train_s'), '.1f')} | "
                     f"{_num(r.get('train_loss'), '.4f')} | {_num(r.get('probe_loss'), '.4f')} |")
    lines.append("")
    return "\n".join(lines)


def make_parser():
    made = parser(__doc__, __file__, with_threads=False)  # one thread per run, one core each
    add_pair_flags(made, tasks=["math"], model="smollm2-135m", pairs=DEFAULT_PAIRS, train_examples=256,
                   max_length=512, batch_size=4, lr=3e-4)  # LLM-Adapters' learning rate and micro-batch
    return made


def cli_main(argv: list[str] | None = None) -> int:
    return main(make_parser(), run_against_trainer_decoder, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
