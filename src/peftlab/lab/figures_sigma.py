"""``peftlab plot --kind sigma``: what training did to KaSA's Delta_sigma per layer and projection (KaSA Fig. 4).

Each run contributes result.json's ``kasa_sigma - kasa_sigma_init`` (learned minus initial values; the random
init would otherwise dominate), averaged over the selected runs (seeds), one symmetric colour scale for all
panels. Runs of an older peftlab without ``kasa_sigma_init`` are drawn as Delta_sigma itself, their panel
titles saying so. Module names come from the records (``kasa_sigma``'s keys), never from model code.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.lab.figures import colorbar, config_label, panel_grid, panel_title, split_by_config, suptitle, task_title, wrap
from peftlab.lab.records import NON_RESULT_KEYS, RunRecord, task_order

_PROJ_NAMES = {"query": "q", "q_proj": "q", "q_lin": "q", "q": "q", "key": "k", "k_proj": "k", "k_lin": "k",
               "k": "k", "value": "v", "v_proj": "v", "v_lin": "v", "v": "v", "o_proj": "o", "out_proj": "o",
               "out_lin": "o", "o": "o", "c_attn": "qkv", "c_proj": "o"}


def parse_module(name: str) -> tuple[int | None, str]:
    """``bert.encoder.layer.3.attention.self.value`` -> ``(3, "v")``."""
    layer = None
    found = re.search(r"(?:^|\.)(?:layer|layers|h|block|blocks)\.(\d+)(?:\.|$)", name) or re.search(r"\.(\d+)\.", name)
    if found:
        layer = int(found.group(1))
    last = name.rsplit(".", 1)[-1]
    if last == "dense" and ".attention.output" in f".{name}":
        return layer, "o"
    return layer, _PROJ_NAMES.get(last, last)


SIGMA_DELTA = "learned change Δσ − Δσ_init"
SIGMA_NO_INIT = "(init not recorded: values include the random initialisation)"


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


def plot_sigma(records: list[RunRecord], *, title: str | None = None):
    """KaSA Figure 4: what training did to Δσ, per layer (rows) and singular value (columns), mean over seeds.

    Each run contributes ``kasa_sigma - kasa_sigma_init``; Δσ's random initialisation would otherwise dominate the
    picture (two tasks would look alike). A panel whose runs did not record ``kasa_sigma_init`` (an older store)
    shows Δσ itself and says so in its title; the colour limits are symmetric about 0 and shared by all panels of
    the same quantity, so panels compare.
    """
    import numpy as np
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    runs = [r for r in records if r.result and r.result.get("kasa_sigma")]
    if not runs:
        methods = sorted({str(r.config.get("method")) for r in records})
        raise PeftlabError("no run in the selection has kasa_sigma (KaSA's learned singular values)",
                           fix=f"select KaSA runs (--where method=kasa); the selection has {', '.join(methods)}")
    drop = set(NON_RESULT_KEYS) - {"task"}
    groups, configs, varying = split_by_config(runs, drop)
    varying = [k for k in varying if k != "task"]
    panels = sorted(configs, key=lambda g: (task_order([configs[g]["task"]])[0], config_label(configs[g], varying)))
    projections = sorted({parse_module(m)[1] for r in runs for m in r.result["kasa_sigma"]}, key=_proj_order)
    changes = {id(r): sigma_change(r.result) for r in runs}
    width, height = 4.2, 3.4
    _, fig, axes = panel_grid(len(panels), len(projections), width=width, height=height)
    matrices: dict[tuple[int, int], tuple[Any, list[int]]] = {}
    delta_panel: dict[int, bool] = {}
    notes: dict[int, str] = {}
    for i, gkey in enumerate(panels):
        recs = groups[gkey]
        with_init = [r for r in recs if changes[id(r)] is not None]
        delta_panel[i] = bool(with_init)
        if with_init:
            used = [(r, changes[id(r)]) for r in with_init]
            left_out = len(recs) - len(with_init)
            notes[i] = f"mean of {len(used)} run(s)" + (f"; {left_out} without init left out" if left_out else "")
        else:
            used = [(r, {m: [float(v) for v in vals] for m, vals in r.result["kasa_sigma"].items()}) for r in recs]
            notes[i] = f"mean of {len(used)} run(s) {SIGMA_NO_INIT}"
        for j, proj in enumerate(projections):
            per_layer: dict[int, list[list[float]]] = defaultdict(list)
            for _, per_module in used:
                for module, values in per_module.items():
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
            matrices[(i, j)] = (matrix, layers)

    def limit(delta: bool) -> float:
        peaks = [float(np.nanmax(np.abs(m))) for (i, _), (m, _) in matrices.items()
                 if delta_panel[i] == delta and np.isfinite(m).any()]
        return max(peaks, default=0.0) or 1.0

    limits = {True: limit(True), False: limit(False)}
    images: dict[bool, list] = defaultdict(list)
    for i, gkey in enumerate(panels):
        sub = config_label(configs[gkey], varying) if varying else ""
        for j, proj in enumerate(projections):
            ax = axes[i][j]
            if (i, j) not in matrices:
                ax.set_axis_off()
                continue
            matrix, layers = matrices[(i, j)]
            lim = limits[delta_panel[i]]
            image = ax.imshow(matrix, origin="lower", cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto",
                              interpolation="nearest")
            images[delta_panel[i]].append((ax, image))
            step = max(1, math.ceil(len(layers) / 12))
            ax.set_yticks(range(0, len(layers), step), [str(layers[k]) for k in range(0, len(layers), step)],
                          fontsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(round(v)) + 1}"))
            ax.tick_params(axis="x", labelsize=7)
            ax.set_xlabel("singular value index i")
            ax.set_ylabel("layer")
            panel_title(ax, f"{task_title(configs[gkey]['task'])} · {proj} · {notes[i]}" + (f"\n{sub}" if sub else ""),
                   width)
    for delta, pairs in images.items():
        label = SIGMA_DELTA if delta else f"Δσ {SIGMA_NO_INIT}"
        bar = colorbar(fig, pairs[0][1], [ax for ax, _ in pairs], width, height)
        n_rows = sum(1 for i in delta_panel if delta_panel[i] == delta)
        bar.set_label(wrap(label, 0.8 * height * n_rows, 8), fontsize=8)
    if title is None:
        title = f"KaSA: {SIGMA_DELTA} per layer and projection, mean over seeds"
        if not images.get(True):
            title = f"KaSA: Δσ per layer and projection, mean over seeds {SIGMA_NO_INIT}"
        elif images.get(False):
            title += "; panels marked 'init not recorded' show Δσ itself"
    suptitle(fig, title)
    return fig
