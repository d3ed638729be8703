"""One declaration per config field: every field has roles and a check; each consumer's list is derived from the
roles (and equals what its hand-kept list meant, but for the fixed disagreement); a field that may change on
resume never changes the run key; a value out of range is refused by the same line from every entry point; the
config layer is a leaf (no torch, no method, task, model, training or lab module)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml

from peftlab.config import (HEAD_ONLY, ROLES, MethodConfig, MethodName, Pooling, TaskName, TrainConfig,
                            build_config, save_config)
from peftlab.config_roles import (NOT_HASHED, File, Folder, Range, Roles, Text, choices_of, hints, kind_of, option,
                                  option_spec, options, role_sets)
from peftlab.errors import PeftlabError

# The options of that time (the lists below name only these; an option added since is held to its roles by the
# field-by-field tests), and the hand-kept lists as they were before they were derived (commit 8b02f4d).
OLD_OPTIONS = (
    "lr", "lr_ratio", "head_lr", "weight_decay", "method", "targets", "layers", "rank", "alpha", "dropout", "kasa_beta",
    "kasa_gamma", "kasa_reduction", "kasa_truncate_rank", "kasa_mode", "corda_mode", "corda_samples", "vera_d_initial",
    "fourierft_n_frequency", "fourierft_scaling", "task", "model", "epochs", "batch_size", "eval_batch_size",
    "max_length", "pooling", "pad_to_max", "packing", "warmup_ratio", "scheduler", "grad_accum", "max_steps",
    "max_grad_norm", "seed", "max_train_samples", "max_eval_samples", "eval_seed", "data_dir", "output_dir",
    "overwrite", "resume", "save", "checkpoint_every", "mixed_precision", "threads", "gradient_checkpointing",
    "trust_remote_code", "allow_pickle", "instruction_fields", "train_file", "eval_file", "dataset", "eval_split",
    "text_fields", "label_field", "metric", "data_digest", "eval_sets", "train_sets", "eval_before", "eval_every",
    "eval_steps", "lm_eval", "max_new_tokens", "judge_url", "judge_model", "judge_api_key_env", "judge_timeout",
    "judge_retries", "judge_parallel", "log_every", "report_to")
OLD = {
    "KEY_EXCLUDED": ("output_dir", "resume", "overwrite", "threads", "report_to"),  # lab/store.py
    "KEY_FIELDS_V1": frozenset((  # lab/store.py
        "allow_pickle", "alpha", "batch_size", "checkpoint_every", "corda_mode", "corda_samples", "data_dir",
        "dropout", "epochs", "eval_batch_size", "eval_before", "eval_every", "eval_file", "eval_seed",
        "fourierft_n_frequency", "fourierft_scaling", "head_lr", "instruction_fields", "kasa_beta", "kasa_gamma",
        "kasa_mode", "kasa_reduction", "kasa_truncate_rank", "log_every", "lr", "lr_ratio", "max_eval_samples",
        "max_grad_norm", "max_length", "max_new_tokens", "max_train_samples", "method", "mixed_precision", "model",
        "output_dir", "overwrite", "pad_to_max", "pooling", "rank", "resume", "seed", "targets", "task", "train_file",
        "trust_remote_code", "vera_d_initial", "warmup_ratio", "weight_decay")),
    "KEY_AS_BEFORE": {"checkpoint_every": (None, 0)},  # lab/store.py
    "RESUME_FREE_KEYS": {"resume", "overwrite", "output_dir", "checkpoint_every", "log_every", "threads", "report_to",
                         "judge_timeout", "judge_retries", "judge_parallel"},  # training/guards.py
    "NON_RESULT_KEYS": ("output_dir", "resume", "overwrite", "seed", "task", "log_every", "checkpoint_every",
                        "eval_batch_size", "data_dir", "allow_pickle", "trust_remote_code", "threads", "report_to",
                        "judge_api_key_env", "judge_timeout", "judge_retries", "judge_parallel"),  # lab/records.py
    "TRAINING_ONLY_KEYS": ("lr", "lr_ratio", "head_lr", "weight_decay", "warmup_ratio", "epochs", "batch_size",
                           "max_grad_norm", "max_train_samples", "dropout", "kasa_beta", "kasa_gamma",
                           "kasa_reduction"),  # lab/records.py
    "LABEL_ORDER": ("model", "method", "targets", "rank", "alpha", "lr", "lr_ratio", "head_lr", "epochs",
                    "batch_size", "max_length", "weight_decay", "dropout"),  # lab/records.py
    "NOT_SEARCHABLE": ("seed", "epochs", "task", "output_dir", "resume", "overwrite"),  # lab/tune/spec.py
    "RUN_MANAGED_KEYS": ("output_dir", "resume", "overwrite"),  # lab/spec.py
    "ADAPTER_IDENTITY_KEYS": ("task", "model", "method", "targets", "rank", "pooling"),  # training/evaluation.py
}
# The disagreement: guards let these change on --resume while the store hashed them into the run key (a sweep
# would have run the cell again). Now a resumable option never changes the key; log_every and checkpoint_every,
# hashed by key schema 1, are hashed as the constant every committed run had (10, 0: KEY_AS_BEFORE's None -> 0).
FIXED_OUT_OF_THE_KEY = {"log_every", "checkpoint_every", "judge_timeout", "judge_retries", "judge_parallel"}


def then(names) -> set:
    """The names among the options that existed when the lists were kept by hand."""
    return set(names) & set(OLD_OPTIONS)


def test_each_derived_list_is_what_the_hand_kept_list_meant():
    from peftlab.lab import records, spec, store
    from peftlab.lab.tune import spec as tune_spec
    from peftlab.training import evaluation, guards

    assert set(OLD_OPTIONS) <= set(options(TrainConfig))  # none was lost
    assert store.KEY_FIELDS_V1 == OLD["KEY_FIELDS_V1"]  # a historical set: no option can join it
    assert then(guards.RESUME_FREE_KEYS) == OLD["RESUME_FREE_KEYS"]
    assert then(store.KEY_EXCLUDED) == set(OLD["KEY_EXCLUDED"]) | FIXED_OUT_OF_THE_KEY == OLD["RESUME_FREE_KEYS"]
    assert store.KEY_PINNED == {"checkpoint_every": 0, "log_every": 10}  # was KEY_AS_BEFORE: None meant 0
    assert then(records.NON_RESULT_KEYS) == set(OLD["NON_RESULT_KEYS"])
    assert then(records.TRAINING_ONLY_KEYS) == set(OLD["TRAINING_ONLY_KEYS"])
    assert tuple(k for k in records.LABEL_ORDER if k in OLD_OPTIONS) == OLD["LABEL_ORDER"]  # an order: exactly
    assert then(tune_spec.NOT_SEARCHABLE) == set(OLD["NOT_SEARCHABLE"])
    assert then(spec.RUN_MANAGED_KEYS) == set(OLD["RUN_MANAGED_KEYS"])
    assert then(evaluation.ADAPTER_IDENTITY_KEYS) == set(OLD["ADAPTER_IDENTITY_KEYS"])
    # one place: every consumer's list is the object derived from the declarations, not a copy
    assert (store.KEY_FIELDS_V1, guards.RESUME_FREE_KEYS, records.LABEL_ORDER, tune_spec.NOT_SEARCHABLE) == (
        ROLES.key_v1, ROLES.resumable, ROLES.label_order, ROLES.not_searchable)


# --------------------------------------------------------------------------- field by field


FLAT = list(options(TrainConfig))


@pytest.mark.parametrize("name", FLAT)
def test_every_field_has_roles_and_a_check(name):
    spec, hint = option_spec(TrainConfig, name), field_hint(name)
    assert isinstance(spec.metadata.get("roles"), Roles), f"{name}: declare it with config_roles.option(...)"
    kind, check = kind_of(hint), spec.metadata.get("check")
    if choices_of(hint) is not None or kind is tuple:
        assert choices_of(hint) or choices_of(typing.get_args(hint)[0]), name  # a choice (or a set of them)
    elif kind in (int, float):
        assert isinstance(check, Range), f"{name}: a number needs its Range"
    elif kind is str:
        assert isinstance(check, (Text, File, Folder)) or spec.metadata.get("normalise"), f"{name}: text needs a check"
    else:
        assert kind is bool, f"{name}: {hint}"


@pytest.mark.parametrize("name", FLAT)
def test_a_resumable_field_never_changes_the_run_key_and_the_others_do(name, tmp_path):
    """The store's key and the resume guard agree on every field: the key changes exactly when --resume refuses."""
    from peftlab.lab.store import config_key
    from peftlab.training.guards import check_same_config

    base = TrainConfig().to_dict()
    other = {**base, name: another_value(name, base[name])}
    TrainConfig.from_dict({name: other[name]} if name != "judge_url" else {name: other[name], "task": "mt-bench"})
    same_key = config_key(other) == config_key(base)
    save_config(TrainConfig(), tmp_path / "config.yaml")
    cfg = types.SimpleNamespace(to_dict=lambda: other)  # what the guard reads of a config
    if name in ROLES.resumable:
        assert same_key, f"{name} may change on --resume, so it must not change the run key"
        check_same_config(cfg, tmp_path)  # accepted
    else:
        assert not same_key, f"{name} changes what a run computes, so it must change the run key"
        with pytest.raises(PeftlabError, match=f"--resume with a different config: {name} was"):
            check_same_config(cfg, tmp_path)


