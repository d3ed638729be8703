"""What a run refuses, and how it labels itself: config checks, divergence and collapse, the chance bar. Nothing is
hidden: diverged, collapsed, pruned and no_learning are statuses with their reasons (:func:`final_status`)."""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

from peftlab.config import ROLES, TrainConfig
from peftlab.errors import PeftlabError
from peftlab.tasks.table import LOWER_IS_BETTER  # LOWER_IS_BETTER: smaller eval_loss is the better epoch

if TYPE_CHECKING:
    from peftlab.training.state import LoopState

# A metric "clearly above" chance is this far above it (metrics are in [0, 1] or [-1, 1]).
CLEARLY_ABOVE_CHANCE = 0.05
# Task kinds whose primary metric has a chance bar (Pipeline.chance: the dev set's majority class for accuracy
# and F1, 0 for correlations): a no_learning verdict is only given there (never for eval_loss, generation).
CHANCE_BAR_KINDS = ("classification", "regression")


def position_limit(model) -> int | None:
    """How many tokens the model can take: its position table (RoBERTa/MPNet reserve padding_idx + 1 rows)."""
    config = model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is None:
        return None
    if config.model_type in ("roberta", "mpnet", "xlm-roberta", "camembert", "longformer"):
        limit -= (getattr(config, "pad_token_id", 1) or 1) + 1
    return int(limit)


def capped_max_length(cfg: TrainConfig, model) -> TrainConfig:
    """--max-length beyond the position table: an error with --pad-to-max (every batch would have that many
    tokens), else the data is tokenised at the model's limit, with a note. Checked before any file exists;
    ``cfg`` itself (config.yaml, the run's key) keeps the value the user gave."""
    import dataclasses

    limit = position_limit(model)
    if limit is None or cfg.max_length <= limit:
        return cfg
    if cfg.pad_to_max:
        raise PeftlabError(f"--max-length {cfg.max_length} with --pad-to-max exceeds the {limit} positions of "
                           f"model '{cfg.model}'", fix=f"use --max-length {limit} or less")
    print(f"--max-length {cfg.max_length} is capped at {limit}, the positions of model '{cfg.model}'")
    return dataclasses.replace(cfg, max_length=limit)


# Keys that may change between a run and its resumption without changing what is computed (the config's
# `resumable` role: its folder, threads, logging, checkpoint interval, how MT-Bench's judge is asked; never in
# the run key either).
RESUME_FREE_KEYS = ROLES.resumable


def check_same_config(cfg: TrainConfig, out: Path) -> None:
    """--resume (or a finished run) with another config than the run folder's config.yaml: refused."""
    import yaml

    saved_file = out / "config.yaml"
    if not saved_file.is_file():
        return
    saved = yaml.safe_load(saved_file.read_text()) or {}
    current = cfg.to_dict()
    # Keys missing from an older config.yaml (added to peftlab since) are not a change.
    changed = sorted(k for k in current if k not in RESUME_FREE_KEYS and k in saved and saved[k] != current[k])
    if changed:
        key = changed[0]
        raise PeftlabError(f"--resume with a different config: {key} was {saved.get(key)!r}, now {current[key]!r}"
                           + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""),
                           where=str(saved_file),
                           fix="resume with the run's own config, or use --overwrite / another --output-dir")


def above_majority(state: LoopState, before: dict | None, pipeline) -> bool | None:
    """Whether the best dev metric beats always predicting the dev set's majority class (None: no such bar,
    e.g. eval_loss of instruction tasks)."""
    name = pipeline.primary_metric
    if name in LOWER_IS_BETTER:
        return None
    metrics = (state.best or {}).get("metrics") or before or {}
    value = metrics.get(name)
    return None if value is None else bool(value > pipeline.chance)


def better(value: float, incumbent: float | None, metric: str) -> bool:
    """``value`` beats the best epoch's ``incumbent`` (lower is better for losses)."""
    if incumbent is None:
        return True
    return value < incumbent if metric in LOWER_IS_BETTER else value > incumbent


