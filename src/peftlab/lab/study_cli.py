"""``peftlab study lambda|kasa``: the command line of a study (the protocol, its options, --dry-run, --report-only).

Two protocols. ``fair`` (the default, :mod:`peftlab.lab.study_protocol`): every row at its own searched
learning rate, trained to its plateau (early stopping on a selection split carved out of the training data),
scored on the dev set as a test split no choice read, on held-out seeds. ``fixed-rate``: the earlier designs
(:mod:`peftlab.lab.study_design`: one shared rate, a fixed number of epochs, the dev set both choosing and
reporting), kept so that the committed stores made with them still report; its options are refused under
``fair`` and the other way round, so that no flag is silently ignored.
"""

from __future__ import annotations

import os
from pathlib import Path

from peftlab.argtypes import assignments, nonnegative_int, output_folder, positive_float, positive_int, text
from peftlab.config import ROLES
from peftlab.errors import PeftlabError
from peftlab.lab import study_design as sd
from peftlab.lab import study_protocol as sp
from peftlab.lab.study import Study, run_fair_study, run_study, save_fair_plan
from peftlab.lab.study_plan import Plan, StudyPaths, load_or_save_plan, plan_stages

# the design's own keys, and those every run of a sweep sets itself (the config's run-managed options)
DESIGN_SET = ("lr", "lr_ratio", "seed", "task", "eval_steps", "head_lr", "selection_samples", "early_stop_patience",
              "early_stop_min_delta", *ROLES.run_managed)
# options of one protocol only (default None: given under the other, they are refused, never ignored), and
# their defaults where they apply
FIXED_ONLY = {"lr_grid": "5e-4,1e-3,2e-3", "diagonal": "5e-4,1e-3,2e-3,4e-3,8e-3", "top_k": 2, "plateau_epochs": 6,
              "plateau_seeds": 5, "evals_per_epoch": 4, "no_search": False, "lr": None, "head_lr": None,
              "long_epochs": 0, "long_seeds": 5, "budget_hours": None}
FAIR_ONLY = {"selection_samples": 500, "patience": 3, "min_delta": 0.002, "grid_factor": 2.0, "grid_width": 1,
             "max_extensions": 3, "key_seeds": 20, "no_paper_arms": False, "rate_centre": None}
# options of both whose default depends on the protocol
BY_PROTOCOL = {"epochs": {"fair": 20, "fixed-rate": 2}, "selection_seeds": {"fair": 2, "fixed-rate": 3},
               "ratios": {"fair": "2,4,8", "fixed-rate": "2,4,8,16"},
               "rows": {"fair": ",".join(sp.KASA_ROWS), "fixed-rate": ",".join(sd.KASA_ROWS)}}


