"""``peftlab plot --kind sigma``: what training did to KaSA's Delta_sigma per layer and projection (KaSA Fig. 4).

Each run contributes ``kasa_sigma - kasa_sigma_init`` (the random init would otherwise dominate), averaged over
the seeds; runs of an older peftlab without ``kasa_sigma_init`` are refused. Module names come from the records,
never from model code.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.lab.figures.paper import (
    Drawn,
    hide_unused,
    colorbar,
    config_label,
    panel_grid,
    panel_title,
    split_by_config,
    suptitle,
    wrap,
)
from peftlab.lab.records import NON_RESULT_KEYS, RunRecord, task_determined_keys, task_order
from peftlab.tasks.table import task_title

_PROJ_NAMES = {"query": "q", "q_proj": "q", "q_lin": "q", "q": "q", "key": "k", "k_proj": "k", "k_lin": "k",
               "k": "k", "value": "v", "v_proj": "v", "v_lin": "v", "v": "v", "o_proj": "o", "out_proj": "o",
               "out_lin": "o", "o": "o", "c_attn": "qkv", "c_proj": "o"}


def parse_module(name: str) -> tuple[int | None, str]:
    """``bert.encoder.layer.3.attention.self.value`` -> ``(3, "v")``."""
    found = re.search(r"(?:^|\.)(?:layer|layers|h|block|blocks)\.(\d+)(?:\.|$)", name) or re.search(r"\.(\d+)\.", name)
    layer = int(found.group(1)) if found else None
    last = name.rsplit(".", 1)[-1]
    if last == "dense" and ".attention.output" in f".{name}":
        return layer, "o"
    return layer, _PROJ_NAMES.get(last, last)


SIGMA_DELTA = "learned change of Δσ (kasa_sigma − kasa_sigma_init)"
NO_INIT_FIX = ("re-run them with this peftlab (result.json records kasa_sigma_init since it), or leave them out "
               "with --where")


def _module_name(name: str) -> str:
    return name.removeprefix("base_model.model.")


def sigma_change(result: dict) -> dict[str, list[float]] | None:
    """``kasa_sigma - kasa_sigma_init`` per module (what training changed), or None when the run did not record
    the values at initialisation (result.json of an older peftlab) or they do not match module for module."""
    sigma = result.get("kasa_sigma") or {}
    init = {_module_name(k): v for k, v in (result.get("kasa_sigma_init") or {}).items()}
    out = {}
    for module, values in sigma.items():
        start = init.get(_module_name(module))
        if start is None or len(start) != len(values):
            return None
        out[module] = [float(v) - float(s) for v, s in zip(values, start)]
    return out or None


def _proj_order(proj: str):
    known = ("q", "k", "v", "o", "qkv")
    return (known.index(proj), "") if proj in known else (len(known), proj)


@dataclass
class SigmaPanel:
    row: int
    col: int
    task: str
    subtitle: str
    projection: str
    layers: list[int]
    matrix: Any  # (len(layers), rank): mean over the runs of kasa_sigma - kasa_sigma_init
    runs: int


@dataclass
class SigmaData:
    panels: list[SigmaPanel]
    n_rows: int
    n_cols: int
    limit: float  # the symmetric colour limit shared by every panel
    init_size: float  # mean |kasa_sigma_init| over the runs: what the change is small or large against


def sigma_data(records: list[RunRecord]) -> SigmaData:
    import numpy as np

    runs = [r for r in records if r.result and r.result.get("kasa_sigma")]
    if not runs:
        methods = sorted({str(r.config.get("method")) for r in records})
        raise PeftlabError("no run in the selection has kasa_sigma (KaSA's learned singular values)",
                           fix=f"select KaSA runs (--where method=kasa); the selection has {', '.join(methods)}")
    changes = {id(r): sigma_change(r.result) for r in runs}
    lacking = [r for r in runs if changes[id(r)] is None]
    if lacking:
        shown = ", ".join(f"{r.task} seed {r.seed}" for r in lacking[:4]) + (" ..." if len(lacking) > 4 else "")
        raise PeftlabError(f"{len(lacking)} of {len(runs)} selected KaSA runs lack kasa_sigma_init ({shown}): "
                           "their learned change cannot be told from the initialisation", fix=NO_INIT_FIX)
    drop = (set(NON_RESULT_KEYS) | set(task_determined_keys(runs))) - {"task"}
    groups, configs, varying = split_by_config(runs, drop)
    varying = [k for k in varying if k != "task"]
    rows = sorted(configs, key=lambda g: (task_order([configs[g]["task"]])[0], config_label(configs[g], varying)))
    projections = sorted({parse_module(m)[1] for r in runs for m in r.result["kasa_sigma"]}, key=_proj_order)
    panels = []
    for i, gkey in enumerate(rows):
        recs = groups[gkey]
        for j, proj in enumerate(projections):
            per_layer: dict[int, list[list[float]]] = defaultdict(list)
            for rec in recs:
                for module, values in changes[id(rec)].items():
                    layer, p = parse_module(module)
                    if p == proj:
                        per_layer[layer if layer is not None else 0].append(values)
            if not per_layer:
                continue
            layers = sorted(per_layer)
            n = max(len(v) for vals in per_layer.values() for v in vals)
            matrix = np.full((len(layers), n), np.nan)
            for li, layer in enumerate(layers):
                vals = [v + [math.nan] * (n - len(v)) for v in per_layer[layer]]
                matrix[li] = np.nanmean(np.array(vals, dtype=float), axis=0)
            panels.append(SigmaPanel(i, j, configs[gkey]["task"],
                                     config_label(configs[gkey], varying) if varying else "", proj, layers, matrix,
                                     len(recs)))
    peaks = [float(np.nanmax(np.abs(p.matrix))) for p in panels if np.isfinite(p.matrix).any()]
    init = [abs(float(v)) for r in runs for vals in r.result["kasa_sigma_init"].values() for v in vals]
    return SigmaData(panels, len(rows), len(projections), max(peaks, default=0.0) or 1.0,
                     statistics.fmean(init) if init else math.nan)


def plot_sigma(records: list[RunRecord], *, title: str | None = None) -> Drawn:
    """KaSA Figure 4: Δσ's change per layer (rows) and singular value (columns), one colour scale about 0."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    data = sigma_data(records)
    width, height = 2.9, 2.4
    _, fig, axes = panel_grid(data.n_rows, data.n_cols, width=width, height=height)
    used, images = set(), []
    for p in data.panels:
        ax = axes[p.row][p.col]
        used.add((p.row, p.col))
        image = ax.imshow(p.matrix, origin="lower", cmap="RdBu_r", vmin=-data.limit, vmax=data.limit,
                          aspect="auto", interpolation="nearest")
        images.append((ax, image))
        step = max(1, math.ceil(len(p.layers) / 12))
        ax.set_yticks(range(0, len(p.layers), step), [str(p.layers[k]) for k in range(0, len(p.layers), step)])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(round(v)) + 1}"))
        ax.set_xlabel("singular value index i")
        ax.set_ylabel("layer")
        panel_title(ax, f"{task_title(p.task)} · $W_{{{p.projection}}}$ · mean of {p.runs} run(s)"
                    + (f"\n{p.subtitle}" if p.subtitle else ""), width)
    hide_unused(axes, used)
    bar = colorbar(fig, images[0][1], [ax for ax, _ in images], width, height)
    bar.set_label(wrap(SIGMA_DELTA, 0.8 * height * data.n_rows, 8), fontsize=8)
    suptitle(fig, title or f"KaSA: {SIGMA_DELTA} per layer and projection, mean over seeds; largest |change| "
                           f"{data.limit:.3g} against a mean |Δσ_init| of {data.init_size:.3g}")
    return Drawn(fig, data)
