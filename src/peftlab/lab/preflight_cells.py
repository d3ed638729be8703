"""The cells of a sweep, a tune and a study for :mod:`peftlab.preflight`, and their preflight before any run.

Each command turns its plan into :class:`~peftlab.preflight.Cell` s, names the paths it writes, sizes the runs it
may train for disk room and names what it needs (Ray), before any store or run folder is made. ``dry_run``: the
findings are returned to be printed with the plan.
"""

from __future__ import annotations

import math
from pathlib import Path

from peftlab.errors import PeftlabError
from peftlab.io_utils import path_problem


def _cell(label: str, config: dict, *, resolved: bool = True):
    from peftlab.config import TrainConfig, normalise_keys
    from peftlab.preflight import Cell
    from peftlab.resolve import resolve_config

    if resolved:
        return Cell(label, TrainConfig.from_dict(config))
    return Cell(label, resolve_config(TrainConfig.from_dict(normalise_keys(TrainConfig, config, label or "study"))))


def _plan_needs(args) -> tuple[tuple[str, ...], list]:
    """The plan's own extras and services: Ray, and the cluster at --address within --ray-timeout."""
    from peftlab.extras import installed
    from peftlab.preflight import Service

    if getattr(args, "backend", "local") != "ray":
        return (), []
    services = []
    if args.address and installed("ray"):
        from peftlab.lab import ray_backend

        def probe() -> str:
            ray_backend.probe_address(args.address, args.ray_timeout)
            return "answered"

        services.append(Service("ray", f"--address {args.address}", probe))
    return ("ray",), services


def check_sweep(sweep, args, *, dry_run: bool = False) -> list:
    """The preflight of a sweep (``args``: its command line)."""
    from peftlab.lab.store import Store
    from peftlab.lab.store_schema import FINISHED
    from peftlab.preflight import Output

    cells = [_cell(f"run {run.index} {{{run.describe()}}}", run.config) for run in sweep.runs]
    statuses: dict[str, str] = {}
    if path_problem(sweep.store_path, kind="file", write=False) is None and sweep.store_path.is_file():
        with Store(sweep.store_path, create=False) as store:
            statuses = store.statuses()
    runs = [cell for cell, run in zip(cells, sweep.runs) if statuses.get(run.key) not in FINISHED]
    outputs = [Output(sweep.output_root, "folder", "the runs' folder (output_dir)"),
               Output(sweep.store_path, "file", "the store")]
    return _check(cells, outputs, args, runs=runs, parallel=max(1, getattr(args, "workers", 0) or 1), dry_run=dry_run)


def check_tune(tune, args, *, dry_run: bool = False) -> list:
    """The preflight of a tune: its search points (or its base), sized for the runs its budget allows."""
    from peftlab.lab.tune.spec import run_config
    from peftlab.preflight import Output

    points = tune.grid_points or [{name: p.low for name, p in tune.search.items() if p.is_range}]
    cells = []
    for point in points:
        run = run_config(tune, {**{n: p.values[0] for n, p in tune.search.items() if not p.is_range}, **point},
                         tune.base_seed)
        cells.append(_cell("point {" + " ".join(f"{k}={v}" for k, v in point.items()) + "}", run.config))
    trials = math.ceil(max(0.0, tune.search_budget) / max(1, tune.pruner.min_epochs))
    if tune.grid_size is not None:
        trials = min(trials, tune.grid_size)
    planned = max(1, trials + tune.top_k * (tune.seeds - 1) + tune.heldout_seeds)
    largest = max(cells, key=lambda cell: (cell.cfg.method == "full", str(cell.cfg.model)))
    outputs = [Output(tune.output_root, "folder", "the tune's folder (output_dir)"),
               Output(tune.store_path, "file", "the store")]
    return _check(cells, outputs, args, runs=[largest] * planned, dry_run=dry_run)


def check_study(design, root: Path, args, *, dry_run: bool = False) -> list:
    """The preflight of a study (``peftlab study``, before its first stage): its rows' first runs, sized for the
    runs its stages may train."""
    configs = [config for task in design.tasks for config in study_first_configs(design, task)]
    planned = sum(_study_runs(design, task) for task in design.tasks)
    return check_planned_study(configs, planned, root, args, dry_run=dry_run)


def check_planned_study(configs: list[dict], planned: int, root: Path, args, *, dry_run: bool = False) -> list:
    """The preflight of any study design (the fixed-rate ones in studies/ too): its distinct first ``configs``,
    their data, models and extras, its folder and store, sized for ``planned`` runs."""
    from peftlab.lab.store import STORE_NAME
    from peftlab.preflight import Output

    cells = []
    for config in configs:
        keys = " ".join(f"{k}={config[k]}" for k in ("task", "method", "lr_ratio") if k in config)
        cells.append(_cell(f"study run {{{keys}}}", config, resolved=False))
    largest = max(cells, key=lambda cell: (cell.cfg.method == "full", str(cell.cfg.model)))
    return _check(cells, [Output(root, "folder", "the study folder (--output-dir)"),
                          Output(root / STORE_NAME, "file", "the store")], args,
                  runs=[largest] * max(1, planned), parallel=max(1, getattr(args, "workers", 1) or 1), dry_run=dry_run)


def study_first_configs(design, task: str) -> list[dict]:
    """A study's distinct first runs of a task: each row's (and fixed arm's) first config."""
    from peftlab.lab import study_protocol as sp

    configs = [sp.search_configs(design, task, row, [0])[0] for row in design.rows]
    return configs + sp.heldout_configs(design, task, sp.paper_arms(design, task), design.heldout_seed_list[:1])


def _study_runs(design, task: str) -> int:
    """The most runs a task of the study may train."""
    from peftlab.lab import study_protocol as sp

    protocol = design.protocol
    points = 2 * protocol.grid_width + 1 + protocol.max_extensions
    arms = len(sp.paper_arms(design, task)) + len(design.section.controls)
    runs = len(design.rows) * (points * protocol.selection_seeds + design.heldout_seeds)
    return runs + arms * design.heldout_seeds + (design.key_seeds if design.key_ablation else 0)


def _check(cells, outputs, args, *, dry_run: bool = False, **options) -> list:
    """The preflight of ``cells`` with the plan's own needs (:func:`_plan_needs`)."""
    from peftlab import preflight

    if not cells:
        raise PeftlabError("nothing to run: the plan has no runs")
    needs, services = _plan_needs(args)
    findings = preflight.preflight(cells, outputs, needs=needs, services=services, **options)
    if not dry_run:
        preflight.raise_problems(findings)
    return findings


def print_findings(findings: list) -> int:
    """--dry-run: what the preflight found, after the plan (stdout); its problems then end the command, one line
    each on stderr, exit 2."""
    from peftlab.preflight import raise_problems, render

    print("\n".join(render(findings)))
    raise_problems(findings)
    return 0
