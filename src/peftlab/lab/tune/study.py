"""The Optuna study behind ``peftlab tune``: trials asked, per-epoch reports, pruning decisions, outcomes.

One object, :class:`StudyKeeper`, is the only user of the study's SQLite file (``<output_dir>/study.sqlite``):
in this process with the local backend, or as a Ray actor on the driver's machine with ``--backend ray``
(the trials' ``on_epoch_end`` hooks call it from the workers), so no two processes ever write the file.
Methods take and return plain data (trial numbers, dicts), so the same calls work through an actor.

A grid (every search key a list) is walked in a fixed shuffled order, each point exactly once
(``enqueue_trial``: Optuna's GridSampler stops the study from inside ``tell``, which the ask-and-tell
interface does not allow); a space with ranges is sampled by TPE. Trials left RUNNING by a killed tune are
handed back by :meth:`StudyKeeper.unfinished` and continued, never asked again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from peftlab.errors import PeftlabError

STUDY_NAME = "peftlab-tune"


@dataclass(frozen=True)
class Ticket:
    """A trial to run: its Optuna number and its search point."""

    number: int
    params: dict


class StudyKeeper:
    def __init__(self, tune, *, create: bool = True):  # a TuneSpec whose output folder is absolute
        from peftlab.extras import require

        require("peftlab tune")  # the 'tune' extra (peftlab study's search stage comes here too)
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.grid = tune.grid_points
        self.space = {name: _distribution(optuna, param) for name, param in tune.search.items()}
        storage = optuna.storages.RDBStorage(f"sqlite:///{tune.study_path}",
                                             engine_kwargs={"connect_args": {"timeout": 120}})
        # a grid's sampler is never used: every point is enqueued
        sampler = (optuna.samplers.RandomSampler if self.grid is not None else optuna.samplers.TPESampler)(
            seed=tune.sampler_seed)
        kwargs = dict(storage=storage, study_name=STUDY_NAME, sampler=sampler,
                      pruner=_pruner(optuna, tune.pruner, tune.epochs))
        self.study = (optuna.create_study(direction=tune.direction, load_if_exists=True, **kwargs) if create
                      else optuna.load_study(**kwargs))
        attrs, fingerprint = self.study.user_attrs, tune.fingerprint()
        if "fingerprint" not in attrs and create:
            self.study.set_user_attr("fingerprint", fingerprint)
        elif attrs.get("fingerprint") != fingerprint:
            raise PeftlabError(f"the tune spec's base, search, metric or pruner changed since this tune started "
                               f"(study {tune.study_path})",
                               fix="restore the spec, or give the changed one another output_dir")

    # ----------------------------------------------------------------- asking

    def unfinished(self) -> list[Ticket]:
        """Trials a killed tune left running (or asked and never started): they are continued, not re-asked."""
        running = self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.RUNNING,))
        return [Ticket(frozen.number, dict(frozen.params)) for frozen in running]

    def _next_point(self) -> dict | None:
        used = [t.params or t.system_attrs.get("fixed_params") or {} for t in self.study.get_trials(deepcopy=False)]
        return next((p for p in self.grid if p not in used), None)

    def ask(self) -> Ticket | None:
        """The next trial; None when a grid has no point left."""
        waiting = self.study.get_trials(deepcopy=False, states=(self.optuna.trial.TrialState.WAITING,))
        if self.grid is not None and not waiting:
            point = self._next_point()
            if point is None:
                return None
            self.study.enqueue_trial(point)
        trial = self.study.ask(self.space)
        return Ticket(trial.number, dict(trial.params))

    def set_attrs(self, number: int, attrs: dict) -> None:
        frozen = self._frozen(number)
        for name, value in attrs.items():  # Optuna's storage API: any process may label any trial
            self.study._storage.set_trial_user_attr(frozen._trial_id, name, value)

    # ----------------------------------------------------------------- reporting

    def report(self, number: int, epoch: int, value: float) -> bool:
        """Record a trial's dev metric after ``epoch``; True when the pruner says to stop it."""
        if not math.isfinite(value):
            return True
        frozen = self._frozen(number)
        if epoch in frozen.intermediate_values:  # a retried worker repeats an epoch
            return False
        trial = self.optuna.trial.Trial(self.study, frozen._trial_id)
        trial.report(float(value), step=epoch)
        return bool(trial.should_prune())

    def tell(self, number: int, state: str, value: float | None, attrs: dict) -> None:
        """Close a trial: ``complete`` with its value, else ``pruned`` or ``failed``; ``attrs`` kept on it."""
        TrialState = self.optuna.trial.TrialState
        if self._frozen(number).state.is_finished():  # told already (a rerun of a killed tune repeats its last tell)
            return
        self.set_attrs(number, attrs)
        if state == "complete" and value is not None and math.isfinite(value):
            self.study.tell(number, value)
        elif state in ("complete", "pruned"):
            self.study.tell(number, state=TrialState.PRUNED)
        else:
            self.study.tell(number, state=TrialState.FAIL)

    def close(self) -> None:
        """Let go of the study file (before a Ray actor takes it over)."""
        engine = getattr(self.study._storage, "engine", None)
        if engine is not None:
            engine.dispose()

    # ----------------------------------------------------------------- reading

    def _frozen(self, number: int):
        return self.study.get_trials(deepcopy=False)[number]

    def trials(self) -> list[dict]:
        """Every trial as a plain dict: number, state, params, value, intermediate values, user attrs."""
        return [{"number": trial.number, "state": trial.state.name.lower(), "params": dict(trial.params),
                 "value": trial.value, "intermediate": {int(k): v for k, v in trial.intermediate_values.items()},
                 "attrs": dict(trial.user_attrs)} for trial in self.study.get_trials(deepcopy=False)]


