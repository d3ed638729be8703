"""``peftlab tune SPEC.yaml``: choose lambda (and eta_QK, rank, KaSA's beta/gamma...) within a budget.

Three phases, all ordinary runs in the tune's results store (so ``peftlab report``/``plot`` read them):
**search** (trials on the base seed, each epoch's dev metric reported to a pruner; a diverged or collapsed run
stopped at once), **seeds** (the ``top_k`` complete trials re-run on ``seeds`` seeds, never pruned: the best mean
wins, so one lucky seed cannot) and **held-out** (the winner on seeds nothing chose with, outside the budget: the
selection seeds' mean flatters it). A pruned trial is stored under its own key (:func:`peftlab.lab.store.pruned_key`).

Why Optuna, not Ray Tune: it runs in this process with nothing to start, its pruners take one ``report`` per
epoch through our ``on_epoch_end`` hook, and its study is an SQLite file beside the store, so a killed tune
resumes from the files (trials left running continue from their checkpoints; finished runs are found by key).
Ray Tune would bring its own trainable lifecycle, checkpoints and folders; with ``--backend ray`` the trials are
plain Ray tasks and the study stays with one Ray actor on the driver's machine. ``tune.lock`` keeps a second
tune off the same folder.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

from peftlab.errors import PeftlabError
from peftlab.lab.runner import Executor, require_epoch_hook, train_all
from peftlab.lab.spec import add_spec_flags
from peftlab.lab.sweep import executor_for
from peftlab.lab.store import Store, short_key
from peftlab.lab.store_schema import FINISHED
from peftlab.lab.tune.spec import TuneSpec, heldout_runs, load_tune_spec, run_config
from peftlab.lab.tune.summary import build_summary, render_summary, trial_outcome, write_summary

LOCK_FILE = "tune.lock"


@contextlib.contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """One tune at a time on a folder (an advisory lock; the kernel drops it if the process dies)."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / LOCK_FILE, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise PeftlabError(f"another peftlab tune is running on {root} (pid {holder})",
                               fix="wait for it to finish, or see its progress with --summary") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


# --------------------------------------------------------------------------- the tune


