"""``peftlab plot --kind sigma``: what training did to KaSA's Delta_sigma per layer and projection (KaSA Fig. 4).

Each run contributes ``kasa_sigma - kasa_sigma_init`` (the random init would otherwise dominate), averaged over
the seeds; runs of an older peftlab without ``kasa_sigma_init`` are refused. Module names come from the records,
never from model code.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.lab.figures.paper import (
    Drawn, config_label, fixed_keys, panel_grid, panel_title, split_by_config, suptitle, wrap)
from peftlab.lab.records import RunRecord, task_order
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
    import pandas as pd

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
    groups, configs, varying = split_by_config(runs, fixed_keys(runs) - {"task"})
    varying = [k for k in varying if k != "task"]
    rows = sorted(configs, key=lambda g: (task_order([configs[g]["task"]])[0], config_label(configs[g], varying)))

    entries = [(row, *parse_module(module), i, v) for row, gkey in enumerate(rows) for rec in groups[gkey]
               for module, values in changes[id(rec)].items() for i, v in enumerate(values)]
    table = pd.DataFrame(entries, columns=["row", "layer", "proj", "i", "change"])
    table = table.fillna({"layer": 0}).astype({"layer": int})  # a module without a layer number: layer 0
    projections = sorted(table["proj"].unique(), key=_proj_order)
    panels = []
    for (row, proj), part in table.groupby(["row", "proj"]):
        matrix = part.groupby(["layer", "i"])["change"].mean().unstack()  # the runs' mean, NaN past a rank
        config = configs[rows[row]]
        panels.append(SigmaPanel(row, projections.index(proj), config["task"],
                                 config_label(config, varying) if varying else "", proj, list(matrix.index),
                                 matrix.to_numpy(), len(groups[rows[row]])))
    panels.sort(key=lambda p: (p.row, p.col))
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
    used = [axes[p.row][p.col] for p in data.panels]
    for ax, p in zip(used, data.panels):
        image = ax.imshow(p.matrix, origin="lower", cmap="RdBu_r", vmin=-data.limit, vmax=data.limit,
                          aspect="auto", interpolation="nearest")
        ticks = range(0, len(p.layers), max(1, math.ceil(len(p.layers) / 12)))
        ax.set_yticks(ticks, [str(p.layers[k]) for k in ticks])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(round(v)) + 1}"))
        ax.set_xlabel("singular value index i")
        ax.set_ylabel("layer")
        panel_title(ax, f"{task_title(p.task)} · $W_{{{p.projection}}}$ · mean of {p.runs} run(s)"
                    + (f"\n{p.subtitle}" if p.subtitle else ""), width)
    for ax in set(axes.flat) - set(used):
        ax.set_axis_off()
    # one colour bar about as long as the rows it spans (under constrained layout its aspect sets its length;
    # it is ~fraction x the panels' width less their tick labels thick)
    aspect = max(10.0, 0.85 * (height * data.n_rows - 0.6) / (0.05 * max(width - 0.9, 1.0)))
    bar = fig.colorbar(image, ax=used, fraction=0.05, pad=0.02, shrink=0.9, aspect=aspect)
    bar.ax.tick_params(labelsize=7)
    bar.set_label(wrap(SIGMA_DELTA, 0.8 * height * data.n_rows, 8), fontsize=8)
    suptitle(fig, title or f"KaSA: {SIGMA_DELTA} per layer and projection, mean over seeds; largest |change| "
                           f"{data.limit:.3g} against a mean |Δσ_init| of {data.init_size:.3g}")
    return Drawn(fig, data)
