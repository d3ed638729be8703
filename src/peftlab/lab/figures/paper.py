"""What every ``peftlab plot`` figure shares: the paper style (fonts, a colour-blind-safe palette, embeddable
vector text), the config keys the axes may use and how their values and metrics are labelled, and the layout
helpers (panel grids, wrapped titles, legends below), and how every kind groups runs into lines or panels.

Figures are laid out at the resolution they are saved with (``DPI``); titles are wrapped to the width they
are drawn at, so nothing is cropped or overlaps (``tests/test_plot_layout.py``). Panels are sized for a paper:
two or three fit the text width at 8-pt type.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterator

from peftlab.errors import PeftlabError
from peftlab.lab.records import (NON_RESULT_KEYS, RunRecord, fmt_value, hashable, task_determined_keys, task_order,
                                 varying_keys)
from peftlab.lab.store import option_defaults_json
from peftlab.tasks.table import LOWER_IS_BETTER, find_task

DERIVED = {"v_lr": {"lr", "lr_ratio"}, "qk_lr": {"lr"}}  # axis keys computed from config keys: v_lr = lr * lr_ratio
# Axis titles for config keys whose name alone does not say what they are (the papers' symbols; mathtext
# without spaces inside $...$, so that wrapping never splits a formula).
AXIS_TITLES = {"lr_ratio": r"$\lambda{=}\eta_V/\eta_{QK}$ (lr_ratio)", "lr": r"$\eta_{QK}$ (lr)",
               "qk_lr": r"$\eta_{QK}$ (lr)", "v_lr": r"$\eta_V{=}\lambda\eta_{QK}$ (lr × lr_ratio)",
               "head_lr": "head learning rate (head_lr)"}
LR_KEYS = ("lr", "v_lr", "qk_lr", "head_lr")  # learning rates: log axes, ticks written 5e-4
LOG_KEYS = LR_KEYS + ("lr_ratio",)  # multiplicative keys: log axes when every value is > 0
# Okabe & Ito's palette (distinguishable with every common colour-vision deficiency), black last; more lines
# than colours cycle through line styles as well.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000")
LINESTYLES = ("-", "--", "-.")  # (dotted: runs drawn on their own, e.g. a seed that failed to learn)
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
MAX_PANELS = 36
MAX_LINES = 12
DPI = 200  # figures are laid out at the resolution they are saved with (a PNG is the figure's own canvas)
CHAR_EM = 0.6  # average glyph width in em (DejaVu Sans), a little generous, for wrapping titles to a width
STYLE = {
    "font.size": 8, "axes.titlesize": 8.5, "axes.labelsize": 8, "xtick.labelsize": 7.5, "ytick.labelsize": 7.5,
    "legend.fontsize": 7.5, "figure.titlesize": 9, "axes.linewidth": 0.8, "lines.linewidth": 1.4,
    "pdf.fonttype": 42, "ps.fonttype": 42, "svg.fonttype": "none",  # text stays text (editable, searchable)
    "image.cmap": "viridis",
}
# The valid range of a metric (before --scale): what a band or a clipped value may never leave.
UNIT_METRICS = ("accuracy", "f1", "precision", "recall", "exact_match", "bleu", "meteor", "rouge_l", "rouge1",
                "rouge2", "rougeL")
CORRELATIONS = ("pearson", "spearman", "spearmanr", "matthews_correlation", "mcc")
PERCENT_METRICS = ("accuracy", "f1", "precision", "recall", "exact_match")  # ×100 is a percentage


@dataclass
class Drawn:
    """A drawn figure, the data it shows (a kind's own dataclass, for tests and scripts) and the notes
    ``peftlab plot`` prints (one line each: what was drawn instead, what was left out)."""

    figure: Any
    data: Any
    notes: list[str] = field(default_factory=list)
    path: Any = None  # where make_plot wrote it


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def style():
    """matplotlib's settings for a paper figure, for the figures drawn (and saved) inside a ``with`` block."""
    import matplotlib
    from cycler import cycler

    pyplot()
    return matplotlib.rc_context({**STYLE, "axes.prop_cycle": cycler(color=PALETTE)})


def line_style(index: int) -> dict:
    """Colour, line style and marker of the ``index``-th line of a figure (colour first, then style)."""
    return {"color": PALETTE[index % len(PALETTE)],
            "linestyle": LINESTYLES[(index // len(PALETTE)) % len(LINESTYLES)],
            "marker": MARKERS[index % len(MARKERS)]}


# --------------------------------------------------------------------------- keys and values


def key_value(config: dict, key: str):
    """A config value, or a derived one (v_lr = lr * lr_ratio, qk_lr = lr); floats rounded for grouping."""
    if key == "v_lr":
        value = float(config["lr"]) * float(config["lr_ratio"])
    elif key == "qk_lr":
        value = float(config["lr"])
    else:
        value = config.get(key)
    if isinstance(value, float):
        value = float(f"{value:.10g}")
    return hashable(value)


def check_key(key: str, flag: str) -> None:
    from peftlab.config import TrainConfig, option_names
    from peftlab.errors import closest

    names = option_names(TrainConfig) + list(DERIVED)
    if key not in names:
        raise PeftlabError(f"unknown key '{key}' for {flag}{closest(key, names)}",
                           fix="use a config key (lr, lr_ratio, rank, ...) or v_lr (= lr * lr_ratio)")


def underlying(key: str) -> set[str]:
    return DERIVED.get(key, {key})


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def log_axis(key: str, values) -> bool:
    """Whether ``key``'s axis is logarithmic: a learning rate or lambda, every value a number > 0."""
    values = list(values)
    return key in LOG_KEYS and bool(values) and all(is_number(v) and v > 0 for v in values)


def config_label(config: dict, keys: list[str]) -> str:
    """``method=lora lr=1e-3``: the keys that tell configs apart (learning rates as the ticks write them), less
    the method options its method does not read (LoRA's kasa_mode, head-only's targets)."""
    from peftlab.config import OPTIONS_READ

    reads = OPTIONS_READ.get(config.get("method"))
    shown = [k for k in keys if reads is None or k in reads or not any(k in o for o in OPTIONS_READ.values())]
    return " ".join(f"{k}={fmt_tick(config.get(k), k) if k in LR_KEYS else fmt_value(config.get(k))}"
                    for k in shown) or "all runs"


def fmt_tick(value, key: str | None = None) -> str:
    """A tick label: learning rates as ``5e-4`` / ``1.6e-2``, other floats to 3 significant digits."""
    if key in LR_KEYS and is_number(value) and value > 0:
        mantissa, exponent = f"{float(value):.2e}".split("e")
        mantissa = mantissa.rstrip("0").rstrip(".")
        return f"{mantissa}e{int(exponent)}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return fmt_value(value)


def num_key(value):
    if is_number(value):
        return (0, float(value), "")
    return (1, 0.0, str(value))


# --------------------------------------------------------------------------- metrics


def metric_label(names, scale: float) -> str:
    """``accuracy (%)``, ``pearson ×100``, ``eval_loss``: the metric and the unit its numbers are in."""
    names = list(names)
    if scale == 100 and names and all(n in PERCENT_METRICS for n in names):
        return "/".join(names) + " (%)"
    return "/".join(names) + (f" ×{scale:g}" if scale != 1 else "")


def metric_range(name: str, task: str | None = None) -> tuple[float, float] | None:
    """The values ``name`` can take (unscaled): [0, 1] for accuracy-like scores, [-1, 1] for correlations, or
    None when it has no fixed range (losses, judge scores, unknown metrics). ``combined`` is the mean of the
    task's two metrics: a correlation's range on regression tasks, [0, 1] otherwise."""
    if name == "combined":
        found = find_task(str(task))
        return (-1.0, 1.0) if found is not None and found.kind == "regression" else (0.0, 1.0)
    if name in CORRELATIONS:
        return (-1.0, 1.0)
    if name in UNIT_METRICS:
        return (0.0, 1.0)
    return None


def lower_is_better(names: list[str]) -> bool:
    return bool(names) and all(n in LOWER_IS_BETTER for n in names)


# --------------------------------------------------------------------------- groups of runs


def with_defaults(config: dict) -> dict:
    """``config`` with the options it lacks at their defaults: a run recorded before an option existed ran as
    its default does (the store's run keys assume the same), so it groups with runs that record the default."""
    return {**{k: v for k, v in option_defaults_json().items() if k not in config}, **config}


def split_by_config(records: list[RunRecord], drop: set[str]
                    ) -> tuple[dict[tuple, list[RunRecord]], dict[tuple, dict], list[str]]:
    """Group records by their config (options it lacks at their defaults) minus ``drop``; returns the groups
    sorted by their varying values (numbers as numbers: lambda 2 before 16), each group's config, varying keys."""
    groups: dict[tuple, list[RunRecord]] = defaultdict(list)
    configs: dict[tuple, dict] = {}
    for rec in records:
        config = {k: v for k, v in with_defaults(rec.config).items() if k not in drop}
        key = tuple(sorted((k, hashable(v)) for k, v in config.items()))
        groups[key].append(rec)
        configs[key] = config
    varying = varying_keys(list(configs.values()))
    order = sorted(configs, key=lambda g: tuple(num_key(hashable(configs[g].get(k))) for k in varying))
    return {g: groups[g] for g in order}, configs, varying


def trained_runs(records: list[RunRecord]) -> list[RunRecord]:
    trained = [r for r in records if not r.before]
    if not trained:
        raise PeftlabError("no trained runs to plot (only epochs-0 runs)")
    return trained


def fixed_keys(records: list[RunRecord], *axes: str) -> set[str]:
    """The keys that never tell a figure's configs apart: run bookkeeping, what the task sets, the axes' keys."""
    return set(NON_RESULT_KEYS) | set(task_determined_keys(records)) | {k for key in axes for k in underlying(key)}


def task_metrics(records: list[RunRecord]) -> dict[str, list[str]]:
    """Each task of ``records`` (in table order) -> the metrics its runs report."""
    tasks = task_order(r.task for r in records)
    return {t: sorted({r.metric for r in records if r.task == t and r.metric}) for t in tasks}


def config_lines(records: list[RunRecord], drop: set[str]) -> Iterator[tuple[str, str, list[RunRecord]]]:
    """(task, label, runs) of each config's line (at most MAX_LINES) on each task it ran, tasks in table order."""
    groups, configs, varying = split_by_config(records, drop)
    if len(groups) > MAX_LINES:
        raise PeftlabError(f"the selection has {len(groups)} configs (at most {MAX_LINES} lines)",
                           fix=f'narrow it with --where (they vary in {", ".join(varying)})')
    for task in task_order(r.task for r in records):
        for gkey, recs in groups.items():
            recs = [r for r in recs if r.task == task]
            if recs:
                yield task, config_label(configs[gkey], varying) if varying else "runs", recs


# --------------------------------------------------------------------------- layout


def visible_length(text: str) -> int:
    """About how many glyphs ``text`` draws: mathtext (``$\\eta_{QK}$``) counts its symbols, not its markup."""
    parts = text.split("$")
    plain = "".join(parts[0::2])
    math_parts = "".join(re.sub(r"\\[a-zA-Z]+", "x", part).translate(MATH_MARKUP) for part in parts[1::2])
    return len(plain) + len(math_parts)


MATH_MARKUP = str.maketrans("", "", "{}_^\\,")


def wrap(text: str, width_in: float, fontsize: float) -> str:
    """``text`` with each of its lines wrapped at spaces to fit ``width_in`` inches at ``fontsize`` points;
    a word is never split (a formula stays whole) and is measured as drawn (:func:`visible_length`)."""
    chars = max(16, int(width_in * 72 / (CHAR_EM * fontsize)))
    out = []
    for line in text.split("\n"):
        current: list[str] = []
        for word in line.split(" "):
            if current and visible_length(" ".join(current + [word])) > chars:
                out.append(" ".join(current))
                current = []
            current.append(word)
        out.append(" ".join(current))
    return "\n".join(out)


def suptitle(fig, text: str, fontsize: float = 9) -> None:
    fig.suptitle(wrap(text, 0.96 * fig.get_figwidth(), fontsize), fontsize=fontsize)


def panel_title(ax, text: str, width_in: float, fontsize: float = 8.5) -> None:
    ax.set_title(wrap(text, 0.9 * width_in, fontsize), fontsize=fontsize)


def legend_below(fig, handles, labels, fontsize: float = 7.5) -> None:
    """One legend for the figure, below the panels (constrained layout makes room for it)."""
    room = 0.95 * fig.get_figwidth()
    per_entry = (max(len(label) for label in labels) * CHAR_EM * fontsize + 48) / 72  # marker + padding
    ncol = max(1, min(3, len(labels), int(room / per_entry)))
    labels = [wrap(label, room / ncol - 48 / 72, fontsize) for label in labels]
    lines = sum(max(label.count("\n") + 1 for label in labels[k:k + ncol]) for k in range(0, len(labels), ncol))
    height = fig.get_figheight() + lines * 1.4 * fontsize / 72  # room for the legend, the panels keep theirs
    fig.set_figheight(round(height * fig.dpi) / fig.dpi)
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, fontsize=fontsize, frameon=False)


def legend_of(fig, axes) -> None:
    """legend_below with each label drawn in ``axes`` once (with its first handle); none if nothing is labelled."""
    first = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            first.setdefault(label, handle)
    if first:
        legend_below(fig, list(first.values()), list(first))


def panel_grid(n_rows: int, n_cols: int, *, width: float = 3.0, height: float = 2.5):
    if n_rows * n_cols > MAX_PANELS:
        raise PeftlabError(f"the figure would have {n_rows * n_cols} panels (at most {MAX_PANELS})",
                           fix='select fewer runs with --where, e.g. --where "method=lora,targets=q,v"')
    plt = pyplot()
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols, height * n_rows), squeeze=False,
                             layout="constrained", dpi=DPI)
    return plt, fig, axes


def set_ticks(ax, which: str, positions, labels, *, log: bool) -> None:
    """``ax``'s ``which`` ("x" or "y") axis, log-scaled with ``log``, with ticks at exactly ``positions`` and no
    minor ticks (a log axis would add its own between them)."""
    from matplotlib.ticker import NullLocator

    if log:
        getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_ticks([float(v) for v in positions], labels)
    axis.set_minor_locator(NullLocator())


def log_edges(values) -> list[float]:
    """Cell edges of a log axis through ``values`` (sorted, > 0): geometric midpoints, the outer cells as wide
    (in log units) as their inner neighbours' half-gaps; one value: a factor sqrt(2) either side."""
    import numpy as np

    logs = np.log(np.asarray(values, dtype=float))
    half = np.diff(logs) / 2 if len(logs) > 1 else np.array([math.log(2) / 2])
    return list(np.exp(np.concatenate([[logs[0] - half[0]], logs[:-1] + half, [logs[-1] + half[-1]]])))
