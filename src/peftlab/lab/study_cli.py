"""``peftlab study lambda|kasa`` and ``peftlab study --spec my.yaml``: the command line of a study, whose design
is a spec file (:mod:`peftlab.lab.study_spec`). An option the spec does not take is refused, never ignored; the
fixed-rate protocol's flags say where it went (``studies/fixed_rate`` beside the package).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from peftlab.argtypes import assignments, nonnegative_int, output_folder, positive_float, positive_int, text
from peftlab.config import ROLES, TrainConfig, add_dataclass_flags
from peftlab.errors import PeftlabError
from peftlab.lab import study_protocol as sp
from peftlab.lab.study_plan import resolved_run
from peftlab.lab.study_spec import load_study_spec, shipped, spec_for

# the design's own keys, and those every run of a sweep sets itself (the config's run-managed options)
DESIGN_SET = ("lr", "lr_ratio", "seed", "task", "eval_steps", "head_lr", "selection_samples", "early_stop_patience",
              "early_stop_min_delta", *ROLES.run_managed)
# the options a spec may take (its `options:`), as flags: dest -> add_argument's keywords
DESIGN_OPTIONS = {
    "ratios": dict(type=text, help="the swept values beside the baseline (lambda: default 2,4,8)"),
    "rows": dict(type=text, help="the rows to compare (kasa default head,lora,pissa,milora,dora,kasa,kasa-reference)"),
    "no_key_ablation": dict(action="store_true", help="skip the W_k ({q,k,v}) ablation"),
    "key_seeds": dict(type=positive_int, help="held-out seeds of the W_k ablation (default 20: about +-2 points)"),
    "no_paper_arms": dict(action="store_true",
                          help="leave out the arms at the authors' per-task settings (kasa: the 2 x 2)"),
}
# flags of the fixed-rate protocol that `peftlab study` still knows, to say where that protocol went (train's
# --lr and --head-lr, and the removed design options, hidden from --help)
FIXED_RATE_FLAGS = ("lr", "head_lr")
REMOVED_FLAGS = ("lr_grid", "diagonal", "top_k", "plateau_epochs", "plateau_seeds", "evals_per_epoch", "no_search",
                 "long_epochs", "long_seeds")
MOVED = "python -m studies.fixed_rate lambda|kasa in a source checkout (docs/study/lambda/REPORT.md's command)"
# `peftlab train` options every study takes, as their declarations spell, check and document them. Study's own,
# though a TrainConfig field has the name: --task (a comma list: each task studied on its own), --output-dir (the
# study's folder, not a run's).
TRAIN_FLAGS = ("model", "targets", "epochs", "max_train_samples", "max_eval_samples", "selection_samples", "method")
TRAIN_DEFAULTS = {"epochs": 20, "max_train_samples": 1000, "selection_samples": 500, "method": None}
# the protocol's knobs: a flag beats the spec's `options:`, which beats the default. The early-stopping ones are
# spelled shorter than train's (--early-stop-patience).
PROTOCOL_OPTIONS = {
    "patience": (positive_int, 3, "evaluated epochs without a selection gain before a run stops"),
    "min_delta": (float, 0.002, "the selection gain that counts (in metric units: 0.002 is 0.2 points)"),
    "rate_centre": (positive_float, None, "every row's search centred here"),
    "grid_factor": (float, 2.0, "rates this far apart"),
    "grid_width": (positive_int, 1, "grid points each side of the centre"),
    "max_extensions": (nonnegative_int, 3, "points added past an edge where the best rate sits alone (no tie)"),
    "selection_seeds": (nonnegative_int, 2, "seeds every choice is made on"),
    "heldout_seeds": (positive_int, 10, "seeds no selection used"),
    "heldout_seed_start": (int, 100, "first held-out seed"),
    "equivalence_margin": (positive_float, 1.0, "TOST margin in table points (accuracy x100) for 'loses nothing' "
                                                "claims"),
}


def add_parser(sub) -> None:
    specs = shipped()
    p = sub.add_parser(
        "study", help="check Yao et al.'s lambda claim or KaSA's (or your own design) on your model and data",
        description="A whole study in one command, into one folder with the store, tables, figures and REPORT.md, "
                    "resumable. The design is a spec file: lambda (eta_V = lambda * eta_QK, each lambda with its "
                    "own eta_QK, against lambda 1), kasa (KaSA against its baselines, each at its own rate, and at "
                    "the paper's settings), or --spec my.yaml. Every row gets its own learning-rate search on "
                    "selection seeds, trains to its plateau (--epochs is the cap of early stopping), and is scored "
                    "on the dev set as a test split no choice read, on held-out seeds, paired.")
    p.add_argument("study_kind", nargs="?", choices=tuple(specs), default=None,
                   help="a shipped design (or --spec): " + "; ".join(f"{name}: {load_study_spec(path).help}"
                                                                     for name, path in specs.items()))
    p.add_argument("--spec", default=None, metavar="STUDY.yaml",
                   help="your own design (copy src/peftlab/lab/studies/kasa.yaml)")
    p.add_argument("--protocol", choices=("fair", "fixed-rate"), default="fair",
                   help="fair (the only one here); fixed-rate moved: " + MOVED)
    p.add_argument("--task", required=True, help="task(s), comma-separated: each is studied on its own")
    add_dataclass_flags(p, TrainConfig, only=TRAIN_FLAGS, defaults=TRAIN_DEFAULTS)
    for dest, (kind, default, help_text) in PROTOCOL_OPTIONS.items():
        shown = "each method's own default rate" if default is None else default
        p.add_argument("--" + dest.replace("_", "-"), type=kind, default=None, help=f"{help_text} (default {shown})")
    p.add_argument("--config", default=None, metavar="BASE.yaml",
                   help="train keys every run shares (any `peftlab train` key but the design's own)")
    p.add_argument("--set", type=assignments, default=None, metavar="K=V,...", dest="set_keys",
                   help='more shared train keys, e.g. "rank=16,alpha=32,pooling=auto"')
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="runs at once, one process each (default: the CPU count)")
    p.add_argument("--output-dir", type=output_folder, default=None,
                   help="the study folder (default runs/study/<kind>-<model>-<tasks>)")
    p.add_argument("--dry-run", action="store_true", help="print the design and plan; run nothing")
    p.add_argument("--report-only", action="store_true", help="rewrite the tables, figures and REPORT.md")
    from peftlab.lab.ray_backend import add_backend_flags

    add_backend_flags(p)  # --backend ray: every run a Ray task (a cluster); --workers is then Ray's to place
    for dest, keywords in DESIGN_OPTIONS.items():
        p.add_argument("--" + dest.replace("_", "-"), default=None, **keywords)
    for dest in (*FIXED_RATE_FLAGS, *REMOVED_FLAGS):  # given, one line says where the fixed-rate protocol went
        p.add_argument("--" + dest.replace("_", "-"), nargs="?", const=True, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run_cli)


def spec_defaults(args, spec) -> None:
    """Refuse the options the spec does not take; fill in the spec's defaults."""
    options = spec.section.options
    unknown = sorted(set(options) - {*DESIGN_OPTIONS, "method", *PROTOCOL_OPTIONS})
    if unknown:
        raise PeftlabError(f"options: '{unknown[0]}' is not an option a study spec can set", where=str(spec.path),
                           fix="use one of " + ", ".join(sorted({*DESIGN_OPTIONS, "method", *PROTOCOL_OPTIONS})))
    for dest in (*DESIGN_OPTIONS, "method"):  # train's --method: a design option where the spec names it
        if dest not in options and getattr(args, dest, None) not in (None, False):
            raise PeftlabError(f"--{dest.replace('_', '-')} is not an option of study {spec.name}",
                               where=str(spec.path), fix="drop it; the design takes "
                               + (", ".join("--" + o.replace("_", "-") for o in sorted(options)) or "none"))
    for dest, value in options.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, spec_value(spec, dest, value))
    for dest, (_, default, _) in PROTOCOL_OPTIONS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)


