"""``peftlab bench --e2e --against trainer``: peftlab side by side with ``transformers.Trainer`` on the same work.

Setups (``--setups``, default all three): ``pad128`` (Trainer, every example padded to T as the papers'
pipelines), ``grouped`` (Trainer's best: length-grouped sampling and ``DataCollatorWithPadding``) and
``peftlab`` (``peftlab train``: dynamic padding, length-grouped batches); what each runs is in
:mod:`peftlab.bench.trainer_worker`. Same model, LoRA on q, v, rank, batch, T, training subset, epochs, optimizer
groups and schedule, precision (``--mixed-precision``) and thread count on every side; the dev metric on the
full dev set.

Every run is its own subprocess (its peak RSS is its own, nothing is warm from an earlier run). Repeat r of a
task visits the setups in an order rotated by r (:func:`peftlab.bench.timing.rotated`), so slow drift of a
shared machine hits every setup alike; the speed-ups are per-repeat paired ratios of train time (= peftlab's
examples/s over Trainer's: both see the same examples) and their geometric mean over repeats.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from peftlab.bench.machine import environment, loadavg, write_result
from peftlab.bench.render import markdown_against_trainer, slug
from peftlab.bench.timing import paired_geomean, rotated
from peftlab.bench.trainer_worker import PEFTLAB_SETUP, TRAINER_SETUPS
from peftlab.errors import PeftlabError
from peftlab.io_utils import atomic_write_text

SETUPS = (*TRAINER_SETUPS, PEFTLAB_SETUP)
DEFAULT_TASKS = "rte,mrpc"
DEFAULT_REPEATS = 2
DEFAULT_TRAIN_EXAMPLES = 1000
SETUP_TEXT = {
    "pad128": "transformers.Trainer, tokenised with padding=\"max_length\" (every example T tokens), random batches "
              "(the papers' pipelines)",
    "grouped": "transformers.Trainer with train_sampling_strategy=\"group_by_length\" (group_by_length=True) and "
               "DataCollatorWithPadding (Trainer's best)",
    "peftlab": "peftlab train: dynamic padding, length-grouped batches, cached tokenisation (--pooling native)",
}


def _choices(text: str | None, default: str, allowed, what: str, flag: str) -> list[str]:
    from peftlab.errors import unknown

    names = [t.strip().lower() for t in (text or default).split(",") if t.strip()]
    for name in names:
        if name not in allowed:
            raise unknown(what, name, list(allowed), where=flag)
    if not names:
        raise PeftlabError(f"{flag} is empty", fix=f"e.g. {flag} {default}")
    return list(dict.fromkeys(names))


def settings_from_args(args) -> dict[str, Any]:
    from peftlab.methods.table import METHODS
    from peftlab.tasks.table import TASKS

    tasks = _choices(args.task, DEFAULT_TASKS, [n for n, t in TASKS.items() if t.kind in ("classification",
                                                                                             "regression")],
                     "GLUE task", "--tasks")
    lora = METHODS["lora"]
    threads = args.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    seeds = [int(s) for s in str(args.seeds or "0").split(",") if s.strip()]
    return {
        "model": args.model or "minilm-l6", "tasks": tasks,
        "setups": _choices(args.setups, ",".join(SETUPS), SETUPS, "setup", "--setups"),
        "repeats": args.repeats or DEFAULT_REPEATS, "seeds": seeds, "threads": int(threads),
        "train_examples": args.max_train_samples or DEFAULT_TRAIN_EXAMPLES, "epochs": args.epochs,
        "max_length": args.seq_len or 128, "batch_size": args.batch_size or 32, "eval_batch_size": 64,
        "rank": args.rank, "alpha": args.alpha, "dropout": 0.0, "lr": args.lr or lora.default_lr,
        "lr_ratio": args.lr_ratio, "head_lr": lora.default_head_lr, "warmup_ratio": 0.06, "max_grad_norm": 1.0,
        "mixed_precision": args.mixed_precision or "no", "data_dir": args.data_dir,
        "eval": "the full dev set (validation split)",
    }


def _run_child(spec: dict, work: Path, label: str) -> dict[str, Any]:
    """One setup in a fresh ``python -m peftlab.bench.trainer_worker``; its output goes to ``<label>.log``."""
    spec_path, out_path, log_path = work / f"{label}.spec.json", work / f"{label}.json", work / f"{label}.log"
    atomic_write_text(spec_path, json.dumps(spec, indent=2))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "MKL_NUM_THREADS": str(spec["threads"]),
           "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, "-m", "peftlab.bench.trainer_worker", str(spec_path), str(out_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not out_path.is_file():
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
        return {"status": "failed", "error": f"exit {proc.returncode}: {lines[-1][:300] if lines else ''}",
                "process_wall_s": wall, "log": str(log_path)}
    result = json.loads(out_path.read_text())
    result.update(process_wall_s=wall, log=str(log_path))
    return result


def run_against_trainer(args) -> dict[str, Any]:
    import torch

    say = (lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)) if not args.quiet else (lambda m: None)
    settings = settings_from_args(args)
    out_dir = Path(args.out_dir)
    work = out_dir / "against-trainer-runs"
    work.mkdir(parents=True, exist_ok=True)
    name = args.name or f"against-trainer-{slug(settings['model'])}"
    result: dict[str, Any] = {"kind": "against_trainer", "environment": environment(torch.device("cpu")),
                              "settings": settings, "setups": {s: SETUP_TEXT[s] for s in settings["setups"]},
                              "runs": [], "summary": []}
    result["environment"]["torch_threads"] = settings["threads"]  # what every run was given
    keys = ("model", "train_examples", "epochs", "max_length", "batch_size", "eval_batch_size", "rank", "alpha",
            "dropout", "lr", "lr_ratio", "head_lr", "warmup_ratio", "max_grad_norm", "mixed_precision", "data_dir",
            "threads")
    for task in settings["tasks"]:
        for repeat in range(settings["repeats"]):
            seed = settings["seeds"][repeat % len(settings["seeds"])]
            for setup in rotated(settings["setups"], repeat):
                label = f"{task}-{setup}-r{repeat}"
                spec = {**{k: settings[k] for k in keys}, "task": task, "setup": setup, "seed": seed,
                        "run_dir": str(work / label),
                        "logging_steps": max(1, settings["train_examples"] // settings["batch_size"] // 8)}
                say(f"against trainer: {task} repeat {repeat + 1}/{settings['repeats']} (seed {seed}): {setup}")
                run = _run_child(spec, work, label)
                run.update(task=task, setup=setup, repeat=repeat, seed=seed, epochs=settings["epochs"])
                if run["status"] == "failed":
                    say(f"{label} failed: {run['error']} (log {run['log']})")
                result["runs"].append(run)
                save(result, out_dir, name)
        result["summary"].append(summarize_task(result["runs"], task, settings["setups"]))
        save(result, out_dir, name)
    result["environment"]["loadavg_end"] = loadavg()
    save(result, out_dir, name)
    return result


def _median(values):
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def summarize_task(runs: list[dict], task: str, setups: list[str]) -> dict[str, Any]:
    """Per setup: medians over repeats (train s/epoch, ex/s, peak RSS), the dev metric's mean ± sd; and
    peftlab / each Trainer setup: the geometric mean of per-repeat train-time ratios (= ex/s ratios)."""
    from peftlab.tasks.table import TASKS

    metric = TASKS[task].primary_metric
    ok = [r for r in runs if r["task"] == task and r.get("status") in ("ok", "collapsed", "no_learning")]
    out: dict[str, Any] = {"task": task, "metric": metric, "setups": {}, "peftlab_vs": {}}
    for setup in setups:
        mine = [r for r in ok if r["setup"] == setup]
        values = [r["dev_metrics"].get(metric) for r in mine if r["dev_metrics"].get(metric) is not None]
        per_epoch = [r["train_s"] / max(1, r["epochs"]) for r in mine]
        slots = _median([r.get("train_token_slots") for r in mine])
        real = _median([r.get("train_real_tokens") for r in mine])
        out["setups"][setup] = {
            "runs": len(mine), "train_s_per_epoch": _median(per_epoch),
            "examples_per_s": _median([r.get("examples_per_s") for r in mine]),
            "peak_rss_mb": _median([r.get("peak_rss_mb") for r in mine]),
            "process_wall_s": _median([r.get("process_wall_s") for r in mine]),
            "metric_mean": statistics.fmean(values) if values else None,
            "metric_std": statistics.stdev(values) if len(values) > 1 else None,
            "token_slots": slots, "real_token_share": real / slots if slots and real is not None else None,
        }
    if PEFTLAB_SETUP in setups:
        by_repeat = {}
        for r in ok:
            by_repeat.setdefault(r["repeat"], {})[r["setup"]] = r
        complete = [by for by in by_repeat.values() if PEFTLAB_SETUP in by]
        for setup in setups:
            if setup == PEFTLAB_SETUP:
                continue
            pairs = [by for by in complete if setup in by]
            train = paired_geomean([by[setup]["train_s"] for by in pairs], [by[PEFTLAB_SETUP]["train_s"] for by in pairs])
            wall = paired_geomean([by[setup]["process_wall_s"] for by in pairs],
                                  [by[PEFTLAB_SETUP]["process_wall_s"] for by in pairs])
            out["peftlab_vs"][setup] = {"examples_per_s_ratio": train, "process_wall_ratio": wall}
    return out


def save(result: dict, out_dir: Path, name: str) -> None:
    write_result(result, out_dir, name, markdown_against_trainer)


def rerender(result: dict) -> str:
    result["summary"] = [summarize_task(result["runs"], task, result["settings"]["setups"])
                         for task in result["settings"]["tasks"]]
    return markdown_against_trainer(result)