def check_collapse(state: LoopState, primary, chance: float, where: str, name: str) -> None:
    """Label (never hide) a run that was clearly above chance and fell back to no_learning's bar (a collapsed
    regressor's Pearson is noise around 0, above it as often as below). Called at every evaluation point, so a run
    that rose mid-epoch and fell back by the epoch's end is ``collapsed``; ``where`` names it (e.g. "epoch 2")."""
    if primary is None:
        return
    if primary > chance + CLEARLY_ABOVE_CHANCE:
        state.clearly_above_chance = True
        state.peak = max(state.peak if state.peak is not None else primary, primary)
    elif state.clearly_above_chance and state.status == "ok":
        state.status = "collapsed"
        state.status_reason = (f"{name} fell to {primary:.4f} <= chance {chance:.4f} + {CLEARLY_ABOVE_CHANCE:g} at "
                               f"{where} after reaching {state.peak:.4f}")


def early_stop_reason(state: LoopState, value, epoch: int, patience: int, min_delta: float, name: str) -> str | None:
    """--early-stop-patience after an evaluated epoch: count the epochs since the selection metric last gained
    more than ``min_delta``; the reason to stop once they reach ``patience`` (None: go on)."""
    if value is None or not patience:
        return None
    if state.gain_best is None or value > state.gain_best + min_delta:
        state.gain_best, state.gain_epoch, state.evals_without_gain = value, epoch, 0
        return None
    state.evals_without_gain += 1
    if state.evals_without_gain < patience:
        return None
    return (f"{name} has not gained more than {min_delta:g} over {state.gain_best:.4f} (epoch {state.gain_epoch}) "
            f"for {patience} evaluated epoch(s)")


def plateau_record(state: LoopState, patience: int, min_delta: float) -> dict | None:
    """result.json "plateau": whether the run trained to its plateau. ``stopped``: early stopping ended it;
    ``flattening``: it reached --epochs with no gain in its last evaluated epoch(s); ``improving``: its last
    evaluated epoch was still a gain (the cap was too short). None without --early-stop-patience."""
    if not patience:
        return None
    verdict = "stopped" if state.early_stopped else "flattening" if state.evals_without_gain else "improving"
    return {"verdict": verdict, "patience": patience, "min_delta": min_delta, "best_gain_epoch": state.gain_epoch,
            "evals_without_gain": state.evals_without_gain}


def no_learning_reason(state: LoopState, pipeline) -> str | None:
    """Why a finished run learned nothing measurable, or None: its best (epoch-end) primary metric is not above
    chance + CLEARLY_ABOVE_CHANCE, or not above the run's own before-fine-tuning metric when that was
    evaluated. Only for tasks with a chance bar (:data:`CHANCE_BAR_KINDS`, higher-is-better metric); None for a
    run that trained nothing (``--epochs 0``: there is no best epoch to judge)."""
    name = pipeline.choice_metric  # the selection split's metric where there is one
    if pipeline.task.kind not in CHANCE_BAR_KINDS or name in LOWER_IS_BETTER or not state.best:
        return None
    value = state.best["metrics"].get(name)
    if value is None:
        return None
    where = f"best {name} {value:.4f} (epoch {state.best['epoch']})"
    bar = pipeline.choice_chance + CLEARLY_ABOVE_CHANCE
    if value <= bar:
        return (f"{where} is not clearly above chance: <= {bar:.4f} = chance {pipeline.choice_chance:.4f} "
                f"+ {CLEARLY_ABOVE_CHANCE}")
    before = (state.before or {}).get(name)
    if before is not None and value <= before:
        return f"{where} is not above the model before fine-tuning: <= {before:.4f}"
    return None


def final_status(state: LoopState, pipeline) -> tuple[str, str | None]:
    """(status, status_reason) of a run that ended in :func:`peftlab.training.fit.fit`, in this order:
    diverged or collapsed (kept as the loop labelled it), pruned (an on_epoch_end hook stopped it before its
    last epoch: it never finished, so no verdict on learning), no_learning (:func:`no_learning_reason`), ok."""
    if state.status != "ok":
        return state.status, state.status_reason
    if state.stopped_early:
        return "pruned", f"stopped after epoch {state.stopped_early['epoch']}: {state.stopped_early['reason']}"
    reason = no_learning_reason(state, pipeline)
    return ("ok", None) if reason is None else ("no_learning", reason)
