"""``peftlab plot STORE --kind heatmap|sigma|curves|rank --out FILE.png``: figures from a results store.

* ``heatmap``: a metric over two config keys (``--x lr --y lr_ratio`` by default; ``--y v_lr`` is
  lr * lr_ratio, i.e. eta_QK x eta_V as in Yao et al. Figure 1), mean over seeds, one panel per task (and
  per combination of any other key that varies). Cells with diverged/collapsed/failed runs are marked
  (``×n``); a cell with only such runs is grey and names them.
* ``sigma``: KaSA's learned Delta_sigma per layer and projection (KaSA Figure 4), from result.json's
  ``kasa_sigma``, averaged over the selected runs (seeds).
* ``curves``: the metric per epoch and the train loss of the selected runs (``--where``), mean ± std over
  seeds per config; runs that did not end ok are drawn on their own, dashed.
* ``rank``: the metric against ``--x`` (default rank), one line per other varying config, mean ± std.

Figures are drawn with matplotlib's Agg backend; the file type follows ``--out``'s suffix (png, pdf, svg).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.report import (
    NON_RESULT_KEYS,
    RunRecord,
    _fmt_value,
    _hashable,
    _task_order,
    _varying_keys,
    auto_scale,
    collect,
    parse_filter,
    task_determined_keys,
)
from peftlab.store import NOT_OK, load_rows

KINDS = ("heatmap", "sigma", "curves", "rank")
DERIVED = {"v_lr": "lr * lr_ratio (eta_V)", "qk_lr": "lr (eta_QK)"}
SUFFIXES = (".png", ".pdf", ".svg")
MAX_PANELS = 36
MAX_LINES = 12
_PROJ_NAMES = {"query": "q", "q_proj": "q", "q_lin": "q", "q": "q", "key": "k", "k_proj": "k", "k_lin": "k",
               "k": "k", "value": "v", "v_proj": "v", "v_lin": "v", "v": "v", "o_proj": "o", "out_proj": "o",
               "out_lin": "o", "o": "o", "c_attn": "qkv", "c_proj": "o"}


def _pyplot():
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
    return _hashable(value)


def _check_key(key: str, flag: str) -> None:
    from dataclasses import fields

    from peftlab.config import TrainConfig
    from peftlab.errors import closest

    names = [f.name for f in fields(TrainConfig)] + list(DERIVED)
    if key not in names:
        raise PeftlabError(f"unknown key '{key}' for {flag}{closest(key, names)}",
                           fix="use a config key (lr, lr_ratio, rank, ...) or v_lr (= lr * lr_ratio)")


def _underlying(key: str) -> set[str]:
    return {"v_lr": {"lr", "lr_ratio"}, "qk_lr": {"lr"}}.get(key, {key})


def _label(config: dict, keys: list[str]) -> str:
    return " ".join(f"{k}={_fmt_value(config.get(k))}" for k in keys) or "all runs"


def _split(records: list[RunRecord], drop: set[str]
           ) -> tuple[dict[tuple, list[RunRecord]], dict[tuple, dict], list[str]]:
    """Group records by their config minus ``drop``; returns groups, each group's config, varying keys."""
    groups: dict[tuple, list[RunRecord]] = defaultdict(list)
    configs: dict[tuple, dict] = {}
    for rec in records:
        config = {k: v for k, v in rec.config.items() if k not in drop}
        key = tuple(sorted((k, _hashable(v)) for k, v in config.items()))
        groups[key].append(rec)
        configs[key] = config
    return groups, configs, _varying_keys(list(configs.values()))


def _task_title(task: str) -> str:
    from peftlab.tasks import TASKS

    return (TASKS[task].glue_dir or task.upper()) if task in TASKS else task


def _fmt_tick(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return _fmt_value(value)


def _status_summary(counts: dict[str, int]) -> str:
    return ", ".join(f"{s} ×{n}" if n > 1 else s for s, n in sorted(counts.items()))


def _panel_grid(n_rows: int, n_cols: int, *, width: float = 4.4, height: float = 3.6):
    if n_rows * n_cols > MAX_PANELS:
        raise PeftlabError(f"the figure would have {n_rows * n_cols} panels (at most {MAX_PANELS})",
                           fix='select fewer runs with --where, e.g. --where "method=lora,targets=q,v"')
    plt = _pyplot()
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(width * n_cols, height * n_rows), squeeze=False)
    return plt, fig, axes