def _float_list(text: str) -> tuple[float, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "study", help="check Yao et al.'s lambda claim or KaSA's on your model and data, as a reviewer would",
        description="A whole study in one command, into one folder with the store, tables, figures and REPORT.md, "
                    "resumable. Default protocol (fair): every row (a method, a lambda) gets its own learning-rate "
                    "search on selection seeds (x2 apart around its default, extended past an edge), trains to its "
                    "plateau (early stopping on a selection split carved out of the training data), and is scored "
                    "on the dev set as a test split no choice read, on held-out seeds, paired. --protocol "
                    "fixed-rate: the earlier designs (one shared rate, fixed epochs).")
    kinds = parser.add_subparsers(dest="study_kind", metavar="KIND", required=True)
    lam = kinds.add_parser("lambda", help="eta_V = lambda * eta_QK: each lambda with its own eta_QK, against lambda 1",
                           description="Yao et al.'s eta_V = lambda * eta_QK against its learning-rate control.")
    kasa = kinds.add_parser("kasa", help="KaSA against head-only, LoRA, PiSSA, MiLoRA, DoRA, each at its own rate, "
                                         "and at the paper's settings")
    for p in (lam, kasa):
        shared_options(p)
    lam.add_argument("--method", default="lora", help="lora (default), dora or full, or any method with q/v")
    lam.add_argument("--ratios", type=text, default=None,
                     help="lambda > 1 values (fair default 2,4,8: each a row beside lambda 1; fixed-rate 2,4,8,16)")
    lam.add_argument("--no-key-ablation", action="store_true", help="skip the W_k ({q,k,v}) ablation")
    lam.add_argument("--key-seeds", type=positive_int, default=None,
                     help="fair: held-out seeds of the W_k ablation (default 20: about +-2 points at 80%% power)")
    lam.add_argument("--lr-grid", type=text, default=None, help="fixed-rate: eta_QK of the lambda > 1 cells")
    lam.add_argument("--diagonal", type=text, default=None, help="fixed-rate: lambda = 1 at these rates")
    lam.add_argument("--top-k", type=positive_int, default=None, help="fixed-rate: candidates the search re-seeds")
    lam.add_argument("--plateau-epochs", type=nonnegative_int, default=None, help="fixed-rate: the plateau arm")
    lam.add_argument("--plateau-seeds", type=nonnegative_int, default=None, help="fixed-rate: the plateau arm's seeds")
    lam.add_argument("--evals-per-epoch", type=positive_int, default=None, help="fixed-rate: the plateau arm")
    lam.add_argument("--no-search", action="store_true", default=None, help="fixed-rate: no tune comparison")
    kasa.add_argument("--rows", type=text, default=None,
                      help=f"rows (fair default {BY_PROTOCOL['rows']['fair']}; fixed-rate "
                           f"{BY_PROTOCOL['rows']['fixed-rate']})")
    kasa.add_argument("--no-paper-arms", action="store_true", default=None,
                      help="fair: leave out LoRA and KaSA at the authors' per-task settings (the 2 x 2)")
    kasa.add_argument("--lr", type=positive_float, default=None, help="fixed-rate: the rows' shared rate")
    kasa.add_argument("--head-lr", type=positive_float, default=None, help="fixed-rate: the rows' head rate")
    kasa.add_argument("--long-epochs", type=nonnegative_int, default=None, help="fixed-rate: LoRA and KaSA this long")
    kasa.add_argument("--long-seeds", type=nonnegative_int, default=None, help="fixed-rate: the long rows' seeds")
    parser.set_defaults(func=run_cli)


def shared_options(p) -> None:
    p.add_argument("--protocol", choices=("fair", "fixed-rate"), default="fair",
                   help="fair (default): own rate per row, to the plateau, test split; fixed-rate: the earlier designs")
    p.add_argument("--model", default="minilm-l6", help="a registered model, a local folder or a Hub id")
    p.add_argument("--task", required=True, help="task(s), comma-separated: each is studied on its own")
    p.add_argument("--targets", default="q,v", help="projections the adapter tunes (default q,v)")
    p.add_argument("--epochs", type=positive_int, default=None,
                   help="fair: the epoch cap of early stopping (default 20); fixed-rate: every run's epochs (2)")
    p.add_argument("--max-train-samples", type=int, default=1000,
                   help="training examples per run, drawn with the run's seed (default 1000)")
    p.add_argument("--max-eval-samples", type=int, default=None,
                   help="a fixed subset of the dev (test) set, the same for every run (default: all of it)")
    p.add_argument("--selection-samples", type=positive_int, default=None,
                   help="fair: the selection split carved out of the training data (default 500)")
    p.add_argument("--patience", type=positive_int, default=None,
                   help="fair: evaluated epochs without a selection gain before a run stops (default 3)")
    p.add_argument("--min-delta", type=float, default=None,
                   help="fair: the selection gain that counts (default 0.002: 0.2 points)")
    p.add_argument("--rate-centre", type=positive_float, default=None,
                   help="fair: every row's search centred here (default: each method's own default rate)")
    p.add_argument("--grid-factor", type=float, default=None, help="fair: rates this far apart (default 2)")
    p.add_argument("--grid-width", type=positive_int, default=None,
                   help="fair: grid points each side of the centre (default 1: three rates)")
    p.add_argument("--max-extensions", type=nonnegative_int, default=None,
                   help="fair: points a search may add past an edge where its best rate sits (default 3)")
    p.add_argument("--selection-seeds", type=nonnegative_int, default=None,
                   help="seeds every choice is made on (fair default 2; fixed-rate lambda 3, 0: confirmatory)")
    p.add_argument("--config", default=None, metavar="BASE.yaml",
                   help="train keys every run shares (any `peftlab train` key but the design's own)")
    p.add_argument("--set", type=assignments, default=None, metavar="K=V,...", dest="set_keys",
                   help='more shared train keys, e.g. "rank=16,alpha=32,pooling=auto"')
    p.add_argument("--heldout-seeds", type=positive_int, default=10, help="seeds no selection used (default 10)")
    p.add_argument("--heldout-seed-start", type=int, default=100, help="first held-out seed (default 100)")
    p.add_argument("--equivalence-margin", type=positive_float, default=1.0,
                   help="TOST margin in table points (accuracy x100) for 'loses nothing' claims (default 1)")
    p.add_argument("--budget-hours", type=positive_float, default=None,
                   help="fixed-rate: fit the design to this wall time (from a pilot run)")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                   help="runs at once, one process each (default: the CPU count)")
    p.add_argument("--output-dir", type=output_folder, default=None,
                   help="the study folder (default runs/study/<kind>-<model>-<tasks>)")
    p.add_argument("--dry-run", action="store_true", help="print the design and plan; run nothing")
    p.add_argument("--report-only", action="store_true", help="rewrite the tables, figures and REPORT.md")
    from peftlab.lab.ray_backend import add_backend_flags

    add_backend_flags(p)  # --backend ray: every run a Ray task (a cluster); --workers is then Ray's to place