def spec_value(spec, dest: str, value):
    """A protocol knob from the spec's `options:`, checked as its flag is."""
    if dest not in PROTOCOL_OPTIONS or value is None:
        return value
    try:
        return PROTOCOL_OPTIONS[dest][0](str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
        raise PeftlabError(f"options: {dest}: {err}", where=str(spec.path), fix="give a value its flag takes, "
                           f"as in --{dest.replace('_', '-')}") from None


def shared_base(args) -> dict:
    from peftlab.config import TrainConfig, load_yaml, normalise_keys
    from peftlab.lab.records import parse_filter

    base: dict = {}
    if args.config:
        base.update(normalise_keys(TrainConfig, load_yaml(args.config), args.config))
    base.update(parse_filter(args.set_keys, what="--set"))
    clash = [k for k in base if k in DESIGN_SET]
    if clash:
        raise PeftlabError(f"'{clash[0]}' is set by the study design, not by --config/--set",
                           fix="the design chooses rates, seeds, splits, tasks and folders; drop it")
    base.update(model=args.model, targets=",".join(args.targets), epochs=args.epochs,
                max_train_samples=args.max_train_samples)
    base.setdefault("report_to", "none")  # hundreds of runs: no event files (the store holds every number)
    if args.max_eval_samples is not None:
        base["max_eval_samples"] = args.max_eval_samples
    if args.method is not None:
        base["method"] = args.method
    return base


def study_tasks(args) -> tuple[str, ...]:
    tasks = tuple(dict.fromkeys(t.strip().lower() for t in args.task.split(",") if t.strip()))
    if not tasks:
        raise PeftlabError("--task is empty", fix="e.g. --task sst2 or --task sst2,stsb")
    return tasks


def names(value: str) -> list[str]:
    return [p.strip() for p in str(value).split(",") if p.strip()]


def refuse_fixed_rate(args) -> None:
    """The fixed-rate protocol's flags say where it went, before anything else is read."""
    shared = next((d for d in FIXED_RATE_FLAGS if getattr(args, d, None) is not None), None)
    if shared:
        raise PeftlabError(f"--{shared.replace('_', '-')} is an option of the fixed-rate protocol (one shared rate), "
                           "not of a study that searches each row's rate", fix=f"drop it; that protocol: {MOVED}")
    removed = next((d for d in REMOVED_FLAGS if getattr(args, d, None) is not None), None)
    if args.protocol == "fixed-rate" or removed:
        flag = f"--{removed.replace('_', '-')} belongs to " if removed else ""
        raise PeftlabError(f"{flag}the fixed-rate protocol, which moved out of the installed package",
                           where="peftlab study", fix=f"run {MOVED}")


def design_from_args(args) -> sp.Design:
    """The study's design; every run config checked before anything runs."""
    refuse_fixed_rate(args)
    spec = spec_for(args.study_kind, args.spec)
    spec_defaults(args, spec)
    if args.epochs == 0:  # train's declaration takes 0 (evaluate the untrained model); a study compares training
        raise PeftlabError("--epochs 0: a study trains every run", fix="give --epochs 1 or more, or leave it out")
    base, tasks = shared_base(args), study_tasks(args)
    protocol = sp.Protocol(selection_samples=args.selection_samples, patience=args.patience,
                           min_delta=args.min_delta, selection_seeds=args.selection_seeds,
                           grid_factor=args.grid_factor, grid_width=args.grid_width,
                           max_extensions=args.max_extensions)
    section = spec.section
    key_seeds = getattr(args, "key_seeds", None) or 20
    # the seeds before anything is resolved: a bad seed is its own one-line error, not whatever comes next
    sp.check_seeds(args.heldout_seed_start, max(args.heldout_seeds, key_seeds if section.key_ablation else 0),
                   protocol.selection_seeds)
    design = sp.Design(spec.name, tasks, base, fair_rows(args, section, base, tasks), protocol,
                       heldout_seeds=args.heldout_seeds, heldout_seed_start=args.heldout_seed_start,
                       key_seeds=key_seeds, equivalence_margin=args.equivalence_margin,
                       paper_arms=bool(section.paper_arms) and not args.no_paper_arms,
                       key_ablation=section.key_ablation and not args.no_key_ablation, spec=spec)
    check_configs(design)
    return design


def fair_rows(args, section, base: dict, tasks: tuple[str, ...]) -> tuple[sp.Row, ...]:
    """The spec's rows, each centred on --rate-centre or the rate `peftlab train` resolves for it: a row per value
    of the swept option (the baseline first), or the named rows of --rows."""

    def centre(keys: dict) -> float:
        if args.rate_centre is not None:
            return args.rate_centre
        config = {**base, "task": tasks[0], "method": keys.get("method", base.get("method"))}
        return float(resolved_run(config).optim.lr)  # head-only: resolved to its head's rate

    swept = section.swept
    if swept:
        flag = "--" + swept["option"].replace("_", "-")
        values = sp.float_list(names(getattr(args, swept["option"])), flag)
        values = (float(swept["baseline"]),) + tuple(v for v in values if v != swept["baseline"])
        return tuple(sp.Row(swept["name"].format(v), {swept["key"]: v}, centre({})) for v in values)
    chosen = names(args.rows)
    unknown_rows = [r for r in chosen if r not in section.rows]
    if unknown_rows:
        from peftlab.errors import unknown

        raise unknown(f"{args.study_kind or 'study'} row", unknown_rows[0], section.rows, where="--rows")
    return tuple(sp.Row(n, section.rows[n], centre(section.rows[n])) for n in dict.fromkeys(chosen))


def check_configs(design) -> None:
    """Every row's first config built once (bad keys and values fail here, before anything runs); a task whose
    metric is lower-is-better refused (picks, searches and verdicts assume higher is better)."""
    from peftlab.lab.preflight_cells import study_first_configs
    from peftlab.resolve import refuse_unused_options
    from peftlab.tasks.table import LOWER_IS_BETTER, primary_metric

    methods = set()
    for task in design.tasks:
        for config in study_first_configs(design, task):
            cfg = resolved_run(config, f"study {task}", check_inputs=True)
            methods.add(cfg.method)
        metric = primary_metric(cfg.task, getattr(cfg, "metric", None))  # a user task's --metric
        if metric in LOWER_IS_BETTER:
            raise PeftlabError(f"task '{task}' is scored by {metric} (lower is better), which a study cannot pick on",
                               fix="study a task with a higher-is-better metric (accuracy, F1, correlation)")
    refuse_unused_options(design.base, methods, where="--config/--set")


def default_output_dir(design) -> Path:
    model = str(design.base["model"]).replace("/", "_")
    return Path("runs") / "study" / f"{design.kind}-{model}-{'_'.join(design.tasks)}"


def run_cli(args) -> int:
    from peftlab.lab import ray_backend
    from peftlab.lab.preflight_cells import check_study
    from peftlab.lab.store import STORE_NAME
    from peftlab.lab.study_plan import StudyPaths

    ray_backend.check_backend_args(args)  # before --dry-run too: a Ray flag without --backend ray is a mistake
    design = design_from_args(args)
    root = Path(args.output_dir) if args.output_dir else default_output_dir(design)
    paths = StudyPaths(root=root, store=root / STORE_NAME)
    if args.dry_run:
        return dry_run(design, paths, args)
    if args.report_only:
        return report_only(design, paths)
    options = ray_backend.RayOptions.from_args(args) if args.backend == "ray" else None
    check_study(design, root, args)  # data, models, extras, the folder and its room: before any stage runs
    from peftlab.lab.study import run_fair_study

    run_fair_study(design, paths, workers=args.workers, ray_options=options)
    return 0


def dry_run(design, paths, args) -> int:
    from peftlab.lab.preflight_cells import check_study, print_findings
    from peftlab.lab.study_fair import plan_lines

    print(f"study {design.kind} on {', '.join(design.tasks)} ({design.base['model']}), folder {paths.root}")
    print("\n".join(plan_lines(design, {t: split_text(design, t) for t in design.tasks})))
    return print_findings(check_study(design, paths.root, args, dry_run=True))  # its problems: exit 2


def report_only(design, paths) -> int:
    from peftlab.lab.study_fair_report import write_fair_report
    from peftlab.lab.study_plan import save_fair_plan

    if not paths.plan.is_file():
        raise PeftlabError(f"no study in {paths.root} yet (no {paths.plan.name})", fix="run the study first")
    save_fair_plan(paths, design)  # refuses a folder planned with other settings
    print(f"report: {write_fair_report(paths, design)}")
    return 0


def split_text(design: sp.Design, task: str) -> str:
    """The three splits of a task as its runs will draw them (read from its data, nothing trained)."""
    from peftlab.tasks import data_files as data

    data_dir = design.base.get("data_dir")
    train = len(data.load_split(task, "train", data_dir))
    tests = {split: len(data.load_split(task, split, data_dir)) for split in data.available_eval_splits(task, data_dir)}
    test_n = sum(min(n, design.base.get("max_eval_samples") or n) for n in tests.values())
    pool = train - design.protocol.selection_samples
    each = min(pool, design.base.get("max_train_samples") or pool)
    return (f"training pool {pool} of {train} (each seed draws {each}); selection {design.protocol.selection_samples} "
            f"carved out of the training split (stratified, --eval-seed 0), disjoint from every training subset; "
            f"test: the dev set, {test_n} examples ({', '.join(tests)}), read only for the reported numbers")
