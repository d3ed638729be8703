"""``peftlab bench --against trainer --task math`` (or commonsense, e2e): peftlab's decoder fine-tuning against the
papers' decoder pipeline, in training tokens/s at equal loss.

Setups (:mod:`peftlab.bench.decoder_worker` says what each runs): ``llm-adapters`` (LLM-Adapters' / KaSA's
``finetune.py``: ``transformers.Trainer`` + ``DataCollatorForSeq2Seq``, padding to the longest, random batches),
``peftlab`` (length-grouped batches padded to their longest) and ``peftlab-packed`` (``--packing``). Same model,
LoRA on q_proj and v_proj, rank, alpha, dropout, batch size, the same seeded examples and token sequences (prompt
masked), epochs, AdamW at one learning rate with a linear warm-up/decay, precision, one thread each.

How they are measured (:mod:`peftlab.bench.pairs`): the pairs given by ``--pairs`` (default every pair of the
three) run two at a time, each pinned to its own core, then again with the cores swapped; ``--repeats`` rounds of
that, round r with the r-th ``--seeds`` seed (cyclically). A pair's ratio is the geometric mean over its runs of
the second setup's tokens/s over the first's, each ratio from two runs made at the same time. Tokens: the examples'
real tokens (prompt and response), counted the same way on every side, over each run's training-loop seconds.
Equal loss: each side's mean training loss and its loss on a fixed probe after training (the first
``probe_examples`` training examples, the same function on both sides) are printed beside the rates. Also per
setup: the token slots its batches computed (÷ real tokens: what padding cost), the FLOPs they computed (padding
and each row's attention square included) ÷ the real tokens' model FLOPs, the model FLOP/s of the real tokens
(:mod:`peftlab.bench.flops`) and its share of that core's GEMM peak.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

from peftlab.bench.decoder_worker import GROUPED_SETUP, PACKED_SETUP, SETUPS, TRAINER_SETUP
from peftlab.bench.machine import environment, loadavg, write_result
from peftlab.bench.pairs import pair_schedule, run_pair, two_cores
from peftlab.bench.render import _env_line, _num, _ratio, slug
from peftlab.bench.timing import paired_geomean
from peftlab.errors import PeftlabError

WORKER = "peftlab.bench.decoder_worker"
DECODER_TASKS = {"math": "gsm8k", "commonsense": "boolq", "e2e": None}  # task -> the one set its evaluation scores
DEFAULT_PAIRS = f"{TRAINER_SETUP}:{GROUPED_SETUP},{TRAINER_SETUP}:{PACKED_SETUP},{GROUPED_SETUP}:{PACKED_SETUP}"
DEFAULTS = dict(model="smollm2-135m", train_examples=256, max_length=512, batch_size=4, lr=3e-4, dropout=0.05,
                probe_examples=32, warmup_ratio=0.06, max_grad_norm=1.0)  # LLM-Adapters' lr, dropout, micro-batch
SETUP_TEXT = {
    TRAINER_SETUP: "LLM-Adapters' / KaSA's finetune.py: transformers.Trainer + peft LoRA (q_proj, v_proj) + "
                   "DataCollatorForSeq2Seq(padding=True, pad_to_multiple_of=8): every batch padded to its longest "
                   "example, batches drawn at random",
    GROUPED_SETUP: "peftlab train: length-grouped batches, each padded to its longest example",
    PACKED_SETUP: "peftlab train --packing: each batch one unpadded row (DataCollatorWithFlattening, position_ids "
                  "restarting per example), each example attending on its own (per-example SDPA), batches drawn at "
                  "random",
}


def is_decoder_request(text: str | None) -> bool:
    names = [t.strip().lower() for t in (text or "").split(",") if t.strip()]
    decoder = [n in DECODER_TASKS for n in names]
    if any(decoder) and not all(decoder):
        raise PeftlabError(f"--against trainer compares encoder (GLUE) or decoder tasks, not both: {text}",
                           fix="run the decoder tasks (" + ", ".join(DECODER_TASKS) + ") and the GLUE ones apart")
    return bool(names) and all(decoder)


def parse_pairs(text: str | None) -> list[tuple[str, str]]:
    from peftlab.bench.pairs import parse_setup_pairs

    return parse_setup_pairs(text, DEFAULT_PAIRS, SETUPS)


def settings_from_args(args) -> dict[str, Any]:
    if args.threads not in (None, 1):
        raise PeftlabError(f"--threads {args.threads}: the decoder pairs run one thread each, on one core each",
                           fix="drop --threads")
    tasks = list(dict.fromkeys(t.strip().lower() for t in args.task.split(",") if t.strip()))
    seeds = [int(s) for s in str(args.seeds or "0").split(",") if s.strip()]
    return {
        "model": args.model or DEFAULTS["model"], "tasks": tasks, "pairs": [f"{a}:{b}" for a, b in parse_pairs(args.pairs)],
        "repeats": args.repeats or 1, "seeds": seeds, "threads": 1,
        "train_examples": args.max_train_samples or DEFAULTS["train_examples"], "epochs": args.epochs,
        "max_length": args.seq_len or DEFAULTS["max_length"], "batch_size": args.batch_size or DEFAULTS["batch_size"],
        "rank": args.rank, "alpha": args.alpha, "dropout": DEFAULTS["dropout"], "lr": args.lr or DEFAULTS["lr"],
        "warmup_ratio": DEFAULTS["warmup_ratio"], "max_grad_norm": DEFAULTS["max_grad_norm"],
        "mixed_precision": args.mixed_precision or "no", "data_dir": args.data_dir,
        "probe_examples": min(DEFAULTS["probe_examples"], args.max_train_samples or DEFAULTS["train_examples"]),
    }


def run_against_trainer_decoder(args) -> dict[str, Any]:
    import torch

    say = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)) if not args.quiet else (lambda m: None)
    settings = settings_from_args(args)
    cores = two_cores()
    pairs = [tuple(p.split(":")) for p in settings["pairs"]]
    out_dir = Path(args.out_dir)
    work = out_dir / "against-trainer-decoder-runs"
    work.mkdir(parents=True, exist_ok=True)
    name = args.name or f"against-trainer-{'-'.join(settings['tasks'])}-{slug(settings['model'])}-b{settings['batch_size']}"
    result: dict[str, Any] = {"kind": "against_trainer_decoder", "environment": environment(torch.device("cpu")),
                              "settings": settings, "setups": {s: SETUP_TEXT[s] for s in SETUPS}, "cores": list(cores),
                              "runs": [], "summary": []}
    result["environment"]["torch_threads"] = 1  # what every run was given
    keys = ("model", "train_examples", "epochs", "max_length", "batch_size", "rank", "alpha", "dropout", "lr",
            "warmup_ratio", "max_grad_norm", "mixed_precision", "data_dir", "probe_examples")
    schedule = pair_schedule(pairs, settings["repeats"], cores)
    for task in settings["tasks"]:
        for index, entry in enumerate(schedule):
            seed = settings["seeds"][entry["round"] % len(settings["seeds"])]
            label = f"{task}-r{entry['round']}-{entry['pair'].replace(':', '-vs-')}-o{entry['orientation']}"
            specs = {setup: {**{k: settings[k] for k in keys}, "task": task, "setup": setup, "seed": seed,
                             "eval_set": DECODER_TASKS[task], "run_dir": str(work / f"{label}-{setup}"),
                             "logging_steps": max(1, settings["train_examples"] // settings["batch_size"] // 8)}
                     for setup in entry["cores"]}
            say(f"against trainer: {task} pair {index + 1}/{len(schedule)} {entry['pair']} (cores "
                + ", ".join(f"{s} {c}" for s, c in entry["cores"].items()) + f", seed {seed})")
            for setup, run in run_pair(WORKER, specs, entry["cores"], work, label).items():
                run.update(task=task, setup=setup, round=entry["round"], pair=entry["pair"],
                           orientation=entry["orientation"], seed=seed)
                if run["status"] == "failed":
                    say(f"{label} {setup} failed: {run['error']} (log {run['log']})")
                result["runs"].append(run)
            save(result, out_dir, name)
        result["summary"].append(summarize_task(result["runs"], task, settings["pairs"]))
        save(result, out_dir, name)
    result["environment"]["loadavg_end"] = loadavg()
    save(result, out_dir, name)
    return result


def _median(values):
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _mean(values):
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


OK_STATUSES = ("ok", "no_learning", "collapsed")


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
            "runs": len(mine), "tokens_per_s": _median([r.get("tokens_per_s") for r in mine]),
            "train_s": _median([r.get("train_s") for r in mine]),
            "real_tokens": _median([r.get("train_real_tokens") for r in mine]),
            "slots_per_real_token": _median([r["train_token_slots"] / r["train_real_tokens"] for r in mine
                                             if r.get("train_real_tokens")]),
            "flops_per_model_flop": _median([(r.get("model_flops") or {}).get("executed_per_model_flop")
                                             for r in mine]),
            "train_loss": _mean([r.get("train_loss") for r in mine]),
            "probe_loss": _mean([r.get("probe_loss") for r in mine]),
            "model_gflops": _median([r.get("model_gflops") for r in mine]), "of_peak": _median(shares),
            "peak_gflops": _median([(r.get("gemm_peak") or {}).get("peak_gflops") for r in mine]),
        }
    for pair in pair_names:
        first, second = pair.split(":")
        together: dict[tuple, dict] = {}
        for r in ok:
            if r["pair"] == pair:
                together.setdefault((r["round"], r["orientation"]), {})[r["setup"]] = r
        both = [by for by in together.values() if first in by and second in by]
        ratio = paired_geomean([by[second]["tokens_per_s"] for by in both], [by[first]["tokens_per_s"] for by in both])
        same = all(by[first]["train_real_tokens"] == by[second]["train_real_tokens"]
                   and (by[first].get("model_flops") or {}).get("total") == (by[second].get("model_flops") or {}).get("total")
                   for by in both)
        out["pairs"][pair] = {"tokens_per_s_ratio": ratio, "same_tokens_and_flops": same if both else None}
    return out


def save(result: dict, out_dir: Path, name: str) -> None:
    write_result(result, out_dir, name, markdown_against_trainer_decoder)


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
        "they computed (padding, each row's attention square) per FLOP of the real tokens (peftlab.bench.flops).",
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
