"""The end-to-end benchmark: ``peftlab.training.loop.train`` run twice per task, method and seed, with peftlab's
default data path (dynamic padding, length-grouped batches, cached tokenisation) and with the papers' setup
(``--pad-to-max``, every batch padded to T = ``--max-length``): train seconds per epoch and the final dev metric
of each.

    python benchmarks/e2e.py --tasks cola,mrpc --model minilm-l6 --lr 2e-3 --epochs 3

Every training option is ``peftlab train``'s own flag (the same declarations: :func:`peftlab.config.
add_dataclass_flags`), with this benchmark's defaults: ``--model minilm-l6 --batch-size 32 --max-length 128 --epochs 1``,
``--mixed-precision`` auto on CUDA, no otherwise. Its own flags: ``--tasks``, ``--methods`` and ``--seeds`` (each
runs both setups) and where the results go.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repository root, not its own folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.cli import check_glue_tasks, main, names, parser, progress, seeds
from benchmarks.machine import environment, loadavg, method_list, resolve_device, write_result
from benchmarks.render import markdown_e2e, slug

SETUPS = (("dynamic", False), ("pad_to_max", True))
PER_RUN = ("task", "method", "seed", "output_dir", "pad_to_max", "overwrite")  # set by the benchmark, per run
DEFAULTS = dict(model="minilm-l6", batch_size=32, max_length=128, epochs=1, log_every=10**6)


def _padding_stats(cfg) -> dict[str, Any] | None:
    """Token slots one epoch computes under each setup (from the cached tokenisation; no model run)."""
    try:
        from peftlab.models.registry import load_tokenizer
        from peftlab.tasks import batching
        from peftlab.tasks import data_files as data

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


def run_config(args, out_dir: Path, task: str, method: str, seed: int, setup: str, pad: bool):
    """The TrainConfig of one run: the benchmark's defaults < the training flags given < this run's own cell."""
    import torch

    from peftlab.config import TrainConfig, build_config, option_names

    flags = {name: getattr(args, name) for name in option_names(TrainConfig)
             if name not in PER_RUN and getattr(args, name) is not None}
    overrides = {**DEFAULTS, "mixed_precision": "auto" if torch.cuda.is_available() else "no",
                 "task": task, "method": method, "seed": seed, "pad_to_max": pad, "overwrite": True,
                 "output_dir": str(out_dir / "e2e-runs" / f"{task}-{method}-{setup}-seed{seed}")}
    return build_config(TrainConfig, overrides=overrides, flag_values=flags)


def one_run(cfg, setup: str) -> dict[str, Any]:
    """Train ``cfg``; its record: status, final metric, train / wall / CPU seconds (per epoch too)."""
    from peftlab.training.loop import train

    start, cpu_start = time.perf_counter(), time.process_time()
    res = train(cfg)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    epochs = max(1, len(res.get("epochs_log") or []))
    metric = res["primary_metric"]
    return {
        "task": cfg.task, "method": cfg.method, "seed": cfg.seed, "setup": setup, "pad_to_max": cfg.pad_to_max,
        "status": res["status"], "primary_metric": metric, "final_metric": res["final"]["metrics"].get(metric),
        "final_metrics": res["final"]["metrics"], "train_seconds": res["train_seconds"],
        "train_seconds_per_epoch": res["train_seconds"] / epochs, "wall_seconds": wall,
        "wall_seconds_per_epoch": wall / epochs,
        "cpu_seconds": cpu,  # CPU time of this process: hardly moved by other jobs on a shared machine
        "cpu_seconds_per_epoch": cpu / epochs, "train_examples": res["train_examples"],
        "train_examples_per_second": res["train_examples_per_second"], "output_dir": cfg.output_dir,
    }


def run_e2e(args) -> dict[str, Any]:
    from peftlab.methods.table import METHODS

    say = progress(args.quiet)
    check_glue_tasks(args.tasks)
    methods = method_list(",".join(args.methods), METHODS)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    first = run_config(args, out_dir, args.tasks[0], methods[0], args.seeds[0], "dynamic", False)
    name = args.name or f"e2e-{slug(first.model)}"
    result: dict[str, Any] = {
        "kind": "e2e", "environment": environment(resolve_device("auto")),
        "settings": {"model": first.model, "tasks": args.tasks, "methods": methods, "targets": ",".join(first.targets),
                     "rank": first.rank, "seeds": args.seeds, "epochs": first.epochs, "batch_size": first.batch_size,
                     "max_length": first.max_length, "max_train_samples": first.max_train_samples,
                     "max_eval_samples": first.max_eval_samples, "lr": args.lr},
        "setups": {"dynamic": "peftlab default: dynamic padding, length-grouped batches, cached tokenisation",
                   "pad_to_max": f"the papers' setup: every batch padded to T={first.max_length} (--pad-to-max)"},
        "runs": [], "summary": [],
    }
    for task in args.tasks:
        for method in methods:
            for i, seed in enumerate(args.seeds):
                # alternate which setup goes first, so machine drift does not always favour one of them
                for setup, pad in SETUPS if i % 2 == 0 else tuple(reversed(SETUPS)):
                    cfg = run_config(args, out_dir, task, method, seed, setup, pad)
                    say(f"e2e {task} {method} seed {seed}: {setup}")
                    result["runs"].append(one_run(cfg, setup))
                    if setup == "dynamic" and i == 0:
                        result.setdefault("padding", {})[task] = _padding_stats(cfg)
                    write_result(result, out_dir, name, markdown_e2e)
            result["summary"].append(e2e_summary(result["runs"], task, method))
    result["environment"]["loadavg_end"] = loadavg()
    return write_result(result, out_dir, name, markdown_e2e)


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


def rerender(result: dict) -> str:
    """The Markdown of an e2e result, its summary recomputed from its runs."""
    for run in result["runs"]:
        if run.get("wall_seconds_per_epoch") is None and run.get("wall_seconds") is not None:
            run["wall_seconds_per_epoch"] = run["wall_seconds"] / max(1, result["settings"]["epochs"])
    pairs = dict.fromkeys((r["task"], r["method"]) for r in result["runs"])
    result["summary"] = [e2e_summary(result["runs"], task, method) for task, method in pairs]
    return markdown_e2e(result)


def make_parser():
    from peftlab.config import TrainConfig, add_dataclass_flags, option_names

    made = parser(__doc__, __file__, with_threads=False)  # --threads is peftlab train's own
    made.add_argument("--tasks", type=names, default=["cola"], help="GLUE task(s), comma list")
    made.add_argument("--methods", type=names, default=["lora"], help="method(s), comma list")
    made.add_argument("--seeds", type=seeds, default=[0], help="comma list of seeds; each runs both setups")
    training = tuple(name for name in option_names(TrainConfig) if name not in PER_RUN)
    # no default of their own: only the flags given override the benchmark's DEFAULTS
    add_dataclass_flags(made, TrainConfig, only=training, defaults=dict.fromkeys(training))
    return made


def cli_main(argv: list[str] | None = None) -> int:
    return main(make_parser(), run_e2e, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
