"""``peftlab plot STORE|RUN... --kind lr-grid|heatmap|curves|sigma|rank --out FILE.{png,pdf,svg}``: figures for
a paper from results stores and run folders (the kinds: :mod:`peftlab.lab.figures`), in a paper style, saved
uncropped. Pruned tune trials are left out (incomplete runs), with a note. It reads run records only.
"""

from __future__ import annotations

from pathlib import Path

from peftlab.errors import PeftlabError
from peftlab.lab.figures.paper import Drawn, check_key, pyplot, style
from peftlab.lab.figures.curves import BANDS, CURVE_X, plot_curves
from peftlab.lab.figures.heatmap import plot_heatmap
from peftlab.lab.figures.points import plot_points
from peftlab.lab.figures.sigma import plot_sigma
from peftlab.lab.records import (auto_scale, collect, is_pruned, load_rows, parse_filter, parse_seeds,
                                 rows_of_seeds)

KINDS = ("lr-grid", "heatmap", "curves", "sigma", "rank")
SUFFIXES = (".png", ".pdf", ".svg")


def save_figure(fig, out: str | Path) -> Path:
    """Write ``fig`` to ``out`` (type from the suffix) as laid out: its whole canvas, no cropping, at its dpi."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with style():
        fig.savefig(out, dpi=fig.dpi)
    return out


def draw(rows: list[dict], *, kind: str, x: str | None = None, y: str | None = None, where: str | None = None,
         which: str = "best", metric: str | None = None, scale: float | None = None, title: str | None = None,
         curve_x: str = "epoch", band: str = "quartiles", loss: bool = False) -> Drawn:
    """One ``peftlab plot`` figure, the data it shows and its notes (see the module doc for the kinds)."""
    if kind not in KINDS:
        raise PeftlabError(f"unknown --kind '{kind}'", fix=f"use one of {', '.join(KINDS)}")
    if kind == "lr-grid" and (x or y):
        raise PeftlabError("--kind lr-grid draws eta_QK (lr) x eta_V (lr * lr_ratio); it takes no --x/--y",
                           fix="use --kind heatmap --x KEY --y KEY for other axes")
    if kind in ("curves", "sigma") and (x or y):
        raise PeftlabError(f"--kind {kind} takes no --x/--y", fix="for curves, choose the x axis with --curve-x")
    filters = parse_filter(where)
    records, _ = collect(rows, which=which, metric=metric, where=filters)
    pruned = [r for r in records if is_pruned(r)]
    records = [r for r in records if not is_pruned(r)]
    if not records:
        raise PeftlabError("no finished runs in the store" + (" match --where" if filters else ""),
                           fix="run the sweep first, or loosen --where")
    if scale is None:
        scale = auto_scale(r.metric for r in records)
    with style():
        if kind in ("heatmap", "lr-grid"):
            x, y = (x or "lr", y or "lr_ratio") if kind == "heatmap" else ("lr", "v_lr")
            check_key(x, "--x")
            check_key(y, "--y")
            if x == y:
                raise PeftlabError("--x and --y must differ")
            drawn = plot_heatmap(records, x=x, y=y, scale=scale, title=title, fold=kind == "heatmap")
        elif kind == "sigma":
            drawn = plot_sigma(records, title=title)
        elif kind == "curves":
            drawn = plot_curves(records, x=curve_x, band=band, scale=scale, loss=loss, title=title)
        else:
            x = x or "rank"
            check_key(x, "--x")
            drawn = plot_points(records, x=x, scale=scale, title=title)
    if pruned:
        drawn.notes.append(f"left out {len(pruned)} pruned tune trial(s): incomplete runs")
    return drawn


def make_plot(rows: list[dict], *, kind: str, out: str | Path, **options) -> Drawn:
    """:func:`draw` written to ``out`` (.png, .pdf or .svg); the Drawn's ``data`` and ``notes``, figure closed."""
    out = Path(out)
    if out.suffix.lower() not in SUFFIXES:
        raise PeftlabError(f"--out must end in {', '.join(SUFFIXES)}, got '{out.name}'")
    drawn = draw(rows, kind=kind, **options)
    drawn.path = save_figure(drawn.figure, out)
    pyplot().close(drawn.figure)
    return drawn


def add_parser(sub) -> None:
    from peftlab.argtypes import assignments, positive_float, text

    parser = sub.add_parser(
        "plot", help="figures from a results store: eta_QK x eta_V grid, heatmap, learning curves, KaSA sigma, rank",
        description="lr-grid: eta_QK x eta_V (lr x lr*lr_ratio) per task, log axes, lambda = 1 dashed; "
                    "heatmap: metric over --x/--y (default lr x lr_ratio; v_lr = lr*lr_ratio). Both: mean and (n) of "
                    "the runs that ended ok and 'k/N ✗' (failed) per cell, blank where nothing ran, one colour "
                    "scale per task, the best cell boxed only where a paired 95% CI against the runner-up "
                    "excludes 0; a single eta_QK (or --x value) is drawn as lines. curves: median and quantile "
                    "band over seeds from step-level evaluations; sigma: what training changed in KaSA's "
                    "Delta_sigma (learned - init); rank: metric vs --x (default rank), every run a dot.")
    parser.add_argument("stores", nargs="+", metavar="STORE", help="results.sqlite of a sweep (or its folder), "
                                                                   "or run folders of peftlab train")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--out", required=True, help="output file: .png, .pdf or .svg (vector, text kept as text)")
    parser.add_argument("--x", type=text, default=None, help="heatmap/rank x key (default lr / rank)")
    parser.add_argument("--y", type=text, default=None, help="heatmap y key (default lr_ratio; v_lr = lr * lr_ratio)")
    parser.add_argument("--where", type=assignments, default=None, metavar="K=V,...",
                        help='only runs matching, e.g. "method=kasa"')
    parser.add_argument("--seeds", default=None, metavar="A-B,C",
                        help="only runs of these seeds, e.g. 0-2 (a study's selection seeds) or 100-109")
    parser.add_argument("--which", choices=("best", "final"), default="best", help="best (default) or final epoch")
    parser.add_argument("--metric", type=text, default=None,
                        help="plot this metric instead of each task's primary metric")
    parser.add_argument("--scale", type=positive_float, default=None,
                        help="multiply metrics (default 100 for accuracy-like)")
    parser.add_argument("--curve-x", choices=CURVE_X, default="epoch",
                        help="curves: x axis, epochs (fractional, default) or optimizer steps")
    parser.add_argument("--band", choices=tuple(BANDS), default="quartiles",
                        help="curves: band over seeds, 25-75%% quantiles (default) or the min-max range")
    parser.add_argument("--loss", action="store_true", help="curves: add a row of the epoch-end train loss")
    parser.add_argument("--title", default=None, help="figure title")
    parser.set_defaults(func=run_cli)


def run_cli(args) -> int:
    rows = load_rows(args.stores)
    if args.seeds is not None:
        rows = rows_of_seeds(rows, parse_seeds(args.seeds))
    drawn = make_plot(rows, kind=args.kind, out=args.out, x=args.x, y=args.y, where=args.where,
                      which=args.which, metric=args.metric, scale=args.scale, title=args.title,
                      curve_x=args.curve_x, band=args.band, loss=args.loss)
    for note in drawn.notes:
        print(f"note: {note}")
    print(f"wrote {drawn.path}")
    return 0
