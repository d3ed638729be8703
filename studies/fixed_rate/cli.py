"""``python -m studies.fixed_rate lambda|kasa``: the fixed-rate study designs, run, planned or reported again.

The earlier designs of ``peftlab study`` (one shared rate, a fixed number of epochs, the dev set both choosing and
reporting), kept beside the package so that the committed stores made with them (docs/study/lambda,
docs/study/kasa) still report: their REPORT.md's own command rewrites it from the store (``--report-only``). The
design's options and defaults are its spec file (``lambda.yaml``, ``kasa.yaml`` beside this module); an option the
design does not take is refused, never ignored. ``peftlab study`` runs the fair protocol.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from peftlab.argtypes import assignments, nonnegative_int, output_folder, positive_float, positive_int, text
from peftlab.cli.main import OneLineParser
from peftlab.config import TrainConfig, add_dataclass_flags
from peftlab.errors import USER_ERROR_EXIT, PeftlabError, closest
from peftlab.lab.study_cli import names, shared_base, study_tasks
from peftlab.lab.study_plan import StudyPaths
from peftlab.lab.study_protocol import float_list
from studies.fixed_rate import design as sd

# the options a design may take (its spec's `options:`), as flags: dest -> (type or action, help)
DESIGN_OPTIONS = {
    "ratios": (text, "lambda values beside lambda 1 (default 2,4,8,16)"),
    "rows": (text, "the rows to compare (kasa default head,lora,pissa,milora,kasa,kasa-paper)"),
    "no_key_ablation": ("store_true", "skip the W_k ({q,k,v}) ablation"),
    "lr_grid": (text, "eta_QK of the lambda > 1 cells"),
    "diagonal": (text, "lambda = 1 at these rates"),
    "top_k": (positive_int, "candidates a naive search re-seeds (recorded; scripts/tune_vs_grid.py)"),
    "plateau_epochs": (nonnegative_int, "the plateau arm"),
    "plateau_seeds": (nonnegative_int, "the plateau arm's seeds"),
    "evals_per_epoch": (positive_int, "the plateau arm's dev evaluations per epoch"),
    "no_search": ("store_true", "no tune comparison in the study (always so now: it is scripts/tune_vs_grid.py; "
                                "the flag stays in the committed stores' commands)"),
    "long_epochs": (nonnegative_int, "the spec's long rows (kasa: LoRA and paper-KaSA) this long"),
    "long_seeds": (nonnegative_int, "the long rows' seeds"),
}
TRAIN_FLAGS = ("model", "targets", "epochs", "max_train_samples", "max_eval_samples", "method", "lr", "head_lr")


PROG = "python -m studies.fixed_rate"


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[1])
    p.add_argument("study_kind", choices=("lambda", "kasa"))
    p.add_argument("--task", required=True, help="task(s), comma-separated: each is studied on its own")
    add_dataclass_flags(p, TrainConfig, only=TRAIN_FLAGS,
                        defaults={"epochs": 2, "max_train_samples": 1000, "method": None})
    p.add_argument("--selection-seeds", type=nonnegative_int, default=None,
                   help="lambda: seeds the grid picks on (default 3; 0: confirmatory)")
    p.add_argument("--config", default=None, metavar="BASE.yaml", help="train keys every run shares")
    p.add_argument("--set", type=assignments, default=None, metavar="K=V,...", dest="set_keys",
                   help="more shared train keys")
    p.add_argument("--heldout-seeds", type=positive_int, default=10, help="seeds no selection used (default 10)")
    p.add_argument("--heldout-seed-start", type=int, default=100, help="first held-out seed (default 100)")
    p.add_argument("--equivalence-margin", type=positive_float, default=1.0,
                   help="TOST margin in table points for 'loses nothing' claims (default 1)")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1, help="runs at once")
    p.add_argument("--output-dir", type=output_folder, default=None,
                   help="the study folder (default runs/study/<kind>-<model>-<tasks>)")
    p.add_argument("--dry-run", action="store_true", help="print the design and plan; run nothing")
    p.add_argument("--report-only", action="store_true", help="rewrite the figures, verdicts.json and REPORT.md")
    for dest, (kind, help_text) in DESIGN_OPTIONS.items():
        flag = "--" + dest.replace("_", "-")
        if kind == "store_true":
            p.add_argument(flag, action="store_true", default=None, help=help_text)
        else:
            p.add_argument(flag, type=kind, default=None, help=help_text)
    return p


def spec_defaults(args, spec: sd.FixedSpec) -> None:
    """Refuse the options the design does not take; fill in its defaults (in place)."""
    for dest in (*DESIGN_OPTIONS, "method", "lr", "head_lr"):
        if dest not in spec.options and getattr(args, dest, None) not in (None, False):
            raise PeftlabError(f"--{dest.replace('_', '-')} is not an option of the fixed-rate {spec.name} study",
                               fix="drop it; it takes " + ", ".join("--" + o.replace("_", "-")
                                                                    for o in sorted(spec.options)))
    for dest, default in spec.options.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, default)


def design_from_args(args) -> sd.Design:
    spec = sd.load_spec(args.study_kind)
    if spec.shape == "rows" and args.selection_seeds is not None:
        raise PeftlabError(f"--selection-seeds: the fixed-rate {spec.name} study runs every row on the held-out "
                           "seeds", fix="drop it")
    if args.top_k is not None and not args.no_search:
        raise PeftlabError("--top-k sized the study's tune comparison, which is now python scripts/tune_vs_grid.py",
                           fix="run that script for the comparison, or drop --top-k (with --no-search, as in the "
                               "committed stores' commands, it is only recorded in plan.json)")
    spec_defaults(args, spec)
    base, tasks = shared_base(args), study_tasks(args)
    common = dict(tasks=tasks, heldout_seeds=args.heldout_seeds, heldout_seed_start=args.heldout_seed_start,
                  equivalence_margin=args.equivalence_margin, spec=spec)
    if spec.shape == "grid":
        rates = "5e-4,1e-3,2e-3"  # the example a bad rate list's fix gives
        return sd.Design(spec.name, base=base, lr_grid=float_list(names(args.lr_grid), "--lr-grid", rates),
                         ratios=float_list(names(args.ratios), "--ratios"),
                         diagonal=float_list(names(args.diagonal), "--diagonal", rates),
                         selection_seeds=3 if args.selection_seeds is None else args.selection_seeds,
                         top_k=args.top_k, plateau_epochs=args.plateau_epochs, plateau_seeds=args.plateau_seeds,
                         evals_per_epoch=args.evals_per_epoch, key_ablation=not args.no_key_ablation,
                         search_comparison=False, **common)
    base.update({key: getattr(args, key) for key in ("lr", "head_lr") if getattr(args, key) is not None})
    return sd.Design(spec.name, base=base, selection_seeds=0, rows=tuple(names(args.rows)),
                     long_epochs=args.long_epochs, plateau_epochs=0, plateau_seeds=args.long_seeds, **common)


def first_configs(design: sd.Design, task: str) -> list[dict]:
    """Each stage's distinct first configs of a task."""
    if design.shape == "grid":
        return sd.grid_configs(design, task)[:len(sd.grid_cells(design))]
    return sd.kasa_configs(design, task)[:len(design.rows) + 1]


