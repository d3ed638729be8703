"""The end-to-end benchmark: ``peftlab.training.loop.train`` run twice per task and seed, with peftlab's default
data path (dynamic padding, length-grouped batches, cached tokenisation) and with the papers' setup
(``--pad-to-max``, T = ``--seq-len`` = 128): train seconds per epoch and the final dev metric of each.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from peftlab.bench.machine import environment, loadavg, method_list, resolve_device, write_result
from peftlab.bench.render import markdown_e2e, slug


SETUPS = (("dynamic", False), ("pad_to_max", True))


def _padding_stats(cfg) -> dict[str, Any] | None:
    """Token slots one epoch computes under each setup (from the cached tokenisation; no model run)."""
    try:
        from peftlab.tasks import data_files as data
        from peftlab.tasks import batching
        from peftlab.models.registry import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
        raw = data.subset(data.load_split(cfg.task, "train", cfg.data_dir), cfg.max_train_samples, cfg.seed)
        tokenised = batching.tokenize(raw, tokenizer, cfg.max_length, task=cfg.task, cache_key=f"{cfg.model}-train")
        lengths = [int(x) for x in tokenised["length"]]
        batches = batching.length_grouped_batches(lengths, cfg.batch_size, cfg.seed, 0)
        dynamic = sum(len(b) * max(lengths[i] for i in b) for b in batches)
        padded = len(lengths) * cfg.max_length
        return {"examples": len(lengths), "real_tokens": sum(lengths), "mean_length": sum(lengths) / len(lengths),
                "dynamic_token_slots": dynamic, "pad_to_max_token_slots": padded,
                "slot_ratio": padded / dynamic if dynamic else None}
    except Exception as err:  # informative only
        return {"error": f"{type(err).__name__}: {err}"}


def run_e2e(args) -> dict[str, Any]:
    from peftlab.config import TrainConfig, build_config
    from peftlab.methods.table import METHODS
    from peftlab.tasks.table import TASKS
    from peftlab.training.loop import train

    say = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)) if not args.quiet else (lambda msg: None)
    tasks = [t.strip().lower() for t in (args.task or "cola").split(",") if t.strip()]
    for task in tasks:
        if task not in TASKS or TASKS[task].kind == "instruction":
            from peftlab.errors import unknown

            raise unknown("GLUE task", task, [n for n, t in TASKS.items() if t.kind != "instruction"], where="--task")
    methods = method_list(args.methods or "lora", METHODS)
    targets = (args.targets or ["q,v"])[0]
    seeds = [int(s) for s in str(args.seeds or "0").split(",") if s.strip()]
    model = args.model or "minilm-l6"
    seq_len = args.seq_len or 128
    batch_size = args.batch_size or 32
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"e2e-{slug(model)}"
    device = resolve_device(args.device)
    result: dict[str, Any] = {
        "kind": "e2e",
        "environment": environment(device),
        "settings": {"model": model, "tasks": tasks, "methods": methods, "targets": targets, "rank": args.rank,
                     "seeds": seeds, "epochs": args.epochs, "batch_size": batch_size, "max_length": seq_len,
                     "max_train_samples": args.max_train_samples, "max_eval_samples": args.max_eval_samples,
                     "lr": args.lr},
        "setups": {"dynamic": "peftlab default: dynamic padding, length-grouped batches, cached tokenisation",
                   "pad_to_max": f"the papers' setup: every batch padded to T={seq_len} (--pad-to-max)"},
        "runs": [],
        "summary": [],
    }
    for task in tasks:
        for method in methods:
            for i, seed in enumerate(seeds):
                # alternate which setup goes first, so machine drift does not always favour one of them
                order = SETUPS if i % 2 == 0 else tuple(reversed(SETUPS))
                for setup, pad in order:
                    overrides = dict(task=task, model=model, method=method, targets=targets, rank=args.rank,
                                     epochs=args.epochs, batch_size=batch_size, max_length=seq_len, pad_to_max=pad,
                                     seed=seed, max_train_samples=args.max_train_samples,
                                     max_eval_samples=args.max_eval_samples, overwrite=True,
                                     output_dir=str(out_dir / "e2e-runs" / f"{task}-{method}-{setup}-seed{seed}"),
                                     data_dir=args.data_dir, log_every=10**6,
                                     mixed_precision=getattr(args, "mixed_precision", None)
                                     or ("auto" if device.type == "cuda" else "no"))
                    if args.lr is not None:
                        overrides["lr"] = args.lr
                    cfg = build_config(TrainConfig, overrides=overrides)
                    say(f"e2e {task} {method} seed {seed}: {setup}")
                    start, cpu_start = time.perf_counter(), time.process_time()
                    res = train(cfg)
                    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
                    epochs_log = res.get("epochs_log") or []
                    metric = res["primary_metric"]
                    result["runs"].append({
                        "task": task, "method": method, "seed": seed, "setup": setup, "pad_to_max": pad,
                        "status": res["status"], "primary_metric": metric,
                        "final_metric": res["final"]["metrics"].get(metric),
                        "final_metrics": res["final"]["metrics"],
                        "train_seconds": res["train_seconds"],
                        "train_seconds_per_epoch": res["train_seconds"] / max(1, len(epochs_log)),
                        "wall_seconds": wall,
                        "wall_seconds_per_epoch": wall / max(1, len(epochs_log)),
                        # CPU time of this process: hardly moved by other jobs on a shared machine
                        "cpu_seconds": cpu,
                        "cpu_seconds_per_epoch": cpu / max(1, len(epochs_log)),
                        "train_examples": res["train_examples"],
                        "train_examples_per_second": res["train_examples_per_second"],
                        "output_dir": cfg.output_dir,
                    })
                    if setup == "dynamic" and i == 0:
                        result.setdefault("padding", {})[task] = _padding_stats(cfg)
                    _save_e2e(result, out_dir, name)
            result["summary"].append(e2e_summary(result["runs"], task, method))
            _save_e2e(result, out_dir, name)
    result["environment"]["loadavg_end"] = loadavg()
    _save_e2e(result, out_dir, name)
    return result


def e2e_summary(runs: list[dict], task: str, method: str) -> dict[str, Any]:
    def pick(setup, key):
        return [r[key] for r in runs if r["task"] == task and r["method"] == method and r["setup"] == setup
                and r.get(key) is not None]

    out: dict[str, Any] = {"task": task, "method": method}
    for setup, _ in SETUPS:
        per_epoch, metric, wall = pick(setup, "train_seconds_per_epoch"), pick(setup, "final_metric"), pick(
            setup, "wall_seconds_per_epoch")
        out[setup] = {
            "train_seconds_per_epoch": statistics.median(per_epoch) if per_epoch else None,
            "wall_seconds_per_epoch": statistics.median(wall) if wall else None,
            "metric_mean": statistics.mean(metric) if metric else None,
            "metric_std": statistics.stdev(metric) if len(metric) > 1 else None,
            "metrics": metric,
        }
    dyn, pad = out["dynamic"], out["pad_to_max"]
    # per-seed paired speed-ups (the two runs of a seed ran back to back)
    mine = [r for r in runs if r["task"] == task and r["method"] == method]
    by_seed = {seed: {r["setup"]: r for r in mine if r["seed"] == seed} for seed in sorted({r["seed"] for r in mine})}
    for name, key in (("train", "train_seconds_per_epoch"), ("cpu", "cpu_seconds")):
        paired = [by["pad_to_max"][key] / by["dynamic"][key] for by in by_seed.values()
                  if by.get("dynamic", {}).get(key) and by.get("pad_to_max", {}).get(key) is not None]
        out[f"speedup_{name}"] = statistics.median(paired) if paired else None
        out[f"speedup_{name}_per_seed"] = paired
    if dyn["wall_seconds_per_epoch"] and pad["wall_seconds_per_epoch"]:
        out["speedup_wall"] = pad["wall_seconds_per_epoch"] / dyn["wall_seconds_per_epoch"]
    if dyn["metric_mean"] is not None and pad["metric_mean"] is not None:
        out["metric_difference"] = dyn["metric_mean"] - pad["metric_mean"]
    return out


def _save_e2e(result: dict, out_dir: Path, name: str) -> None:
    write_result(result, out_dir, name, markdown_e2e)
