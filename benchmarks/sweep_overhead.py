"""What a sweep of short runs spends outside training.

    python benchmarks/sweep_overhead.py --out-dir docs/bench

A small MiniLM sweep (default 10 runs: RTE, 200 training examples, 1 epoch, lambda in {1, 2, 4, 8, 16} x seeds
{0, 1}) is written as a spec into a temporary folder and run by the real ``peftlab sweep`` (a subprocess,
``--workers`` as given). Its wall time is split with each run's result.json ``timings``
(:mod:`peftlab.training.setup`, :mod:`~peftlab.training.fit`, :mod:`~peftlab.training.finish`):

* training: ``train_s``, the epochs' batch loops;
* per run: model load, data (files, subsets, tokenisation or its cache), adapter init, the rest of setup
  (Accelerator, optimizer, run folder), evaluation, checkpoints, result (versions, git commit), saving the
  adapter;
* outside the runs: the sweep's wall time minus the runs' own spans (``started_unix`` .. ``finished_unix``):
  process start and imports, spec expansion, the results store, log redirection, imports done before a run's
  setup.

overhead share = 1 - sum(train_s) / sweep wall time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: import `benchmarks` from the repository root, not its own folder
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.cli import main, nonnegative_int, parser, positive_int, progress
from benchmarks.machine import environment, loadavg, write_result
from benchmarks.render import markdown_sweep_overhead, slug
from peftlab.errors import PeftlabError

LAMBDAS = (1, 2, 4, 8, 16, 32, 64, 128)
SEEDS = (0, 1)
# (label, timing keys summed); "setup, other" is setup_s minus its three measured parts.
PHASES = (("model load", ("model_load_s",)), ("data + tokenisation", ("data_s",)), ("adapter init", ("init_s",)),
          ("setup, other", ("setup_other_s",)), ("evaluation", ("eval_s",)), ("checkpoints", ("checkpoint_s",)),
          ("result.json fields", ("result_s",)), ("adapter save", ("save_s",)))


def sweep_cells(runs: int) -> list[tuple[float, int]]:
    """``runs`` (lambda, seed) cells: lambda 1, 2, 4, ... each with seeds 0 and 1 (the last lambda maybe one seed)."""
    cells = [(float(lam), seed) for lam in LAMBDAS for seed in SEEDS][:runs]
    if len(cells) < runs:
        raise PeftlabError(f"--runs {runs} is more than this sweep's {len(cells)} cells",
                           fix=f"use --runs {len(cells)} or fewer")
    return cells


def sweep_spec(settings: dict, output_dir: Path) -> dict[str, Any]:
    cells = sweep_cells(settings["runs"])
    base = {"task": settings["task"], "model": settings["model"], "method": "lora", "targets": "q,v",
            "rank": settings["rank"], "epochs": settings["epochs"], "max_train_samples": settings["train_examples"],
            "mixed_precision": settings["mixed_precision"]}
    if settings["batch_size"]:
        base["batch_size"] = settings["batch_size"]
    if settings["data_dir"]:
        base["data_dir"] = settings["data_dir"]
    return {"description": "benchmarks/sweep_overhead.py", "output_dir": str(output_dir), "base": base,
            "zip": [{"lr_ratio": [lam for lam, _ in cells], "seed": [seed for _, seed in cells]}]}


def _peftlab_command() -> list[str]:
    script = Path(sys.executable).parent / "peftlab"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "peftlab.cli.main"]


def breakdown(results: list[dict], wall_s: float, sweep_start_unix: float) -> dict[str, Any]:
    """The sweep's wall time split into training, the per-run phases and what lies outside the runs."""
    sums: dict[str, float] = {}
    spans = []
    for result in results:
        t = dict(result.get("timings") or {})
        t["setup_other_s"] = max(0.0, t.get("setup_s", 0.0) - sum(t.get(k, 0.0) for k in ("model_load_s", "data_s",
                                                                                           "init_s")))
        for key, value in t.items():
            if key.endswith("_s"):
                sums[key] = sums.get(key, 0.0) + float(value)
        if t.get("started_unix") and t.get("finished_unix"):
            spans.append((t["started_unix"], t["finished_unix"]))
    train = sums.get("train_s", 0.0)
    in_runs = sum(end - start for start, end in spans)
    phases = [{"phase": "training (train_s)", "seconds": train}]
    phases += [{"phase": label, "seconds": sum(sums.get(k, 0.0) for k in keys)} for label, keys in PHASES]
    measured_in_runs = sum(p["seconds"] for p in phases)
    phases.append({"phase": "in runs, not timed (between phases, the loop's own bookkeeping)",
                   "seconds": max(0.0, in_runs - measured_in_runs)})
    first = min((s for s, _ in spans), default=None)
    last = max((e for _, e in spans), default=None)
    before = (first - sweep_start_unix) if first else None
    after = (sweep_start_unix + wall_s - last) if last else None
    phases.append({"phase": "before the first run (process start, imports, spec, store)", "seconds": before})
    phases.append({"phase": "between runs (tracker close, store, log switch, the next run's config and imports)",
                   "seconds": (wall_s - in_runs - before - after) if first else None})
    phases.append({"phase": "after the last run (tracker close, store, process exit)", "seconds": after})
    for phase in phases:
        phase["share"] = phase["seconds"] / wall_s if wall_s and phase["seconds"] is not None else None
        phase["per_run_s"] = phase["seconds"] / len(results) if results and phase["seconds"] is not None else None
    return {"runs": len(results), "wall_s": wall_s, "train_s": train, "in_runs_s": in_runs,
            "overhead_share": 1 - train / wall_s if wall_s else None, "phases": phases}