def check_configs(design: sd.Design) -> None:
    """Every stage's first configs resolved once: bad keys and values fail here, before anything runs."""
    from peftlab.config import normalise_keys
    from peftlab.resolve import resolve_config

    for task in design.tasks:
        for config in first_configs(design, task):
            resolve_config(TrainConfig.from_dict(normalise_keys(TrainConfig, config, f"study {task}")))


def preflight(design: sd.Design, root: Path, args, stages) -> list:
    """peftlab's preflight of the study's data, models, folder and disk room, before anything runs."""
    from peftlab.lab.preflight_cells import check_planned_study

    configs = [config for task in design.tasks for config in first_configs(design, task)]
    return check_planned_study(configs, sum(s.runs for s in stages), root, args, dry_run=args.dry_run)


def run(argv: list[str]) -> int:
    from peftlab.lab.store import STORE_NAME
    from studies.fixed_rate.plan import Plan, load_or_save_plan, plan_stages

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        flag = next((a for a in extra if a.startswith("-")), extra[0]).split("=", 1)[0]
        raise PeftlabError(f"unknown flag '{flag}'{closest(flag, list(parser._option_string_actions))}",
                           where=PROG, fix=f"see `{PROG} --help`")
    design = design_from_args(args)
    model = str(design.base["model"]).replace("/", "_")
    root = Path(args.output_dir or Path("runs") / "study" / f"{design.kind}-{model}-{'_'.join(design.tasks)}")
    paths = StudyPaths(root=root, store=root / STORE_NAME)
    if args.report_only:
        from studies.fixed_rate.report import write_report

        if not paths.plan.is_file():
            raise PeftlabError(f"no study in {root} yet (no {paths.plan.name})", fix="run the study first")
        print(f"report: {write_report(paths, load_or_save_plan(paths, design))}")
        return 0
    check_configs(design)
    stages = plan_stages(design)
    if args.dry_run:
        from peftlab.lab.preflight_cells import print_findings

        print(f"study {design.kind} (fixed-rate) on {', '.join(design.tasks)} ({design.base['model']}), folder "
              f"{root}\n{Plan(stages, None, args.workers).describe()}")
        return print_findings(preflight(design, root, args, stages))
    preflight(design, root, args, stages)
    from studies.fixed_rate.run import run_study

    run_study(design, paths, workers=args.workers)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except SystemExit as done:  # the parser's own: --help (0), or a bad value already printed in one line (2)
        return int(done.code or 0)
    except PeftlabError as err:
        for line in err.lines():  # one line per problem (the preflight may find several)
            print(f"peftlab: error: {line}", file=sys.stderr)
        return USER_ERROR_EXIT