class Tuner:
    def __init__(self, tune: TuneSpec, keeper, store: Store, executor: Executor, say: Callable[[str], None]):
        self.tune, self.keeper, self.store, self.executor, self.say = tune, keeper, store, executor, say
        self.running: dict[str, int] = {}  # run key -> trial number, for trials in flight
        self.poll = 1.0

    # ----------------------------------------------------------------- search

    def search_spent(self) -> int:
        """Epochs the search has trained: finished trials' runs, plus the epochs reported by those in flight."""
        spent: dict[str | None, int] = {}  # run key -> epochs; a later trial of the same run counts nothing
        for trial in self.keeper.call("trials"):
            epochs = len(trial["intermediate"]) if trial["state"] == "running" else int(trial["attrs"].get("epochs", 0))
            spent.setdefault(trial["attrs"].get("key"), epochs)
        return sum(spent.values())

    def search(self) -> None:
        queue = self.keeper.call("unfinished")
        if queue:
            self.say(f"continuing {len(queue)} trial(s) left unfinished by a killed tune")

        def next_trial():
            while queue or self.search_spent() < self.tune.search_budget:
                ticket = queue.pop(0) if queue else self.keeper.call("ask")
                if ticket is None:  # a grid has no point left
                    return None
                trial = self.start(ticket)
                if trial is not None:
                    return trial
            return None

        train_all(self.executor, next_trial, self.finish, poll=self.poll)

    def start(self, ticket):
        """The trial's run and reporter to train; None when its outcome is known already (told here)."""
        from peftlab.lab.tune.study import TrialReporter

        run = run_config(self.tune, ticket.params, self.tune.base_seed)
        if run.key in self.running:  # a sampler proposed a point already in flight: not trained twice
            self.keeper.call("tell", ticket.number, "pruned", None,
                             {"key": run.key, "outcome": "duplicate", "epochs": 0,
                              "reason": f"same run as trial {self.running[run.key]}"})
            return None
        self.keeper.call("set_attrs", ticket.number, {"key": run.key, "output_dir": run.output_dir})
        self.running[run.key] = ticket.number
        row = self.store.get(run.key)
        if (row is None or row["status"] not in (*FINISHED, "failed")) and self.store.pruned_rows(run.key):
            # this point was trained and pruned already (by this trial before a kill, or an earlier trial of the
            # same point): its pruned row is the outcome; its complete key stays free for a complete run
            self.finish(run.key)
            return None
        self.store.register([(run.key, run.config, run.output_dir)])
        if self.store.get(run.key)["status"] in (*FINISHED, "failed"):  # trained already (told before a kill)
            self.finish(run.key)
            return None
        return run, TrialReporter(self.keeper, ticket.number, self.tune.metric, self.tune.pruner.kind)

    def finish(self, key: str) -> None:
        number = self.running.pop(key)
        # a pruned trial's row has moved to its pruned key: the trial follows it (settled: even if a sweep on
        # the same store has queued the config's complete run under the key meanwhile)
        row = self.store.find(key, settled=True)
        outcome = trial_outcome(row, self.tune.metric)
        self.keeper.call("tell", number, outcome["state"], outcome["value"],
                         {"key": row["key"] if row else key, "outcome": outcome["outcome"],
                          "epochs": outcome["epochs"], "reason": outcome["reason"] or ""})
        trial = self.keeper.call("trials")[number]
        value = f"{self.tune.metric} {outcome['value']:.4f}" if outcome["value"] is not None else ""
        reason = f" ({outcome['reason']})" if outcome["reason"] and outcome["outcome"] != "pruned" else ""
        point = " ".join(f"{k}={v}" for k, v in trial["params"].items())
        self.say(f"trial {number} {{{point}}}: {outcome['outcome']} after {outcome['epochs']} epoch(s)"
                 f"{', ' + value if value else ''}{reason}")
        self.write_summary()

    # ----------------------------------------------------------------- seeds

    def seed_runs(self) -> None:
        """The top candidates re-run on every selection seed, then the winner on the held-out seeds."""
        candidates = self.summary()["candidates"]
        self.plain([run_config(self.tune, cand["params"], seed) for cand in candidates for seed in self.tune.seed_list],
                   f"seed re-runs of the top {len(candidates)} candidate(s) x seeds {self.tune.seed_list}")
        winner = self.summary()["winner"]
        if winner is not None and self.tune.heldout_seeds:
            self.plain(heldout_runs(self.tune, winner["params"]),
                       f"held-out check of the winner: {self.tune.describe_heldout()}")

    def plain(self, runs: list, what: str) -> None:
        run_plain(runs, self.store, self.executor, self.tune.metric, self.say, poll=self.poll, what=what,
                  after_each=self.write_summary)

    # ----------------------------------------------------------------- summary

    def summary(self) -> dict:
        return build_summary(self.tune, self.keeper.call("trials"), self.store.rows())

    def write_summary(self) -> dict:
        summary = self.summary()
        write_summary(self.tune.summary_path, summary)
        return summary


def run_plain(runs: list, store: Store, executor: Executor, metric: str, say: Callable[[str], None], *, what: str,
              poll: float = 1.0, after_each: Callable[[], object] | None = None) -> None:
    """Register ``runs`` and train the pending ones through ``executor``, never pruned."""
    if not runs:
        return
    store.register((r.key, r.config, r.output_dir) for r in runs)
    statuses = store.statuses()
    pending = [(run, None) for run in runs if statuses.get(run.key) == "pending"]
    if pending:
        say(f"{what}: {len(pending)} run(s) to train")
    seeds = {run.key: run.config["seed"] for run, _ in pending}

    def done(key: str) -> None:
        row = store.find(key)
        outcome = trial_outcome(row, metric)
        value = f", {metric} {outcome['value']:.4f}" if outcome["value"] is not None else ""
        say(f"run {short_key(key)} (seed {seeds[key]}): {row['status'] if row else 'lost'}{value}")
        if after_each is not None:
            after_each()

    train_all(executor, lambda: pending.pop(0) if pending else None, done, poll=poll)


