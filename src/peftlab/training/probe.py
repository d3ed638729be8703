"""``peftlab probe``: the loss curvature of the run a config describes, per optimizer group, before training.

The run is built as ``peftlab train`` would, in fp32 and eager. On each of its first ``batches`` training batches
the top Hessian eigenvalue of its objective is measured per block (:mod:`peftlab.training.curvature`): one per
optimizer group, a ``<group>:vectors`` block for an adapted group's vectors, and ``all``; at init and, with
``adam_steps``, after that many of the run's own steps, raw and Adam-preconditioned (Cohen et al. 2022). The
suggested rate is ``RULE[kind] / lambda_max``, its constants fitted on the committed lambda grids (``python
scripts/probe_check.py``), which also found that the rule does not predict them (:data:`VERDICT`)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from peftlab.config import TrainConfig
from peftlab.errors import PeftlabError
from peftlab.resolve import resolve_config
from peftlab.training.curvature import Solve, require_extra, top_eigenvalues
from peftlab.training.setup import build_seeded
from peftlab.training.step import objective as step_objective

PROBE_SCHEMA = 1
KIND_LABELS = {"raw_init": "raw Hessian at init", "raw_after_adam": "raw Hessian after the Adam steps",
               "preconditioned": "Adam-preconditioned Hessian after the Adam steps"}
# rate = c / lambda_max per kind of curvature: c fitted on docs/study/lambda/results.sqlite (LoRA {q,v},
# MiniLM-L6, SST-2 and STS-B) by `python scripts/probe_check.py` (least squares in log rate over both tasks
# and both blocks: the best cell's eta_QK for q, its eta_V for v). See docs/RESULTS.md before trusting it.
RULE: dict[str, float | None] = {"raw_init": 5.33e-4, "raw_after_adam": 1.96e-3, "preconditioned": 22.9}
RULE_SOURCE = "docs/study/lambda/results.sqlite: LoRA {q,v}, MiniLM-L6, SST-2 and STS-B, 2 epochs of 500 examples"
# What the validation found (docs/RESULTS.md, "Choosing lambda without a grid: the curvature probe"): printed under
# every table, so that no suggestion is read without it.
VERDICT = ("it does not predict lambda on the committed grids (raw curvature: V sharper than Q, lambda 0.14-0.46, "
           "below the grid; preconditioned: 0.61, below, and 0.99, inside a best region spanning the whole grid), "
           "and c moved 3.7x between the two tasks: a diagnostic, not a rate to trust")


@dataclass(frozen=True)
class ProbeOptions:
    """What the probe measures, beside the run's own config."""

    batches: int = 3  # training batches, each its own Hessian (their spread is reported)
    adam_steps: int = 0  # the run's first training steps before the second measurement (0: init only)
    tol: float = 2e-2  # eigsh's relative tolerance (on the residual: the eigenvalue's error is far smaller)
    ncv: int = 8  # eigsh's Lanczos vectors (MiniLM-L6's blocks converge in ~9 products per batch)


@dataclass(frozen=True)
class Block:
    """A set of trainable tensors whose Hessian sub-matrix is measured."""

    name: str
    members: tuple[int, ...]  # indices into the probe's parameter list
    param_names: tuple[str, ...]
    numel: int


def probe_blocks(groups: list[dict]) -> tuple[list, list[Block]]:
    """(parameters, blocks) from the optimizer's groups (``param_groups``' dicts, decay halves apart): a block per
    group name, a ``:vectors`` block per adapted projection that has both halves, and ``all``."""
    params, names, by_name = [], [], {}
    for group in groups:
        for name, param in zip(group["param_names"], group["params"]):
            by_name.setdefault(group["name"], []).append(len(params))
            params.append(param)
            names.append(name)
    blocks = []
    for group, members in by_name.items():
        blocks.append(_block(group, members, params, names))
        vectors = [m for m in members if params[m].dim() < 2]  # param_groups' no-decay half: by rank
        if group not in ("head", "other") and vectors and len(vectors) < len(members):
            blocks.append(_block(f"{group}:vectors", vectors, params, names))
    blocks.append(_block("all", range(len(params)), params, names))
    return params, blocks