def another_value(name: str, value):
    """A valid value of option ``name`` other than ``value`` (its default)."""
    hint = field_hint(name)
    choices = choices_of(hint)
    if choices:
        return next(c for c in choices if c != value)
    kind = kind_of(hint)
    if kind is bool:
        return not value
    if kind is tuple:
        return "q,k,v"
    if kind is int:
        return 7 if value in (None, 0) else value + 1
    if kind is float:
        return 0.5 if not value else value / 2
    special = {"data_digest": "ab" * 32, "judge_url": "http://127.0.0.1:9/v1", "layers": "1", "output_dir": "elsewhere",
               "judge_api_key_env": "OTHER_API_KEY"}
    return special.get(name, f"{value}-other" if value else "other")


def field_hint(name: str):
    where = options(TrainConfig)[name]
    return hints(where.owner)[where.name]


# --------------------------------------------------------------------------- one check, every entry point


BAD = [("seed", -1), ("seed", 2**32), ("eval_seed", 2**32 + 5), ("rank", 0), ("lr", 0.0), ("lr_ratio", -2.0),
       ("warmup_ratio", 1.5), ("dropout", 1.0), ("max_length", -5), ("threads", 0), ("judge_timeout", 0.0),
       ("kasa_beta", -1.0), ("max_train_samples", 2**63), ("pooling", "max"), ("method", "lorra")]


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(PeftlabError) as err:
        call(*args, **kwargs)
    assert "\n" not in str(err.value)
    return err.value.what


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v}" for n, v in BAD])
def test_out_of_range_is_refused_identically_everywhere(name, value, tmp_path, capsys):
    from peftlab.cli.main import main
    from peftlab.lab.spec import load_spec
    from peftlab.lab.tune.spec import load_tune_spec

    python_api = refusal(TrainConfig.from_dict, {name: value})
    assert f"'{value}'" in python_api or str(value) in python_api
    # the command line: exit 2, one line, nothing created
    out = tmp_path / "run"
    assert main(["train", "--" + name.replace("_", "-"), str(value), "--output-dir", str(out), "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and python_api in err[0] and not out.exists()
    # a YAML config
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({name: value}))
    assert refusal(build_config, TrainConfig, yaml_path=str(tmp_path / "c.yaml")) == python_api
    # a sweep spec (base and grid) and a tune spec (base), before anything is written
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": {"model": "tiny-bert", name: value}, "grid": {"alpha": [8.0, 16.0]}}))
    assert python_api in refusal(load_spec, sweep, output_dir=str(tmp_path / "runs"))
    tune = tmp_path / "tune.yaml"
    tune.write_text(yaml.safe_dump({"base": {"model": "tiny-bert", name: value}, "search": {"alpha": [8, 16]},
                                    "budget": {"epochs": 20}}))
    assert refusal(load_tune_spec, tune, output_dir=str(tmp_path / "runs")) == python_api
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("search, phrase", [
    # each value is checked where it is read (naming the search key), before any search point is built
    ({"lr": [1e-3, -1.0]}, "--lr must be a finite number > 0, got -1.0 ("),
    ({"lr": {"low": -1.0, "high": 1e-3}}, "--lr must be a finite number > 0, got -1.0 ("),
    ({"alpha": [8.0], "rank": {"low": 0, "high": 16}}, "--rank must be a positive integer, got 0 ("),
    ({"rank": {"low": 4, "high": 2**63}}, "--rank must fit in 64 bits"),
])
def test_a_tune_search_is_checked_at_both_ends_of_a_range(search, phrase, tmp_path):
    """Before any trial (a range's values are drawn later, by Optuna, one trial at a time)."""
    from peftlab.lab.tune.spec import load_tune_spec

    spec = tmp_path / "tune.yaml"
    spec.write_text(yaml.safe_dump({"base": {"model": "tiny-bert"}, "search": search, "budget": {"epochs": 20}}))
    with pytest.raises(PeftlabError) as err:
        load_tune_spec(spec, output_dir=str(tmp_path / "runs"))
    assert phrase in str(err.value) and not (tmp_path / "runs").exists()


def test_study_set_is_checked_before_anything_is_written(tmp_path, capsys):
    from peftlab.cli.main import main

    out = tmp_path / "study"
    code = main(["study", "lambda", "--task", "rte", "--model", "tiny-bert", "--set", "rank=0,alpha=8",
                 "--output-dir", str(out), "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--rank must be a positive integer, got 0" in err[0] and not out.exists()


def test_ranges_are_the_libraries_own():
    import numpy as np

    np.random.seed(2**32 - 1)  # the declaration's largest seed is numpy's
    with pytest.raises(ValueError):
        np.random.seed(2**32)
    assert TrainConfig(seed=2**32 - 1).seed == 2**32 - 1
    assert "must fit in 64 bits" in refusal(TrainConfig, batch_size=2**63)
    assert "is beyond any model's" in refusal(TrainConfig, layers="0-99999999999")  # never expanded
    assert refusal(TrainConfig, judge_url="ftp://x") == "--judge-url must be an http:// or https:// URL, got 'ftp://x'"


def test_paths_are_checked_when_a_run_is_resolved(tmp_path):
    from peftlab.resolve import resolve_config

    missing = TrainConfig(task="json", model="tiny-llama", train_file=str(tmp_path / "nope.json"))
    assert refusal(resolve_config, missing).endswith("nope.json not found")
    assert "is a folder, not a file" in refusal(resolve_config, dataclasses.replace(missing, train_file=str(tmp_path)))
    (tmp_path / "f").write_text("x")
    assert "is a file, not a folder" in refusal(resolve_config, TrainConfig(output_dir=str(tmp_path / "f")))
    assert resolve_config(missing, check_inputs=False).train_file  # a saved run read back: its data may be gone


def test_a_run_is_resolved_once_and_a_second_resolve_is_refused():
    import pickle

    from peftlab.resolve import resolve_config, resolved_from_dict

    cfg = TrainConfig(model="tiny-bert")
    assert not cfg.resolved and cfg.optim.lr is None
    resolved = resolve_config(cfg)
    assert resolved.resolved and resolved.optim.lr > 0 and not cfg.resolved  # the input is left as it was
    with pytest.raises(TypeError, match="resolved already"):
        resolve_config(resolved)
    assert pickle.loads(pickle.dumps(resolved)).resolved  # a worker gets it resolved
    assert not dataclasses.replace(resolved, seed=1).resolved  # a changed copy is a new, unresolved config
    assert resolved == resolve_config(dataclasses.replace(resolved))  # resolving once more would change nothing
    back = resolved_from_dict(resolved.to_dict())  # a store row read back: resolved, not resolved again
    assert back.resolved and back == resolved
    assert "resolved_once" not in resolved.to_dict() and "resolved" not in resolved.to_dict()  # not in run keys


def test_training_resolves_once_per_run(tmp_path, monkeypatch):
    """The run's entry resolves (`peftlab train`: build_run_config); train() and setup() take the config as it
    is, and setup refuses an unresolved one. train() given an unresolved config from Python is the entry."""
    import peftlab.resolve
    from peftlab.training import loop
    from peftlab.training.setup import setup

    with pytest.raises(TypeError, match="not resolved"):
        setup(TrainConfig(model="tiny-bert", output_dir=str(tmp_path / "never")), "fresh")
    calls, seen = [], []
    real = peftlab.resolve.resolve_config

    class Stop(Exception):
        pass

    def counted(cfg, **kwargs):
        calls.append(cfg)
        return real(cfg, **kwargs)

    def stop_at_setup(cfg, mode):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(peftlab.resolve, "resolve_config", counted)
    monkeypatch.setattr(loop, "resolve_config", counted)
    monkeypatch.setattr(loop, "setup", stop_at_setup)
    entry = peftlab.resolve.build_run_config(overrides={"model": "tiny-bert", "output_dir": str(tmp_path / "a")})
    with pytest.raises(Stop):
        loop.train(entry)
    assert len(calls) == 1 and seen[-1] is entry
    with pytest.raises(Stop):
        loop.train(TrainConfig(model="tiny-bert", output_dir=str(tmp_path / "b")))
    assert len(calls) == 2 and seen[-1].resolved


# --------------------------------------------------------------------------- declarations and their tables


def test_the_declared_choices_are_the_tables():
    from peftlab.methods.registry import METHODS
    from peftlab.models.pooling import POOLINGS

    from peftlab.tasks.table import TASKS

    # --method / --task are read off their registrations (one place): the Literal follows a new row
    assert typing.get_args(MethodName) == tuple(METHODS)
    assert typing.get_args(TaskName) == tuple(TASKS)
    assert set(typing.get_args(Pooling)) == set(POOLINGS)
    assert [name for name, m in METHODS.items() if not m.adapts_projections] == [HEAD_ONLY]
    # a method's option group lives with its row: MethodConfig's group fields, the --help sections and the
    # options the row reads all follow it
    groups = {f.name: f.type for f in dataclasses.fields(MethodConfig) if dataclasses.is_dataclass(f.type)}
    assert groups == {m.group.PREFIX: m.group for m in METHODS.values() if m.group is not None}
    assert list(groups) == ["kasa", "corda", "vera", "fourierft"]
    assert TrainConfig.SECTIONS["corda"] == "CorDA (--method corda only)"
    assert METHODS["vera"].options == {"rank", "dropout", "targets", "layers", "lr", "lr_ratio", "vera_d_initial"}


def test_contradicting_roles_are_refused():
    @dataclasses.dataclass
    class Bad:
        every: int = option(1, Range(1), resumable=True)  # resumable, yet tells report rows apart

    with pytest.raises(TypeError, match="is resumable but tells report rows apart"):
        role_sets(Bad)

    @dataclasses.dataclass
    class Pinned:
        every: int = option(1, Range(1), key_v1=True, resumable=True, report_row=False)  # old keys would change

    with pytest.raises(TypeError, match="give it hashed_as"):
        role_sets(Pinned)
    assert Roles().hashed_as is NOT_HASHED


def test_config_is_a_leaf():
    code = ("import sys, peftlab.config, peftlab.config_roles, peftlab.config_cli; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] in "
            "[['peftlab', p] for p in ('methods', 'tasks', 'models', 'training', 'lab', 'cli', 'bench')]); "
            "print(__import__('json').dumps(bad))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # the method and task registrations (torch-free leaves; their packages' __init__ only) and nothing else
    registrations = ["peftlab.methods", "peftlab.methods.registry", "peftlab.tasks", "peftlab.tasks.table"]
    assert json.loads(proc.stdout) == registrations
    source = Path(__file__).resolve().parents[1] / "src" / "peftlab" / "config.py"
    imported = [line for line in source.read_text().splitlines() if line.lstrip().startswith(("import ", "from "))]
    assert [line for line in imported if any(f"peftlab.{p}" in line for p in
                                             ("methods", "tasks", "models", "training", "lab"))] == [
        "from peftlab.methods.registry import (  # the rows' names and option groups (re-exported: "
        "peftlab.config.KasaOptions)", "from peftlab.tasks.table import TASK_NAMES"]
