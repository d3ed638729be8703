"""LoopState: everything the loop knows about its run, and its checkpoint form (state.json); EpochEnd: what the loop
tells an ``on_epoch_end`` hook. Both free of torch, so that a hook's code (a tune trial's pruner) need not import
it. :meth:`LoopState.from_dict` gives a field missing from a state.json its default and ignores an unknown key."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from peftlab.errors import PeftlabError


@dataclass(frozen=True)
class EpochEnd:
    """What an ``on_epoch_end`` hook of :func:`peftlab.training.loop.train` is told after each epoch's evaluation
    and checkpoint."""

    epoch: int  # 1-based
    metrics: dict  # the dev metrics ({} when --eval-every skipped this epoch)
    primary_metric: str
    status: str  # ok or collapsed (a diverged run stops before its epoch ends)


# Without these a state.json is not one this peftlab resumes (optimizer_steps: since --grad-accum; a default of 0
# would restart --max-steps, --eval-steps and the checkpoint cadence).
REQUIRED_KEYS = ("epoch", "step_in_epoch", "global_step", "optimizer_steps")


@dataclass
class LoopState:
    """Position, counters, measurements and labels of one run (seeded by setup, carried by checkpoints)."""

    # where the run is
    epoch: int = 0  # epochs finished
    step_in_epoch: int = 0  # batches done in the current epoch (per process under DDP)
    global_step: int = 0  # batches done in all
    optimizer_steps: int = 0  # optimizer steps (batches / --grad-accum): --max-steps, --eval-steps, the curve
    skipped_steps: int = 0  # fp16: optimizer steps the GradScaler skipped on overflow
    in_epoch: bool = False  # inside an epoch: a divergence or failure there counts it in epochs_run
    # throughput
    train_examples: int = 0  # examples trained on, all processes together
    train_seconds: float = 0.0  # the steps' own time (no loading, evaluation or checkpoints)
    # the current epoch's sums (reset by finish_epoch)
    epoch_loss_sum: float = 0.0  # task loss of this process's batches
    epoch_loss_count: int = 0
    epoch_aux_sum: float | None = None  # the method's extra loss (KaSA's regulariser); None: it adds none
    epoch_train_seconds: float = 0.0
    # what the run measured (written to result.json as they are)
    before: dict | None = None  # dev metrics before fine-tuning, if evaluated
    best: dict | None = None  # {"epoch": 1-based, "metrics": {...}}: the best epoch-end evaluation so far
    epochs_log: list[dict] = field(default_factory=list)  # one record per finished epoch (epochs.jsonl)
    curve: list[dict] = field(default_factory=list)  # every dev evaluation during training, in order
    eval_extras: dict = field(default_factory=dict)  # what the evaluations added (e.g. generation files)
    kasa_sigma_init: dict | None = None  # KaSA's singular values before any step
    timings: dict = field(default_factory=dict)  # per-phase wall times (result.json "timings")
    # labels
    status: str = "ok"  # ok, diverged or collapsed while the loop runs; finish decides the final one
    status_reason: str | None = None
    clearly_above_chance: bool = False  # the dev metric has been above chance + CLEARLY_ABOVE_CHANCE
    peak: float | None = None  # the highest such value, at any evaluation point (a collapse's reason names it)
    stopped_early: dict | None = None  # {"epoch", "reason"}: the on_epoch_end hook stopped the run
    # --early-stop-patience: the selection metric's best value that counted as a gain, its epoch, the evaluated
    # epochs since, and why the run ended early ({"epoch", "reason"}: it stays ok, unlike stopped_early)
    gain_best: float | None = None
    gain_epoch: int = 0
    evals_without_gain: int = 0
    early_stopped: dict | None = None

    def to_dict(self) -> dict:
        """The JSON form a checkpoint holds (every field, under its own name)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "state.json") -> LoopState:
        """A state read back from a checkpoint (see the module doc)."""
        missing = [key for key in REQUIRED_KEYS if key not in data] if isinstance(data, dict) else ["a mapping"]
        if missing:
            raise PeftlabError(f"{where} is not a peftlab loop state ({missing[0]!r} missing)",
                               fix="resume a folder written by peftlab train, or pass --overwrite to start over")
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})

    def add_time(self, key: str, seconds: float) -> None:
        """Accumulate a phase's wall time in :attr:`timings` (over resumed attempts too)."""
        self.timings[key] = self.timings.get(key, 0.0) + seconds

    def count_batch(self, step) -> None:
        """One batch trained (a :class:`peftlab.training.step.StepResult`): positions, throughput and the epoch's
        loss sums move on."""
        self.global_step += 1
        self.step_in_epoch += 1
        self.optimizer_steps += int(step.stepped)
        self.train_examples += step.examples
        self.train_seconds += step.seconds
        self.epoch_train_seconds += step.seconds
        self.epoch_loss_sum += step.loss
        self.epoch_loss_count += 1
        if step.aux is not None:
            self.epoch_aux_sum = (self.epoch_aux_sum or 0.0) + step.aux

    def epoch_record(self, metrics: dict) -> dict:
        """epochs.jsonl's line for the epoch now ending (before :meth:`finish_epoch`)."""
        count = max(1, self.epoch_loss_count)
        record = {"epoch": self.epoch + 1, "train_loss": self.epoch_loss_sum / count, "metrics": metrics,
                  "seconds": self.epoch_train_seconds}
        if self.epoch_aux_sum is not None:  # the method's extra loss, mean per batch
            record["train_regulariser"] = self.epoch_aux_sum / count
        return record

    def finish_epoch(self) -> None:
        """The epoch is over: the next one starts at its first batch with empty sums."""
        self.epoch += 1
        self.step_in_epoch = self.epoch_loss_count = 0
        self.epoch_loss_sum = self.epoch_train_seconds = 0.0
        self.epoch_aux_sum = None
        self.in_epoch = False

    def epochs_done(self, steps_per_epoch: int) -> float:
        """Epochs trained so far, a fraction of batches mid-epoch (the curve's ``epoch``)."""
        return (self.epoch * steps_per_epoch + self.step_in_epoch) / max(1, steps_per_epoch)

    @property
    def epochs_run(self) -> int:
        """Epochs the loop entered (result.json ``epochs_run``): those finished, plus one cut short (a divergence
        or failure mid-epoch). A partial last epoch of --max-steps ends normally and counts as one; a pruned run
        counts the epochs before its stop."""
        return self.epoch + (1 if self.in_epoch else 0)

