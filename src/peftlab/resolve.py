"""A run's config resolved once, at its entry: the method's and the task's defaults from their tables, the
checks that need them, its paths. The result is marked (``cfg.resolved``): resolving it again is refused, and
``training.setup`` refuses an unresolved one. Torch-free: the tables import no model code.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from peftlab.config import TrainConfig, build_config
from peftlab.config_roles import File, Folder, flag_of
from peftlab.errors import PeftlabError
from peftlab.io_utils import path_problem
from peftlab.methods.registry import METHOD_OPTIONS, METHODS


def resolve_config(cfg: TrainConfig, *, check_inputs: bool = True) -> TrainConfig:
    """``cfg`` with the method's and the task's defaults, checked against both tables (one line otherwise).
    ``check_inputs``: its files and folders exist (off for a saved run read back: predict needs no training data)."""
    from peftlab.tasks.labelled_data import resolve_options
    from peftlab.tasks.table import canonical_sets, task as registered_task

    if cfg.resolved:  # a bug, not input: the run's entry resolved it already
        raise TypeError("resolve_config: this config is resolved already (a run resolves once, at its entry)")
    method, task = METHODS[cfg.method], registered_task(cfg.task)
    if check_inputs:
        check_paths(cfg)
    if cfg.packing and task.head != "causal-lm":
        raise PeftlabError(f"--packing packs decoder training examples; task '{cfg.task}' trains an encoder head",
                           fix="drop --packing (encoder batches are length-grouped and dynamically padded)")
    if not method.adapts_projections and task.head == "causal-lm":
        raise PeftlabError(f"--method {cfg.method} trains only a task head, and task '{cfg.task}' has none (a "
                           "causal LM is scored through its own language-model head)",
                           fix=f"use an adapter method (e.g. --method lora) for --task {cfg.task}")
    if cfg.selection_samples and not task.glue_dir:
        raise PeftlabError(f"--selection-samples carves a selection split out of a GLUE training set; task "
                           f"'{cfg.task}' is not a GLUE task", fix="drop --selection-samples for this task")
    optim = cfg.optim
    head_lr = method.default_head_lr if optim.head_lr is None else optim.head_lr  # one rule for every method
    lr, lr_ratio = (method.default_lr if optim.lr is None else optim.lr), optim.lr_ratio
    if not method.adapts_projections:
        # head-only: the head's rate is the only one (nothing trains at eta_QK or eta_V), and the config, the
        # run key and result.json say so; a sweep's lr / lr_ratio axis cannot make distinct keys of one run
        lr, lr_ratio = head_lr, 1.0
    defaults: dict[str, Any] = {
        # GLUE 128, a GSM8K worked answer needs ~350 tokens; 16, not the papers' 32: on small GLUE sets (RTE:
        # 2,490) 3 epochs of 32 are only 234 steps, and MiniLM-L6 + LoRA did not leave the majority class in
        # them (docs/RESULTS.md, RTE)
        "max_length": task.default_max_length or 128, "batch_size": task.default_batch_size or 16,
        "eval_every": 1 if task.default_eval_every is None else task.default_eval_every,
        "max_new_tokens": task.default_max_new_tokens or 256}
    resolved = dataclasses.replace(
        cfg, optim=dataclasses.replace(optim, lr=lr, lr_ratio=lr_ratio, head_lr=head_lr),
        eval_sets=canonical_sets(cfg.eval_sets, task, "eval_sets"),
        train_sets=canonical_sets(cfg.train_sets, task, "train_sets"),
        lm_eval=_lm_eval_names(cfg, task),
        **{name: value for name, value in defaults.items() if getattr(cfg, name) is None})
    data = resolve_options(resolved, task)  # classify/regress: the data options checked, defaults and the data digest
    return dataclasses.replace(resolved, text_fields=data.text_fields, metric=data.metric,
                               data_digest=data.data_digest).mark_resolved()


def resolved_from_dict(data: dict[str, Any]) -> TrainConfig:
    """A config that :func:`resolve_config` returned, read back from its flat form (a store row's config, a
    sweep run's, with ``resume`` / ``overwrite`` set per attempt): typed and checked, not resolved again."""
    return build_config(TrainConfig, overrides=data).mark_resolved()


def _lm_eval_names(cfg: TrainConfig, task) -> str | None:
    """--lm-eval's task names, canonical (the harness and its data are checked before training starts)."""
    if cfg.lm_eval is None:
        return None
    from peftlab.tasks.lm_eval_tasks import task_names

    if task.head != "causal-lm":
        raise PeftlabError(f"--lm-eval scores decoder runs; task '{cfg.task}' trains an encoder head",
                           fix="use --lm-eval with a decoder task (commonsense, math, gsm8k, alpaca, json)")
    return ",".join(task_names(cfg.lm_eval))


def check_paths(cfg) -> None:
    """The :class:`File` / :class:`Folder` fields of ``cfg`` that are set: there, and of the right kind; a folder
    that may not exist yet (an output) is no file, not below a file and has no name too long for its filesystem."""
    for spec in dataclasses.fields(type(cfg)):
        check, value = spec.metadata.get("check"), getattr(cfg, spec.name)
        if value is None or not isinstance(check, (File, Folder)):
            continue
        flag, path, kind = flag_of(type(cfg), spec.name), Path(value).expanduser(), type(check).__name__.lower()
        problem = path_problem(path, kind=kind, write=False)
        if problem is not None and not problem.startswith("it is a "):
            raise PeftlabError(f"{flag} {value}: {problem}", fix=f"pass another path as {flag}")
        if isinstance(check, File) and path.is_dir():
            raise PeftlabError(f"{flag} {value} is a folder, not a file",
                               fix="pass one file (a folder written by datasets' save_to_disk goes to --dataset)")
        if isinstance(check, Folder) and path.exists() and not path.is_dir():
            raise PeftlabError(f"{flag} {value} is a file, not a folder", fix=f"pass a folder as {flag}")
        if not (path.is_file() if isinstance(check, File) else path.is_dir() or not check.exists):
            raise PeftlabError(f"{flag} {value} not found", fix=f"pass an existing {kind} as {flag}")


def check_ignored_options(cfg: TrainConfig, explicit: set[str]) -> None:
    """``peftlab train``: an option set in the YAML or by a flag that this run would ignore is an error (the
    method's options: :func:`peftlab.methods.table.check_explicit_options`; ``--lr-ratio`` without v)."""
    from peftlab.methods.table import check_explicit_options

    check_explicit_options(cfg, explicit)
    lr_ratio = cfg.optim.lr_ratio
    if "lr_ratio" in explicit and lr_ratio != 1 and "v" not in cfg.targets:
        raise PeftlabError(f"--lr-ratio {lr_ratio:g} sets eta_V = {lr_ratio:g} x eta_QK, but --targets "
                           f"{','.join(cfg.targets)} has no v, so nothing would get it",
                           fix="add v to --targets (e.g. --targets q,v), or drop --lr-ratio")


def build_run_config(*, yaml_path: str | None = None, overrides: dict[str, Any] | None = None,
                     flag_values: dict[str, Any] | None = None, check_explicit: bool = False) -> TrainConfig:
    """:func:`peftlab.config.build_config` of a :class:`TrainConfig`, resolved for a run; ``check_explicit``
    (``peftlab train``): :func:`check_ignored_options`."""
    cfg = build_config(TrainConfig, yaml_path=yaml_path, overrides=overrides, flag_values=flag_values,
                       check_explicit=check_ignored_options if check_explicit else None)
    return resolve_config(cfg)


def refuse_unused_options(keys, methods, *, where: str) -> None:
    """One line for a method option set for all of a plan's runs that none of their methods reads (every run
    would ignore it)."""
    unused = sorted(k for k in keys if k in METHOD_OPTIONS and not any(k in METHODS[m].options for m in methods))
    if unused:
        users = ", ".join(m.name for m in METHODS.values() if unused[0] in m.options)
        raise PeftlabError(f"'{unused[0]}' is set, but none of the runs' methods ({', '.join(sorted(methods))}) uses "
                           "it (it would be ignored)", where=where,
                           fix=f"remove it, or add a method that has it ({users})")