def protocol_defaults(args) -> None:
    """Refuse the other protocol's options; fill in this one's defaults (in place)."""
    fair = args.protocol == "fair"
    foreign, own = (FIXED_ONLY, FAIR_ONLY) if fair else (FAIR_ONLY, FIXED_ONLY)
    for dest in foreign:
        if getattr(args, dest, None) not in (None, False):
            raise PeftlabError(f"--{dest.replace('_', '-')} is an option of the "
                               f"{'fixed-rate' if fair else 'fair'} protocol, not of --protocol {args.protocol}",
                               fix="drop it" + (", or pass --protocol fixed-rate" if fair else ""))
    for dest, default in {**own, **{k: v[args.protocol] for k, v in BY_PROTOCOL.items()}}.items():
        if hasattr(args, dest) and getattr(args, dest) is None:
            setattr(args, dest, default)


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
    base.update(model=args.model, targets=args.targets, epochs=args.epochs, max_train_samples=args.max_train_samples)
    base.setdefault("report_to", "none")  # hundreds of runs: no event files (the store holds every number)
    if args.max_eval_samples is not None:
        base["max_eval_samples"] = args.max_eval_samples
    return base


def study_tasks(args) -> tuple[str, ...]:
    tasks = tuple(dict.fromkeys(t.strip().lower() for t in args.task.split(",") if t.strip()))
    if not tasks:
        raise PeftlabError("--task is empty", fix="e.g. --task sst2 or --task sst2,stsb")
    return tasks