# --------------------------------------------------------------------------- (a) heatmap


def plot_heatmap(records: list[RunRecord], out: Path, *, x: str = "lr", y: str = "lr_ratio", scale: float = 100.0,
                 digits: int = 1, title: str | None = None) -> Path:
    import numpy as np

    trained = [r for r in records if not r.before]
    if not trained:
        raise PeftlabError("no trained runs to plot (only epochs-0 runs)")
    per_task = task_determined_keys(trained)
    drop = set(NON_RESULT_KEYS) | set(per_task) | _underlying(x) | _underlying(y)
    groups, configs, varying = _split(trained, drop)
    panels = sorted(configs, key=lambda g: _label(configs[g], varying))
    tasks = _task_order(r.task for r in trained)
    plt, fig, axes = _panel_grid(len(panels), len(tasks), width=5.6, height=4.4)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#d9d9d9")
    for i, gkey in enumerate(panels):
        for j, task in enumerate(tasks):
            ax = axes[i][j]
            recs = [r for r in groups[gkey] if r.task == task]
            xs = sorted({key_value(r.config, x) for r in recs}, key=_num_key)
            ys = sorted({key_value(r.config, y) for r in recs}, key=_num_key)
            values = np.full((len(ys), len(xs)), np.nan)
            bad: dict[tuple[int, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
            cells: dict[tuple[int, int], list[float]] = defaultdict(list)
            for rec in recs:
                cell = (ys.index(key_value(rec.config, y)), xs.index(key_value(rec.config, x)))
                if rec.status in NOT_OK or rec.value is None:
                    bad[cell][rec.status if rec.status in NOT_OK else "missing"] += 1
                else:
                    cells[cell].append(rec.value * scale)
            for (yi, xi), vals in cells.items():
                values[yi, xi] = statistics.fmean(vals)
            if not recs:
                ax.set_axis_off()
                continue
            finite = values[np.isfinite(values)]
            image = ax.imshow(np.ma.masked_invalid(values), origin="lower", cmap=cmap, aspect="auto",
                              vmin=finite.min() if finite.size else None, vmax=finite.max() if finite.size else None)
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
            best = np.unravel_index(np.nanargmax(values), values.shape) if finite.size else None
            for yi in range(len(ys)):
                for xi in range(len(xs)):
                    lines = []
                    if np.isfinite(values[yi, xi]):
                        lines.append(f"{values[yi, xi]:.{digits}f}")
                    if bad.get((yi, xi)):
                        summary = _status_summary(bad[(yi, xi)])
                        lines.append(f"[{summary}]" if cells.get((yi, xi)) else summary)
                        if not cells.get((yi, xi)):  # only runs that did not end ok: hatched
                            ax.add_patch(plt.Rectangle((xi - 0.5, yi - 0.5), 1, 1, fill=False, hatch="//",
                                                       edgecolor="#8c2d04", lw=0))
                    if not lines:
                        continue
                    light = np.isfinite(values[yi, xi]) and finite.size and (
                        values[yi, xi] < finite.min() + 0.5 * (finite.max() - finite.min() or 1))
                    ax.text(xi, yi, "\n".join(lines), ha="center", va="center", fontsize=7,
                            color="white" if light else "black",
                            fontweight="bold" if best is not None and (yi, xi) == tuple(best) else "normal")
            if best is not None:
                ax.add_patch(plt.Rectangle((best[1] - 0.5, best[0] - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.5))
            ax.set_xticks(range(len(xs)), [_fmt_tick(v) for v in xs], rotation=45, ha="right", fontsize=8)
            ax.set_yticks(range(len(ys)), [_fmt_tick(v) for v in ys], fontsize=8)
            ax.set_xlabel(DERIVED.get(x, x))
            ax.set_ylabel(DERIVED.get(y, y))
            name = _task_title(task)
            sub = _label(configs[gkey], varying) if varying else ""
            ax.set_title(f"{name}" + (f"\n{sub}" if sub else ""), fontsize=9)
    metric = sorted({r.metric for r in trained if r.metric})
    fig.suptitle(title or f"{'/'.join(metric)} (mean over seeds; red box: best; [..]: runs that did not end ok, "
                          "not in the mean)", fontsize=10)
    return _save(fig, plt, out)


def _num_key(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


# --------------------------------------------------------------------------- (b) KaSA sigma


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


def plot_sigma(records: list[RunRecord], out: Path, *, title: str | None = None) -> Path:
    import numpy as np

    runs = [r for r in records if r.result and r.result.get("kasa_sigma")]
    if not runs:
        methods = sorted({str(r.config.get("method")) for r in records})
        raise PeftlabError("no run in the selection has kasa_sigma (KaSA's learned singular values)",
                           fix=f"select KaSA runs (--where method=kasa); the selection has {', '.join(methods)}")
    drop = set(NON_RESULT_KEYS) - {"task"}
    groups, configs, varying = _split(runs, drop)
    varying = [k for k in varying if k != "task"]
    panels = sorted(configs, key=lambda g: (_task_order([configs[g]["task"]])[0], _label(configs[g], varying)))
    projections = sorted({parse_module(m)[1] for r in runs for m in r.result["kasa_sigma"]},
                         key=lambda p: ("q", "k", "v", "o", "qkv").index(p) if p in ("q", "k", "v", "o", "qkv") else 9)
    plt, fig, axes = _panel_grid(len(panels), len(projections), width=4.6, height=3.4)
    for i, gkey in enumerate(panels):
        recs = groups[gkey]
        for j, proj in enumerate(projections):
            ax = axes[i][j]
            per_layer: dict[int, list[list[float]]] = defaultdict(list)
            for rec in recs:
                for module, values in rec.result["kasa_sigma"].items():
                    layer, p = parse_module(module)
                    if p == proj:
                        per_layer[layer if layer is not None else 0].append([float(v) for v in values])
            if not per_layer:
                ax.set_axis_off()
                continue
            layers = sorted(per_layer)
            width = max(len(v) for vals in per_layer.values() for v in vals)
            matrix = np.full((len(layers), width), np.nan)
            for li, layer in enumerate(layers):
                vals = [v + [math.nan] * (width - len(v)) for v in per_layer[layer]]
                matrix[li] = np.nanmean(np.array(vals, dtype=float), axis=0)
            limit = float(np.nanmax(np.abs(matrix))) if np.isfinite(matrix).any() else 1.0
            image = ax.imshow(matrix, origin="lower", cmap="RdBu_r", vmin=-limit or -1, vmax=limit or 1,
                              aspect="auto", interpolation="nearest")
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
            ax.set_yticks(range(len(layers)), [str(layer) for layer in layers], fontsize=7)
            ax.set_xlabel("singular value index i")
            ax.set_ylabel("layer")
            sub = _label(configs[gkey], varying) if varying else ""
            ax.set_title(f"{_task_title(configs[gkey]['task'])} · {proj} · mean of {len(recs)} run(s)"
                         + (f"\n{sub}" if sub else ""), fontsize=9)
    fig.suptitle(title or "KaSA: learned Δσ per layer and projection", fontsize=10)
    return _save(fig, plt, out)


# --------------------------------------------------------------------------- (c) learning curves


def plot_curves(records: list[RunRecord], out: Path, *, scale: float = 100.0, title: str | None = None) -> Path:
    import numpy as np

    runs = [r for r in records if r.result and r.result.get("epochs_log")]
    if not runs:
        raise PeftlabError("no run in the selection has a training log (epochs_log)",
                           fix="select trained runs (epochs > 0) with --where")
    per_task = task_determined_keys(runs)
    drop = set(NON_RESULT_KEYS) | set(per_task)
    groups, configs, varying = _split(runs, drop)
    if len(groups) > MAX_LINES:
        raise PeftlabError(f"the selection has {len(groups)} configs (at most {MAX_LINES} lines)",
                           fix=f'narrow it with --where (they vary in {", ".join(varying)})')
    tasks = _task_order(r.task for r in runs)
    plt, fig, axes = _panel_grid(2, len(tasks), width=4.8, height=3.4)
    colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    order = sorted(groups, key=lambda g: _label(configs[g], varying))
    for j, task in enumerate(tasks):
        top, bottom = axes[0][j], axes[1][j]
        for c, gkey in enumerate(order):
            recs = [r for r in groups[gkey] if r.task == task]
            if not recs:
                continue
            color = colors(c % colors.N)
            label = _label(configs[gkey], varying) if varying else "runs"
            good = [r for r in recs if r.status == "ok"]
            for ax, series in ((top, lambda e, r: e["metrics"].get(r.metric)),
                               (bottom, lambda e, r: e.get("train_loss"))):
                factor = scale if ax is top else 1.0
                if good:
                    by_epoch: dict[int, list[float]] = defaultdict(list)
                    for rec in good:
                        for entry in rec.result["epochs_log"]:
                            value = series(entry, rec)
                            if value is not None and math.isfinite(value):
                                by_epoch[int(entry["epoch"])].append(value * factor)
                    epochs = sorted(by_epoch)
                    mean = np.array([statistics.fmean(by_epoch[e]) for e in epochs])
                    std = np.array([statistics.stdev(by_epoch[e]) if len(by_epoch[e]) > 1 else 0.0 for e in epochs])
                    ax.plot(epochs, mean, marker="o", ms=3, color=color,
                            label=f"{label} (n={len(good)})" if ax is top else None)
                    ax.fill_between(epochs, mean - std, mean + std, color=color, alpha=0.2, lw=0)
                for rec in recs:
                    if rec.status == "ok":
                        continue
                    points = [(e["epoch"], series(e, rec)) for e in rec.result["epochs_log"]]
                    points = [(e, v * factor) for e, v in points if v is not None and math.isfinite(v)]
                    if points:
                        ax.plot(*zip(*points), ls="--", lw=1, color=color, marker="x", ms=4,
                                label=f"{label} seed {rec.seed}: {rec.status}" if ax is top else None)
        metric = sorted({r.metric for r in runs if r.task == task and r.metric})
        top.set_title(_task_title(task), fontsize=10)
        top.set_ylabel("/".join(metric) + (" ×100" if scale == 100 else ""))
        bottom.set_ylabel("train loss")
        bottom.set_xlabel("epoch")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
            ax.xaxis.get_major_locator().set_params(integer=True)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for j in range(1, len(tasks)):
        h, l = axes[0][j].get_legend_handles_labels()
        for hh, ll in zip(h, l):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8,
                   bbox_to_anchor=(0.5, 0.0), frameon=False)
        fig.subplots_adjust(bottom=0.12 + 0.035 * math.ceil(len(labels) / 3))
    fig.suptitle(title or "learning curves: mean ± std over seeds (dashed: runs that did not end ok)", fontsize=10)
    return _save(fig, plt, out, tight=False)


# --------------------------------------------------------------------------- (d) metric vs rank


def plot_rank(records: list[RunRecord], out: Path, *, x: str = "rank", scale: float = 100.0,
              title: str | None = None) -> Path:
    trained = [r for r in records if not r.before]
    if not trained:
        raise PeftlabError("no trained runs to plot (only epochs-0 runs)")
    per_task = task_determined_keys(trained)
    drop = set(NON_RESULT_KEYS) | set(per_task) | _underlying(x)
    groups, configs, varying = _split(trained, drop)
    if len(groups) > MAX_LINES:
        raise PeftlabError(f"the selection has {len(groups)} lines (at most {MAX_LINES})",
                           fix=f'narrow it with --where (they vary in {", ".join(varying)})')
    tasks = _task_order(r.task for r in trained)
    plt, fig, axes = _panel_grid(1, len(tasks), width=4.8, height=3.8)
    colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    all_x = sorted({key_value(r.config, x) for r in trained}, key=_num_key)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in all_x)
    for j, task in enumerate(tasks):
        ax = axes[0][j]
        for c, gkey in enumerate(sorted(groups, key=lambda g: _label(configs[g], varying))):
            recs = [r for r in groups[gkey] if r.task == task]
            if not recs:
                continue
            by_x: dict[Any, list[float]] = defaultdict(list)
            bad: dict[Any, int] = defaultdict(int)
            for rec in recs:
                xv = key_value(rec.config, x)
                if rec.status in NOT_OK or rec.value is None:
                    bad[xv] += 1
                else:
                    by_x[xv].append(rec.value * scale)
            xs = sorted(by_x, key=_num_key)
            pos = xs if numeric else [all_x.index(v) for v in xs]
            means = [statistics.fmean(by_x[v]) for v in xs]
            stds = [statistics.stdev(by_x[v]) if len(by_x[v]) > 1 else 0.0 for v in xs]
            color = colors(c % colors.N)
            ax.errorbar(pos, means, yerr=stds, marker="o", ms=4, capsize=3, color=color,
                        label=_label(configs[gkey], varying) if varying else None)
            for v, n in bad.items():
                if v in by_x:
                    ax.annotate(f"×{n}", (v if numeric else all_x.index(v), statistics.fmean(by_x[v])),
                                textcoords="offset points", xytext=(4, -10), fontsize=7, color=color)
        if numeric:
            positive = all(float(v) > 0 for v in all_x)
            if positive and len(all_x) > 2 and max(all_x) / min(all_x) >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(all_x, [_fmt_tick(v) for v in all_x])
            ax.minorticks_off()
        else:
            ax.set_xticks(range(len(all_x)), [_fmt_tick(v) for v in all_x])
        ax.set_xlabel(DERIVED.get(x, x))
        metric = sorted({r.metric for r in trained if r.task == task and r.metric})
        ax.set_ylabel("/".join(metric) + (" ×100" if scale == 100 else ""))
        ax.set_title(_task_title(task), fontsize=10)
        ax.grid(alpha=0.3)
    if varying:
        axes[0][0].legend(fontsize=7)
    fig.suptitle(title or f"metric vs {x}: mean ± std over seeds (×n: runs excluded, not ok)", fontsize=10)
    return _save(fig, plt, out)


# --------------------------------------------------------------------------- output + CLI


def _save(fig, plt, out: Path, *, tight: bool = True) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def make_plot(rows: list[dict], *, kind: str, out: str | Path, x: str | None = None, y: str | None = None,
              where: str | None = None, which: str = "best", metric: str | None = None, scale: float | None = None,
              title: str | None = None) -> Path:
    if kind not in KINDS:
        raise PeftlabError(f"unknown --kind '{kind}'", fix=f"use one of {', '.join(KINDS)}")
    out = Path(out)
    if out.suffix.lower() not in SUFFIXES:
        raise PeftlabError(f"--out must end in {', '.join(SUFFIXES)}, got '{out.name}'")
    filters = parse_filter(where)
    records, _ = collect(rows, which=which, metric=metric, where=filters)
    if not records:
        raise PeftlabError("no finished runs in the store" + (" match --where" if filters else ""),
                           fix="run the sweep first, or loosen --where")
    if scale is None:
        scale = auto_scale(r.metric for r in records)
    if kind == "heatmap":
        x, y = x or "lr", y or "lr_ratio"
        _check_key(x, "--x")
        _check_key(y, "--y")
        if x == y:
            raise PeftlabError("--x and --y must differ")
        return plot_heatmap(records, out, x=x, y=y, scale=scale, title=title)
    if kind == "sigma":
        return plot_sigma(records, out, title=title)
    if kind == "curves":
        return plot_curves(records, out, scale=scale, title=title)
    x = x or "rank"
    _check_key(x, "--x")
    return plot_rank(records, out, x=x, scale=scale, title=title)


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "plot", help="figures from a results store: heatmap, KaSA sigma, learning curves, metric vs rank",
        description="heatmap: metric over --x/--y (default lr x lr_ratio; v_lr = lr*lr_ratio) per task; "
                    "sigma: KaSA's learned Delta_sigma per layer/projection; curves: metric and loss per epoch; "
                    "rank: metric vs --x (default rank).")
    parser.add_argument("stores", nargs="+", metavar="STORE", help="results.sqlite of a sweep (or its folder)")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--out", required=True, help="output file: .png, .pdf or .svg")
    parser.add_argument("--x", default=None, help="heatmap/rank x key (default lr / rank)")
    parser.add_argument("--y", default=None, help="heatmap y key (default lr_ratio; v_lr = lr * lr_ratio)")
    parser.add_argument("--where", default=None, metavar="K=V,...", help='only runs matching, e.g. "method=kasa"')
    parser.add_argument("--which", choices=("best", "final"), default="best", help="best (default) or final epoch")
    parser.add_argument("--metric", default=None, help="plot this metric instead of each task's primary metric")
    parser.add_argument("--scale", type=float, default=None, help="multiply metrics (default 100 for accuracy-like)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.set_defaults(func=run_cli)


def run_cli(args) -> int:
    path = make_plot(load_rows(args.stores), kind=args.kind, out=args.out, x=args.x, y=args.y, where=args.where,
                     which=args.which, metric=args.metric, scale=args.scale, title=args.title)
    print(f"wrote {path}")
    return 0