def _distribution(optuna, param):
    """The Optuna distribution of a search key (a SearchParam): its values, or an int or float range."""
    if param.values is not None:
        return optuna.distributions.CategoricalDistribution(list(param.values))
    if isinstance(param.low, int) and isinstance(param.high, int) and not isinstance(param.step, float):
        return optuna.distributions.IntDistribution(param.low, param.high, log=param.log, step=param.step or 1)
    return optuna.distributions.FloatDistribution(float(param.low), float(param.high), log=param.log, step=param.step)


def _pruner(optuna, pruner, max_epochs: int):
    if pruner.kind == "none":
        return optuna.pruners.NopPruner()
    if pruner.kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=pruner.min_epochs, max_resource=max_epochs,
                                              reduction_factor=pruner.reduction_factor)
    return optuna.pruners.SuccessiveHalvingPruner(min_resource=pruner.min_epochs,
                                                  reduction_factor=pruner.reduction_factor)


# --------------------------------------------------------------------------- one handle, local or Ray


class KeeperHandle:
    """Calls a StudyKeeper in this process, or its Ray actor, with the same method names; picklable with an actor
    inside (a trial's reporter on a Ray worker holds one)."""

    def __init__(self, keeper=None, actor=None):
        self.keeper, self.actor = keeper, actor

    def call(self, method: str, *args):
        if self.actor is None:
            return getattr(self.keeper, method)(*args)
        import ray

        return ray.get(getattr(self.actor, method).remote(*args))

    def close(self) -> None:
        if self.actor is None:
            return
        import ray

        if ray.is_initialized():  # a Ray this process started went with its actors
            ray.kill(self.actor)


def start_keeper(tune, *, on_ray: bool) -> KeeperHandle:
    """A StudyKeeper of ``tune`` here, or a Ray actor pinned to this (the driver's) node, which holds the study
    file. On Ray the driver checks the study first with a StudyKeeper of its own (closed before the actor opens
    it), so a changed spec is one line here, not an actor's traceback."""
    tune = replace(tune, output_root=tune.output_root.resolve())  # an actor's working folder is not ours
    keeper = StudyKeeper(tune)
    if not on_ray:
        return KeeperHandle(keeper=keeper)
    keeper.close()
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    actor = ray.remote(StudyKeeper).options(
        num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)).remote(tune)
    return KeeperHandle(actor=actor)


@dataclass
class TrialReporter:
    """A trial's ``on_epoch_end``: reports each epoch's dev metric to the keeper and stops the run when the
    pruner says so, or at once when the run collapsed to chance. Picklable (a Ray actor handle inside)."""

    keeper: KeeperHandle
    number: int
    metric: str
    pruner: str

    def hook(self):
        def on_epoch_end(end) -> str | None:
            value = end.metrics.get(self.metric)
            if end.status == "collapsed":
                if value is not None:
                    self.keeper.call("report", self.number, end.epoch, float(value))
                return f"collapsed: stopped by peftlab tune at epoch {end.epoch}"
            if value is None:  # --eval-every skipped this epoch
                return None
            if self.keeper.call("report", self.number, end.epoch, float(value)):
                return f"pruned by peftlab tune ({self.pruner}) at epoch {end.epoch}: {self.metric} {value:.4f}"
            return None

        return on_epoch_end