def _block(name: str, members, params: list, names: list[str]) -> Block:
    members = tuple(members)
    return Block(name, members, tuple(names[i] for i in members), sum(params[i].numel() for i in members))


def adam_scale(optimizer, params: list) -> torch.Tensor:
    """P^-1/2 flat over ``params``, with P = sqrt(v_hat) + eps Adam's denominator (bias-corrected)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    per_param = optimizer.state  # Adam's moments by parameter (not the loop's state)
    parts = []
    for param in params:
        moments, group = per_param.get(param, {}), group_of[id(param)]
        if "exp_avg_sq" not in moments:
            raise PeftlabError("a trainable tensor has no Adam state after the warm-up steps",
                               fix="give --probe-adam-steps >= 1 (and --grad-accum steps per optimizer step)")
        beta2, step = group["betas"][1], float(moments["step"])
        v_hat = moments["exp_avg_sq"].detach().float() / (1 - beta2 ** step)
        parts.append((v_hat.sqrt() + group["eps"]).rsqrt().flatten().cpu())
    return torch.cat(parts)


def measure(model, objective, params: list, blocks: list[Block], batches: list, options: ProbeOptions,
            scale: torch.Tensor | None = None, kinds: tuple[str, ...] = ("raw",)) -> dict[str, list[list[Solve]]]:
    """{kind: [batch][block] Solve} for kind "raw" and, with ``scale``, "preconditioned"; both kinds of a
    batch are solved side by side on one operator."""
    members = [list(b.members) for b in blocks]
    plan = [(kind, i) for kind in kinds for i in range(len(blocks))]
    scales = [scale if kind == "preconditioned" else None for kind, _ in plan]
    model.eval()  # no dropout: the Hessian of a deterministic function
    out: dict[str, list[list[Solve]]] = {kind: [] for kind in kinds}
    for batch in batches:
        solves = top_eigenvalues(model, objective, params, [members[i] for _, i in plan], batch, scales=scales,
                                 tol=options.tol, ncv=options.ncv)
        for kind in kinds:
            out[kind].append([s for (k, _), s in zip(plan, solves) if k == kind])
    return out


def warm_up(run, steps: int) -> list[float]:
    """The run's first ``steps`` optimizer steps (its rate, schedule and clipping); their losses."""
    from peftlab.training.step import train_step

    trainable = [p for p in run.model.parameters() if p.requires_grad]
    run.model.train()
    losses: list[float] = []
    while run.state.optimizer_steps < steps:
        for batch in run.train_loader:
            result = train_step(run, batch, trainable)
            if result is None:
                raise PeftlabError(f"the run diverged during the probe's Adam steps: {run.state.status_reason}",
                                   fix="lower --lr / --lr-ratio, or probe at init only (--probe-adam-steps 0)")
            losses.append(result.loss)
            run.state.count_batch(result)
            if run.state.optimizer_steps >= steps:
                break
        run.sampler.epoch += 1
    return losses


def summary(values: list[float]) -> dict | None:
    """mean, std, min, max over the batches whose eigsh converged (None when none did)."""
    arr = np.asarray([v for v in values if np.isfinite(v)], dtype=float)
    if not len(arr):
        return None
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
            "min": float(arr.min()), "max": float(arr.max()), "per_batch": [float(v) for v in arr]}


def block_results(blocks: list[Block], solves: list[list[Solve]], kind: str, beta1: float = 0.9) -> dict:
    """Per block: lambda_max over the batches, 2/lambda_max (gradient descent's stable rate), the suggested rate,
    eigsh's work; for the preconditioned kind also Adam's edge of stability (2 + 2 beta1) / ((1 - beta1)
    lambda_max) (Cohen et al. 2022: 38 / lambda_max at beta1 = 0.9)."""
    out = {}
    for j, block in enumerate(blocks):
        per_batch = [batch[j] for batch in solves]
        spread = summary([s.value for s in per_batch])
        lam, c = (spread or {}).get("mean"), RULE.get(kind)
        positive = lam is not None and lam > 0
        out[block.name] = {"lambda_max": spread, "stable_rate": 2 / lam if positive else None,
                           "suggested_rate": c / lam if c is not None and positive else None,
                           "matvecs": sum(s.matvecs for s in per_batch),
                           "converged": sum(s.converged for s in per_batch), "batches": len(per_batch)}
        if kind == "preconditioned":
            out[block.name]["adam_edge_rate"] = (2 + 2 * beta1) / ((1 - beta1) * lam) if positive else None
    return out


