"""How many batches, optimizer steps, epochs and checkpoints a run takes, and the order of its batches."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from peftlab.config import TrainConfig

if TYPE_CHECKING:
    from peftlab.training.state import LoopState


class LengthGroupedBatchSampler:
    """Batches of similar length (little padding), reshuffled each epoch; set ``epoch`` before iterating."""

    def __init__(self, lengths, batch_size: int, seed: int, grouped: bool):
        self.lengths, self.batch_size, self.seed, self.grouped = list(lengths), batch_size, seed, grouped
        self.epoch = 0

    def _batches(self):
        from peftlab.tasks.batching import length_grouped_batches

        if self.grouped:
            return length_grouped_batches(self.lengths, self.batch_size, self.seed, self.epoch)
        order = torch.randperm(len(self.lengths), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return [order[i:i + self.batch_size].tolist() for i in range(0, len(order), self.batch_size)]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self):
        return math.ceil(len(self.lengths) / self.batch_size)


def optimizer_step_count(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """Optimizer steps the run takes: --max-steps, else --epochs x ceil(batches / --grad-accum)."""
    if cfg.max_steps and cfg.epochs > 0:
        return cfg.max_steps
    return math.ceil(batches_per_epoch / cfg.grad_accum) * cfg.epochs


DEFAULT_CHECKPOINT_EVERY = 200  # optimizer steps; a mid-epoch checkpoint of an adapter costs milliseconds


def checkpoint_interval(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """--checkpoint-every, else every DEFAULT_CHECKPOINT_EVERY steps when an epoch is longer (0: epoch ends only)."""
    if cfg.checkpoint_every is not None:
        return cfg.checkpoint_every
    steps = math.ceil(batches_per_epoch / cfg.grad_accum)
    return DEFAULT_CHECKPOINT_EVERY if steps > DEFAULT_CHECKPOINT_EVERY else 0


def reached_max_steps(cfg: TrainConfig, state: LoopState) -> bool:
    return bool(cfg.max_steps) and state.optimizer_steps >= cfg.max_steps


def evaluates_epoch(cfg: TrainConfig, epoch: int, *, last: bool) -> bool:
    """Whether epoch ``epoch`` (1-based) ends with a dev evaluation: every --eval-every epochs, and the last always."""
    return last or (cfg.eval_every > 0 and epoch % cfg.eval_every == 0)


def planned_epoch_count(cfg: TrainConfig, batches_per_epoch: int) -> int:
    """Epochs the loop runs: --epochs, or as many (the last maybe partial) as --max-steps needs (--epochs 0,
    the before-fine-tuning row, trains nothing whatever --max-steps says)."""
    if cfg.max_steps and cfg.epochs > 0:
        return math.ceil(cfg.max_steps / max(1, math.ceil(batches_per_epoch / cfg.grad_accum)))
    return cfg.epochs
