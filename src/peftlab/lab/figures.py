"""What every ``peftlab plot`` figure shares: matplotlib (Agg, constrained layout), panel grids, wrapped titles,
one colour bar per group of panels, legends below, and the config keys the axes may use.

Figures are laid out at the resolution they are saved with (``DPI``); titles are wrapped to the width they
are drawn at, so nothing is cropped or overlaps (``tests/test_plot_layout.py``).
"""

from __future__ import annotations

import textwrap
from collections import defaultdict

from peftlab.errors import PeftlabError
from peftlab.lab.records import RunRecord, fmt_value, hashable, varying_keys

DERIVED = {"v_lr": "lr * lr_ratio (eta_V)", "qk_lr": "lr (eta_QK)"}
# Axis titles for config keys whose name alone does not say what they are (the papers' symbols).
AXIS_TITLES = {"lr_ratio": "lambda = eta_V / eta_QK (lr_ratio)", "lr": "eta_QK (lr)", **DERIVED}
MAX_PANELS = 36
MAX_LINES = 12
DPI = 150  # figures are laid out at the resolution they are saved with (a PNG is the figure's own canvas)
CHAR_EM = 0.6  # average glyph width in em (DejaVu Sans), a little generous, for wrapping titles to a width


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


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
    return {"v_lr": {"lr", "lr_ratio"}, "qk_lr": {"lr"}}.get(key, {key})


def config_label(config: dict, keys: list[str]) -> str:
    return " ".join(f"{k}={fmt_value(config.get(k))}" for k in keys) or "all runs"


def split_by_config(records: list[RunRecord], drop: set[str]
                    ) -> tuple[dict[tuple, list[RunRecord]], dict[tuple, dict], list[str]]:
    """Group records by their config minus ``drop``; returns groups, each group's config, varying keys."""
    groups: dict[tuple, list[RunRecord]] = defaultdict(list)
    configs: dict[tuple, dict] = {}
    for rec in records:
        config = {k: v for k, v in rec.config.items() if k not in drop}
        key = tuple(sorted((k, hashable(v)) for k, v in config.items()))
        groups[key].append(rec)
        configs[key] = config
    return groups, configs, varying_keys(list(configs.values()))


def line_groups(records: list[RunRecord], drop: set[str]
                ) -> tuple[dict[tuple, list[RunRecord]], dict[tuple, dict], list[str]]:
    """split_by_config for a figure of lines, one per config (at most MAX_LINES), in their labels' order."""
    groups, configs, varying = split_by_config(records, drop)
    if len(groups) > MAX_LINES:
        raise PeftlabError(f"the selection has {len(groups)} configs (at most {MAX_LINES} lines)",
                           fix=f'narrow it with --where (they vary in {", ".join(varying)})')
    order = sorted(groups, key=lambda g: config_label(configs[g], varying))
    return {g: groups[g] for g in order}, configs, varying


def line_colors(plt, n_lines: int):
    return plt.get_cmap("tab10" if n_lines <= 10 else "tab20")


def task_title(task: str) -> str:
    from peftlab.tasks.table import TASKS

    return (TASKS[task].glue_dir or task.upper()) if task in TASKS else task


def fmt_tick(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return fmt_value(value)


def status_summary(counts: dict[str, int]) -> str:
    """``collapsed, diverged ×2``: the statuses of the runs left out, with their counts."""
    return ", ".join(f"{s} ×{n}" if n > 1 else s for s, n in sorted(counts.items()))


def wrap(text: str, width_in: float, fontsize: float) -> str:
    """``text`` with each of its lines wrapped to fit ``width_in`` inches at ``fontsize`` points."""
    chars = max(16, int(width_in * 72 / (CHAR_EM * fontsize)))
    return "\n".join(textwrap.fill(line, chars, break_on_hyphens=False) if line else line
                     for line in text.split("\n"))


def suptitle(fig, text: str, fontsize: float = 10) -> None:
    fig.suptitle(wrap(text, 0.96 * fig.get_figwidth(), fontsize), fontsize=fontsize)


def panel_title(ax, text: str, width_in: float, fontsize: float = 9) -> None:
    ax.set_title(wrap(text, 0.9 * width_in, fontsize), fontsize=fontsize)


def legend_below(fig, handles, labels, fontsize: float = 8) -> None:
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
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        legend_below(fig, handles, labels)


def panel_grid(n_rows: int, n_cols: int, *, width: float = 4.4, height: float = 3.6):
    if n_rows * n_cols > MAX_PANELS:
        raise PeftlabError(f"the figure would have {n_rows * n_cols} panels (at most {MAX_PANELS})",
                           fix='select fewer runs with --where, e.g. --where "method=lora,targets=q,v"')
    plt = pyplot()
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols, height * n_rows), squeeze=False,
                             layout="constrained", dpi=DPI)
    return plt, fig, axes


def colorbar(fig, image, axes: list, width: float, height: float):
    """One colour bar for ``axes`` (panels of ``width`` x ``height`` inches that share the colour scale), about
    as long as the rows they span (its aspect ratio sets its length under constrained layout)."""
    rows = {ax.get_subplotspec().rowspan.start for ax in axes}
    # the bar is ~fraction x the parents' width thick (their width less the tick labels); length = aspect x that
    aspect = max(10.0, 0.85 * (height * len(rows) - 0.6) / (0.05 * max(width - 0.9, 1.0)))
    bar = fig.colorbar(image, ax=axes, fraction=0.05, pad=0.02, shrink=0.9, aspect=aspect)
    bar.ax.tick_params(labelsize=7)
    return bar


def metric_label(names, scale: float) -> str:
    return "/".join(names) + (" ×100" if scale == 100 else "")



def num_key(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))