def suggested_lambda(results: dict) -> float | None:
    """rate(v) / rate(q) = lambda_max(q) / lambda_max(v) under any rule c / lambda_max."""
    q, v = ((results.get(name) or {}).get("lambda_max") or {} for name in ("q", "v"))
    if not q or not v or q["mean"] <= 0 or v["mean"] <= 0:
        return None
    return q["mean"] / v["mean"]


def probe_config(cfg: TrainConfig) -> TrainConfig:
    """The run the probe measures: ``cfg`` in fp32 and eager (no --compile), resolved once. Resolving reads
    neither option (setup decides precision and compilation from them), so the copy of a resolved config (the
    CLI's) is resolved as it stands; an unresolved one (from Python) is resolved here."""
    variant = dataclasses.replace(cfg, mixed_precision="no", compile="off")
    return variant.mark_resolved() if cfg.resolved else resolve_config(variant)


def probe(cfg: TrainConfig, options: ProbeOptions) -> dict:
    """Measure the run ``cfg`` describes; the dict :mod:`peftlab.training.probe_cli` prints and writes."""
    require_extra()
    start, cpu_start = time.perf_counter(), time.process_time()
    seconds = {}
    run = build_seeded(probe_config(cfg))[1]  # the run `peftlab train` would set up, without its folder
    seconds["setup_s"] = time.perf_counter() - start
    model = run.accelerator.unwrap_model(run.model)
    params, blocks = probe_blocks(run.groups)
    def objective(model, batch):  # the loss a step of the run minimises, KaSA's regulariser included
        return step_objective(model, batch, run.cfg).total

    batches = list(itertools.islice(run.train_loader, options.batches))  # its seed, its length-grouped order
    results = {"raw_init": measure(model, objective, params, blocks, batches, options)["raw"]}
    seconds["init_s"] = time.perf_counter() - start - sum(seconds.values())
    losses = []
    if options.adam_steps:
        losses = warm_up(run, options.adam_steps)
        seconds["adam_s"] = time.perf_counter() - start - sum(seconds.values())
        after = measure(model, objective, params, blocks, batches, options,
                        scale=adam_scale(run.optimizer, params), kinds=("raw", "preconditioned"))
        results.update({"raw_after_adam": after["raw"], "preconditioned": after["preconditioned"]})
        seconds["after_adam_s"] = time.perf_counter() - start - sum(seconds.values())
    beta1 = run.optimizer.param_groups[0]["betas"][0]
    kinds = {kind: block_results(blocks, solves, kind, beta1) for kind, solves in results.items()}
    return {
        "schema_version": PROBE_SCHEMA, "config": run.cfg.to_dict(), "options": dataclasses.asdict(options),
        "batch_examples": [int(b["input_ids"].shape[0]) if "input_ids" in b else None for b in batches],
        "groups": [{"name": g["name"], "weight_decay": g["weight_decay"], "lr": g["lr"],
                    "param_names": list(g["param_names"])} for g in run.groups],
        "blocks": [{"name": b.name, "numel": b.numel, "tensors": list(b.param_names)} for b in blocks],
        "adam_losses": losses,
        "kinds": kinds,
        "suggested_lambda": {kind: suggested_lambda(res) for kind, res in kinds.items()},
        "rule": {"form": "rate = c / lambda_max", "c": dict(RULE), "fitted_on": RULE_SOURCE},
        "wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start, "phases_s": seconds,
        "load_average": list(os.getloadavg()), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
    }
