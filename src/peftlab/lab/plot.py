"""``peftlab plot STORE --kind heatmap|sigma|curves|rank --out FILE.png``: figures from a results store.

* ``heatmap``: a metric over two config keys (``--x lr --y lr_ratio`` by default; ``--y v_lr`` is
  lr * lr_ratio, i.e. eta_QK x eta_V as in Yao et al. Figure 1), mean over seeds, one panel per task (and
  per combination of any other key that varies), one colour scale per task; red box: the best cell (the lowest
  for metrics in ``peftlab.tasks.table.LOWER_IS_BETTER``). Cells with diverged/collapsed/failed runs are marked
  (``[status]``); a cell with only such runs is grey and names them. When --x or --y takes one value in every
  task, the panels fold into one per task with the configs as rows.
* ``sigma``: what training did to KaSA's Delta_sigma per layer and projection (KaSA Figure 4): result.json's
  ``kasa_sigma - kasa_sigma_init`` (learned minus initial values; the random init would otherwise dominate),
  averaged over the selected runs (seeds), one symmetric colour scale for all panels. Runs of an older peftlab
  without ``kasa_sigma_init`` are drawn as Delta_sigma itself, their panel titles saying so.
* ``curves``: the metric per epoch and the train loss of the selected runs (``--where``), mean ± std over
  seeds per config; runs that did not end ok are drawn on their own, dashed.
* ``rank``: the metric against ``--x`` (default rank), one line per other varying config, mean ± std.

Figures are drawn with matplotlib's Agg backend and constrained layout, titles wrapped to the figure's width, and
saved uncropped (:func:`make_figure` returns the Figure, :func:`save_figure` writes it); the file type follows
``--out``'s suffix (png, pdf, svg). Each kind lives in its own module (``figures_heatmap``, ``figures_sigma``,
``figures_lines``; shared layout helpers in ``figures``); all read run records (``peftlab.lab.records``) only.
"""

from __future__ import annotations

from pathlib import Path

from peftlab.errors import PeftlabError
from peftlab.lab.figures import check_key, pyplot
from peftlab.lab.figures_heatmap import plot_heatmap
from peftlab.lab.figures_lines import plot_curves, plot_rank
from peftlab.lab.figures_sigma import plot_sigma
from peftlab.lab.records import auto_scale, collect, load_rows, parse_filter

KINDS = ("heatmap", "sigma", "curves", "rank")
SUFFIXES = (".png", ".pdf", ".svg")


def save_figure(fig, out: str | Path, *, close: bool = True) -> Path:
    """Write ``fig`` to ``out`` (type from the suffix) as laid out: its whole canvas, no cropping, at ``DPI``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=fig.dpi)
    if close:
        pyplot().close(fig)
    return out


def make_figure(rows: list[dict], *, kind: str, x: str | None = None, y: str | None = None, where: str | None = None,
                which: str = "best", metric: str | None = None, scale: float | None = None,
                title: str | None = None):
    """The matplotlib Figure of one ``peftlab plot`` (constrained layout; :func:`save_figure` writes it)."""
    if kind not in KINDS:
        raise PeftlabError(f"unknown --kind '{kind}'", fix=f"use one of {', '.join(KINDS)}")
    filters = parse_filter(where)
    records, _ = collect(rows, which=which, metric=metric, where=filters)
    if not records:
        raise PeftlabError("no finished runs in the store" + (" match --where" if filters else ""),
                           fix="run the sweep first, or loosen --where")
    if scale is None:
        scale = auto_scale(r.metric for r in records)
    if kind == "heatmap":
        x, y = x or "lr", y or "lr_ratio"
        check_key(x, "--x")
        check_key(y, "--y")
        if x == y:
            raise PeftlabError("--x and --y must differ")
        return plot_heatmap(records, x=x, y=y, scale=scale, title=title)
    if kind == "sigma":
        return plot_sigma(records, title=title)
    if kind == "curves":
        return plot_curves(records, scale=scale, title=title)
    x = x or "rank"
    check_key(x, "--x")
    return plot_rank(records, x=x, scale=scale, title=title)


def make_plot(rows: list[dict], *, kind: str, out: str | Path, x: str | None = None, y: str | None = None,
              where: str | None = None, which: str = "best", metric: str | None = None, scale: float | None = None,
              title: str | None = None) -> Path:
    """:func:`make_figure` written to ``out`` (.png, .pdf or .svg)."""
    if kind not in KINDS:
        raise PeftlabError(f"unknown --kind '{kind}'", fix=f"use one of {', '.join(KINDS)}")
    out = Path(out)
    if out.suffix.lower() not in SUFFIXES:
        raise PeftlabError(f"--out must end in {', '.join(SUFFIXES)}, got '{out.name}'")
    fig = make_figure(rows, kind=kind, x=x, y=y, where=where, which=which, metric=metric, scale=scale, title=title)
    return save_figure(fig, out)


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "plot", help="figures from a results store: heatmap, KaSA sigma, learning curves, metric vs rank",
        description="heatmap: metric over --x/--y (default lr x lr_ratio; v_lr = lr*lr_ratio) per task; "
                    "sigma: what training changed in KaSA's Delta_sigma (learned - init) per layer/projection; "
                    "curves: metric and loss per epoch; rank: metric vs --x (default rank).")
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
