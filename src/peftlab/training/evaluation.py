"""What ``peftlab evaluate`` runs: a saved run's adapter on a fresh base model (:func:`load_run`, shared with predict
and export), evaluated on its task's dev split. Its metrics equal the run's final ones: the check that a saved
adapter reproduces the trained model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peftlab.config import ROLES
from peftlab.errors import PeftlabError
from peftlab.extras import require_scoring


# What an adapter was trained for must be what the run evaluates: another task's head, another model's
# shapes or another method's tensors would load (or half-load) and print a meaningless number (the config's
# `adapter_identity` role: task, model, method, targets, rank, pooling).
ADAPTER_IDENTITY_KEYS = ROLES.adapter_identity


def _check_adapter_matches(adapter: Path, cfg, run_dir: Path) -> Path:
    """The adapter folder to load (a run folder's ``adapter/`` is found too), refused if its run differs."""
    import yaml

    if not adapter.is_dir():  # found before the base model is loaded, not by the adapter loader after it
        what = "is not a folder" if adapter.exists() else "not found"
        raise PeftlabError(f"--adapter {adapter} {what}",
                           fix="pass an adapter folder (or a run folder holding adapter/)")
    if (adapter / "adapter").is_dir():
        adapter = adapter / "adapter"
    saved = adapter.parent / "config.yaml"
    if not saved.is_file():  # a bare adapter folder: the loader still refuses tensors that do not fit the model
        return adapter
    other = yaml.safe_load(saved.read_text()) or {}
    mine = cfg.to_dict()
    for key in ADAPTER_IDENTITY_KEYS:
        if key in other and other[key] != mine.get(key):
            raise PeftlabError(f"--adapter {adapter} was trained with {key}={other[key]!r}, but {run_dir} is "
                               f"{key}={mine.get(key)!r}", fix="evaluate an adapter of the same task, model, method, "
                               "targets and rank (or evaluate its own run folder)")
    return adapter


@dataclass
class LoadedRun:
    """A saved run rebuilt on a fresh base model: what evaluate and predict need."""

    cfg: object  # TrainConfig from the run's config.yaml
    task: object  # tasks.table.Task: the task its config names, resolved once here
    model: object
    tokenizer: object
    precision: str  # the run's recorded (or re-resolved) --mixed-precision
    pooling: str  # the saved config's --pooling as the model loader resolved it (native or mean)
    label_names: tuple[str, ...] = ()  # a classifier's class names by id (id2label); () for regression / LMs


def load_run(run_dir: str | Path, *, adapter: str | Path | None = None, merge: bool = False,
             allow_pickle: bool = False, overrides: dict | None = None, scoring: bool = False) -> LoadedRun:
    """``scoring``: the run will be scored on its task, so a missing extra that needs is refused first."""
    from peftlab.methods.saving import load_trained, merged, saved_head_labels
    from peftlab.config import TrainConfig, build_config
    from peftlab.resolve import resolve_config
    from peftlab.models.registry import load_model_with_pooling
    from peftlab.tasks.labelled_data import head_labels
    from peftlab.tasks.table import task as registered_task
    from peftlab.training.devices import resolve_precision
    from peftlab.training.run_folder import read_result

    run_dir = Path(run_dir)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise PeftlabError(f"no config.yaml in {run_dir}", fix="pass a folder written by peftlab train")
    # resolved as the run was (a config.yaml written before an option existed gets its default); its data may
    # be gone: evaluating needs it (and says so when it reads it), predicting and exporting do not
    cfg = resolve_config(build_config(TrainConfig, yaml_path=config_file, overrides=overrides or None),
                         check_inputs=False)
    if adapter is not None:
        adapter = _check_adapter_matches(Path(adapter), cfg, run_dir)
    if scoring:
        require_scoring(cfg)  # before the base model is loaded
    task = registered_task(cfg.task)
    # The head as the run saved it (labels.json: a user task's classes), else as its task defines it.
    labels = head_labels(cfg, task, saved=saved_head_labels(adapter or run_dir / "adapter"))
    loaded = load_model_with_pooling(cfg.model, head=task.head, num_labels=labels.num_labels, seed=cfg.seed,
                                     trust_remote_code=cfg.trust_remote_code, pooling=cfg.pooling)
    loaded.model.config.update(labels.config_values())  # id2label/label2id: predict and export name the classes
    model = load_trained(loaded.model, adapter or run_dir / "adapter", allow_pickle=allow_pickle or cfg.allow_pickle,
                         base_model=cfg.model)
    if merge:
        model = merged(model)
    # The precision the run was trained and scored with (result.json), so the number is reproduced;
    # a run without one (older, or killed before its result) resolves the saved config's setting again.
    recorded = (read_result(run_dir) or {}).get("mixed_precision")
    precision = recorded or resolve_precision(cfg.mixed_precision, sum(p.numel() for p in model.parameters()))[0]
    return LoadedRun(cfg, task, model, loaded.tokenizer, precision, loaded.pooling, labels.names)


def evaluate_run(run_dir: str | Path, *, adapter: str | Path | None = None, merge: bool = False,
                 allow_pickle: bool = False, max_eval_samples: int | None = None) -> dict:
    """The saved run's metrics on its task's dev set (a generation task logs to ``generations_evaluate.jsonl``,
    never over the files written during training)."""
    from peftlab.tasks.prepare import EVALUATE_TAG, build_pipeline
    from peftlab.training.devices import make_accelerator

    overrides = {"max_eval_samples": max_eval_samples} if max_eval_samples is not None else None
    run = load_run(run_dir, adapter=adapter, merge=merge, allow_pickle=allow_pickle, overrides=overrides,
                   scoring=True)
    pipeline = build_pipeline(run.cfg, run.tokenizer, run.model, run.task)
    accelerator = make_accelerator(run.precision)
    model = accelerator.prepare(run.model)
    return pipeline.evaluate(model, accelerator, EVALUATE_TAG).metrics