def design_from_args(args):
    """The study's design: a :class:`peftlab.lab.study_protocol.Design` (fair) or a
    :class:`peftlab.lab.study_design.Design` (fixed-rate); every run config checked before anything runs."""
    if args.protocol == "fixed-rate" and args.study_kind == "kasa" and args.selection_seeds is not None:
        raise PeftlabError("--selection-seeds: the fixed-rate kasa study runs every row on the held-out seeds",
                           fix="drop it, or use the fair protocol (the default)")
    protocol_defaults(args)
    base, tasks = shared_base(args), study_tasks(args)
    if args.protocol == "fair":
        design = fair_design(args, base, tasks)
        check_fair_configs(design)
        return design
    common = dict(tasks=tasks, heldout_seeds=args.heldout_seeds, heldout_seed_start=args.heldout_seed_start,
                  equivalence_margin=args.equivalence_margin)
    if args.study_kind == "lambda":
        base["method"] = args.method
        design = sd.Design("lambda", base=base, lr_grid=sd.float_list(_float_list(args.lr_grid), "--lr-grid"),
                           ratios=sd.float_list(_float_list(args.ratios), "--ratios"),
                           diagonal=sd.float_list(_float_list(args.diagonal), "--diagonal"),
                           selection_seeds=args.selection_seeds, top_k=args.top_k,
                           plateau_epochs=args.plateau_epochs, plateau_seeds=args.plateau_seeds,
                           evals_per_epoch=args.evals_per_epoch, key_ablation=not args.no_key_ablation,
                           search_comparison=not args.no_search, **common)
    else:
        for key in ("lr", "head_lr"):
            if getattr(args, key) is not None:
                base[key] = getattr(args, key)
        design = sd.Design("kasa", base=base, selection_seeds=0,
                           rows=tuple(r.strip() for r in args.rows.split(",") if r.strip()),
                           long_epochs=args.long_epochs, plateau_epochs=0, plateau_seeds=args.long_seeds, **common)
    check_configs(design)
    return design


def fair_design(args, base: dict, tasks: tuple[str, ...]) -> sp.Design:
    protocol = sp.Protocol(selection_samples=args.selection_samples, patience=args.patience,
                           min_delta=args.min_delta, selection_seeds=args.selection_seeds,
                           grid_factor=args.grid_factor, grid_width=args.grid_width,
                           max_extensions=args.max_extensions)
    # the seeds before anything is resolved: a bad seed is its own one-line error, not whatever comes next
    sp.check_seeds(args.heldout_seed_start, max(args.heldout_seeds, getattr(args, "key_seeds", 0) or 0),
                   protocol.selection_seeds)

    def centre(method: str) -> float:
        """The row's search centre: --rate-centre, else the rate the method trains at by default (its module rate;
        head-only: the head's), as `peftlab train` resolves it."""
        if args.rate_centre is not None:
            return args.rate_centre
        from peftlab.config import TrainConfig, normalise_keys
        from peftlab.resolve import resolve_config

        config = {**base, "task": tasks[0], "method": method}
        if method == "head":
            config.pop("targets", None)
        cfg = resolve_config(TrainConfig.from_dict(normalise_keys(TrainConfig, config, "study")), check_inputs=False)
        return float(cfg.optim.lr if method != "head" else cfg.optim.head_lr)

    if args.study_kind == "lambda":
        base["method"] = args.method
        ratios = (1.0,) + tuple(r for r in sd.float_list(_float_list(args.ratios), "--ratios") if r != 1)
        rows = tuple(sp.Row(f"lambda {r:g}", {"lr_ratio": r}, centre(args.method)) for r in ratios)
    else:
        names = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown_rows = [r for r in names if r not in sp.KASA_ROWS]
        if unknown_rows:
            from peftlab.errors import unknown

            raise unknown("kasa study row", unknown_rows[0], sp.KASA_ROWS, where="--rows")
        rows = tuple(sp.Row(n, sp.KASA_ROWS[n], centre(sp.KASA_ROWS[n]["method"])) for n in dict.fromkeys(names))
    return sp.Design(args.study_kind, tasks, base, rows, protocol, heldout_seeds=args.heldout_seeds,
                     heldout_seed_start=args.heldout_seed_start, key_seeds=args.key_seeds if args.study_kind ==
                     "lambda" else 20, equivalence_margin=args.equivalence_margin,
                     paper_arms=not args.no_paper_arms if args.study_kind == "kasa" else False,
                     key_ablation=not args.no_key_ablation if args.study_kind == "lambda" else False)