def run_tune(tune: TuneSpec, *, ray=None, train_fn: Callable | str | None = None, progress: bool = True,
             capture_output: bool = True) -> dict:
    """Run (or resume) a tune, its runs in this process or as Ray tasks (``ray``: a RayOptions); returns its
    summary (also in ``<output_dir>/tune.json``)."""
    from peftlab.lab.tune.study import start_keeper

    say = print if progress else (lambda *a, **k: None)
    require_epoch_hook(train_fn)
    with exclusive(tune.output_root), Store(tune.store_path) as store:
        reset = store.prepare(list(store.statuses()))
        if reset["running"]:
            say(f"resuming {reset['running']} run(s) left unfinished by a killed tune")
        say(tune.describe())
        keeper = None
        try:
            with executor_for(store, tune.output_root / "logs" if capture_output else None, say, train_fn=train_fn,
                              ray=ray, wait_if_held=True) as executor:
                if ray is not None:
                    executor.connect()  # Ray first (says how many runs fit): the keeper is then an actor on it
                keeper = start_keeper(tune, on_ray=ray is not None)
                tuner = Tuner(tune, keeper, store, executor, say)
                tuner.search()
                tuner.seed_runs()
                return tuner.write_summary()
        finally:  # only once the executor has cancelled its runs: a running trial's epoch hook still reports
            if keeper is not None:
                keeper.close()


def load_summary(tune: TuneSpec) -> dict:
    """The summary of a tune from its study and store (``--summary``; works while it runs)."""
    from peftlab.lab.tune.study import StudyKeeper

    if not tune.study_path.is_file():
        raise PeftlabError(f"no tune has run in {tune.output_root} yet (no {tune.study_path.name})",
                           fix=f"run peftlab tune {tune.spec_path}")
    keeper = StudyKeeper(tune, create=False)
    try:
        with Store(tune.store_path, create=False) as store:
            return build_summary(tune, keeper.trials(), store.rows())
    finally:
        keeper.close()


# --------------------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "tune", help="choose lambda (and other keys) within a budget: pruned search, then seed re-runs",
        description="Search SPEC.yaml's space (base: config keys, search: key -> list or range, budget: epochs "
                    "or grid_fraction) with early stopping of poor trials on the dev metric (Optuna), re-run the "
                    "top candidates with several seeds and name the winner by its mean, then score the winner on "
                    "held-out seeds no choice used (heldout_seeds, default 10; outside the budget). Every trial is "
                    "a run in <output dir>/results.sqlite. Re-running resumes.")
    parser.add_argument("spec", metavar="SPEC.yaml", help="tune spec (see configs/tune/)")
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help="seed re-runs of the top candidates (default: the spec's seeds, else 5)")
    parser.add_argument("--summary", action="store_true",
                        help="print the trials, the winner and the compute spent so far, and run nothing")
    add_spec_flags(parser, dry_run="print the search space, the budget and what the preflight found; run nothing")
    parser.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from peftlab.extras import require
    from peftlab.lab import ray_backend

    require("peftlab tune")  # the 'tune' extra (Optuna: the search, and --summary reads its study), first
    ray_backend.check_backend_args(args)
    tune = load_tune_spec(args.spec, output_dir=args.output_dir, store=args.store, seeds=args.seeds)
    from peftlab.lab.preflight_cells import check_tune, print_findings

    if args.dry_run:
        print(tune.describe())
        for i, point in enumerate(tune.grid_points or [], 1):
            print(f"{i:>3}  " + " ".join(f"{k}={v}" for k, v in point.items()))
        return print_findings(check_tune(tune, args, dry_run=True))
    if args.summary:
        print(render_summary(load_summary(tune)), end="")
        return 0
    check_tune(tune, args)  # every point's data, model, extras, the folder and its room: before any trial
    ray = ray_backend.RayOptions.from_args(args) if args.backend == "ray" else None
    try:
        summary = run_tune(tune, ray=ray, capture_output=not args.verbose)
    except Exception as err:  # a full disk under the study's own database (Optuna's SQLAlchemy) too: one line
        from peftlab.lab.runner import DISK_FIX, out_of_space

        if isinstance(err, PeftlabError) or out_of_space(err) is None:
            raise
        raise PeftlabError(f"cannot write the tune in {tune.output_root}: {out_of_space(err)}", fix=DISK_FIX) from None
    print()
    print(render_summary(summary), end="")
    print(f"runs: peftlab report {tune.store_path}")
    if summary["winner"] is None:
        from peftlab.lab.tune.summary import no_winner_reason

        print(f"no winner: {no_winner_reason(summary)} (see the trials above and <output dir>/logs/)",
              file=sys.stderr)
        return 1
    return 0