def run_sweep_overhead(args) -> dict[str, Any]:
    import torch

    say = progress(args.quiet)
    settings = {"model": args.model, "task": args.task, "runs": args.runs, "workers": args.workers,
                "train_examples": args.train_examples,
                "epochs": args.epochs, "batch_size": args.batch_size, "rank": args.rank,
                # everything else (report_to tensorboard, batch 16, checkpoints, --save best) as a sweep's default
                "mixed_precision": args.mixed_precision or "no", "data_dir": args.data_dir,
                "threads": args.torch_threads}
    sweep_cells(settings["runs"])  # refuse a bad --runs before anything is written
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = args.name or f"sweep-overhead-{slug(settings['model'])}-{settings['task']}"
    work = Path(tempfile.mkdtemp(prefix="peftlab-sweep-overhead-"))
    try:
        spec = sweep_spec(settings, work / "runs")
        import yaml

        spec_path = work / "spec.yaml"
        spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
        command = [*_peftlab_command(), "sweep", str(spec_path), "--workers", str(settings["workers"])]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        if settings["threads"]:
            env.update(OMP_NUM_THREADS=str(settings["threads"]), MKL_NUM_THREADS=str(settings["threads"]))
        say(f"sweep overhead: {settings['runs']} runs: {' '.join(command)}")
        start_unix, start = time.time(), time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - start
        results = [json.loads(p.read_text()) for p in sorted((work / "runs").glob("*/result.json"))]
        if proc.returncode != 0 or len(results) != settings["runs"]:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            raise PeftlabError(f"the sweep exited {proc.returncode} with {len(results)} of {settings['runs']} "
                               f"results: {tail[0][:300]}", where=str(work),
                               fix="see the logs in that folder (kept)")
        result = {"kind": "sweep_overhead", "environment": environment(torch.device("cpu")), "settings": settings,
                  "spec": spec, "command": " ".join(command[1:]),
                  "per_run": [{"seed": r["seed"], "lr_ratio": r["lr_ratio"], "status": r["status"],
                               "metric": r["final"]["metrics"].get(r["primary_metric"]),
                               "timings": r.get("timings")} for r in results],
                  "breakdown": breakdown(results, wall, start_unix)}
    except BaseException:
        say(f"sweep overhead: work folder kept: {work}")
        raise
    shutil.rmtree(work, ignore_errors=True)
    result["environment"]["loadavg_end"] = loadavg()
    return write_result(result, out_dir, name, markdown_sweep_overhead)


def rerender(result: dict) -> str:
    return markdown_sweep_overhead(result)


def make_parser():
    made = parser(__doc__, __file__)
    made.add_argument("--model", default="minilm-l6", help="registered model or path")
    made.add_argument("--task", default="rte", help="GLUE task")
    made.add_argument("--runs", type=positive_int, default=10, help="runs in the sweep (lambda 1, 2, 4, ... x 2 seeds)")
    made.add_argument("--workers", type=nonnegative_int, default=0,
                      help="peftlab sweep --workers (0: runs in the sweep's process)")
    made.add_argument("--train-examples", type=positive_int, default=200, help="a seeded subset of the training set")
    made.add_argument("--epochs", type=positive_int, default=1, help="epochs per run")
    made.add_argument("--batch-size", type=positive_int, default=None, help="examples per step (default: the sweep's)")
    made.add_argument("--rank", type=positive_int, default=8, help="LoRA rank")
    made.add_argument("--mixed-precision", choices=("no", "bf16"), default="no", help="every run's precision")
    made.add_argument("--data-dir", default=None, help="GLUE data root (default as in peftlab train)")
    return made


def cli_main(argv: list[str] | None = None) -> int:
    return main(make_parser(), run_sweep_overhead, argv)


if __name__ == "__main__":
    sys.exit(cli_main())