def check_fair_configs(design: sp.Design) -> None:
    """Every row's first config built once (bad keys and values fail here, before anything runs); a
    lower-is-better metric refused (the searches pick the highest)."""
    from peftlab.config import TrainConfig, normalise_keys
    from peftlab.resolve import resolve_config
    from peftlab.tasks.table import LOWER_IS_BETTER, primary_metric

    for task in design.tasks:
        configs = [sp.search_configs(design, task, row, [0])[0] for row in design.rows]
        configs += sp.heldout_configs(design, task, sp.kasa_paper_arms(task) if design.paper_arms else [],
                                      design.heldout_seed_list[:1])
        for config in configs:
            cfg = resolve_config(TrainConfig.from_dict(normalise_keys(TrainConfig, config, f"study {task}")))
        metric = primary_metric(cfg.task, getattr(cfg, "metric", None))
        if metric in LOWER_IS_BETTER:
            raise PeftlabError(f"task '{task}' is scored by {metric} (lower is better), which a study cannot pick on",
                               fix="study a task with a higher-is-better metric (accuracy, F1, correlation)")


def check_configs(design: sd.Design) -> None:
    """Every distinct run config of the design built once (bad keys and values fail here, before anything
    runs), and a task whose metric is lower-is-better refused (picks and verdicts assume higher is better)."""
    from peftlab.config import TrainConfig, normalise_keys
    from peftlab.resolve import resolve_config
    from peftlab.tasks.table import LOWER_IS_BETTER, primary_metric

    for task in design.tasks:
        if design.kind == "lambda":
            configs = sd.grid_configs(design, task)[:len(sd.grid_cells(design))]
        else:
            configs = sd.kasa_configs(design, task)[:len(design.rows) + 1]
        for config in configs:
            cfg = resolve_config(TrainConfig.from_dict(normalise_keys(TrainConfig, config, f"study {task}")))
        metric = primary_metric(cfg.task, getattr(cfg, "metric", None))  # a user task's --metric
        if metric in LOWER_IS_BETTER:
            raise PeftlabError(f"task '{task}' is scored by {metric} (lower is better), which a study cannot pick on",
                               fix="study a task with a higher-is-better metric (accuracy, F1, correlation)")


def default_output_dir(design: sd.Design) -> Path:
    model = str(design.base["model"]).replace("/", "_")
    return Path("runs") / "study" / f"{design.kind}-{model}-{'_'.join(design.tasks)}"


def run_cli(args) -> int:
    from peftlab.lab import ray_backend
    from peftlab.lab.store import STORE_NAME

    ray_backend.check_backend_args(args)  # before --dry-run too: a Ray flag without --backend ray is a mistake
    design = design_from_args(args)
    root = Path(args.output_dir) if args.output_dir else default_output_dir(design)
    paths = StudyPaths(root=root, store=root / STORE_NAME)
    fair = isinstance(design, sp.Design)
    if args.dry_run:
        print(f"study {design.kind} on {', '.join(design.tasks)} ({design.base['model']}), folder {root}")
        if fair:
            from peftlab.lab.study_fair import plan_lines

            print("\n".join(plan_lines(design, {t: split_text(design, t) for t in design.tasks})))
        else:
            study = Study(design, paths, workers=args.workers)
            print(Plan(plan_stages(design), study.seconds_per_epoch(), args.workers).describe())
        from peftlab.lab.preflight_cells import check_study, print_findings

        return print_findings(check_study(design, root, args, dry_run=True))  # its problems: exit 2
    if args.report_only:
        if not paths.plan.is_file():
            raise PeftlabError(f"no study in {root} yet (no {paths.plan.name})", fix="run the study first")
        if fair:
            from peftlab.lab.study_fair_report import write_fair_report

            save_fair_plan(paths, design)  # refuses a folder planned with other settings
            print(f"report: {write_fair_report(paths, design)}")
            return 0
        from peftlab.lab.study_report import write_report

        print(f"report: {write_report(paths, load_or_save_plan(paths, design, lambda: None))}")
        return 0
    options = ray_backend.RayOptions.from_args(args) if args.backend == "ray" else None
    from peftlab.lab.preflight_cells import check_study

    check_study(design, root, args)  # data, models, extras, the folder and its room: before any stage runs
    if fair:
        run_fair_study(design, paths, workers=args.workers, ray_options=options)
    else:
        run_study(design, paths, workers=args.workers, budget_hours=args.budget_hours, ray_options=options)
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
