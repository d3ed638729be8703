"""Run keys survive TrainConfig growing options: the committed study stores are found again by their specs.

A run's key hashes its resolved config. Each option added after key schema 1 is left out of the hash while it
is at its default, so adding a field (eval_sets, judge_url, ...) must not turn 195 recorded runs into 195 "new"
ones. These tests recompute the keys from the shipped specs, the way `peftlab sweep` does."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from peftlab.config import TrainConfig, build_config
from peftlab.lab.store import KEY_FIELDS_V1, config_key
from peftlab.lab.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]


def _store_keys(path: Path) -> set[str]:
    with sqlite3.connect(path) as db:
        return {key for (key,) in db.execute("SELECT key FROM runs")}


@pytest.mark.parametrize("spec, store", [("study_minilm.yaml", "results.sqlite"), ("lambda_grid_minilm.yaml", "lambda_grid.sqlite"),
                                         ("bf16_cpu.yaml", "bf16_cpu.sqlite")])
def test_shipped_specs_find_their_committed_runs(spec, store, tmp_path):
    sweep = load_spec(ROOT / "configs" / "sweeps" / spec, output_dir=str(tmp_path))
    recorded = _store_keys(ROOT / "docs" / "study" / store)
    missing = [run.describe() for run in sweep.runs if run.key not in recorded]
    assert sweep.runs and not missing, f"{len(missing)} of {len(sweep.runs)} runs lost their key, e.g. {missing[:2]}"


def test_a_new_option_changes_the_key_only_away_from_its_default():
    added = [f for f in dataclasses.fields(TrainConfig) if f.name not in KEY_FIELDS_V1
             and f.name not in ("threads", "report_to") and f.default is False]
    assert added, "expected a boolean option added after key schema 1 (e.g. gradient_checkpointing)"
    name = added[0].name
    base = build_config(TrainConfig, overrides={"task": "rte"}).to_dict()
    assert config_key(base) == config_key({k: v for k, v in base.items() if k != name})  # at default: not hashed
    assert config_key({**base, name: True}) != config_key(base)  # set: hashed
    assert config_key({**base, "lr_ratio": 2.0}) != config_key(base)  # a schema-1 option is always hashed


@pytest.mark.parametrize("store", sorted(p.name for p in (ROOT / "docs" / "study").glob("*.sqlite")))
def test_a_migrated_copy_of_a_committed_store_keeps_every_complete_runs_key(store, tmp_path, monkeypatch):
    """Opened for writing, a schema-1 store becomes schema 2: every complete run keeps its key (a spec still
    finds it); only the tunes' pruned trials, stored 'ok' then, move off the keys of the complete runs."""
    import json
    import shutil

    from peftlab.lab.store import Store
    from peftlab.lab.store_schema import epochs_run, is_pruned_result, pruned_key

    monkeypatch.chdir(tmp_path)  # the rows' relative run folders resolve here (none exist): nothing is renamed
    copy = tmp_path / store
    shutil.copy(ROOT / "docs" / "study" / store, copy)
    with sqlite3.connect(copy) as db:
        before = {key: json.loads(result) if result else None
                  for key, result in db.execute("SELECT key, result FROM runs")}
    db.close()
    Store(copy).close()
    expected = {pruned_key(k, epochs_run(r)) if is_pruned_result(r) else k for k, r in before.items()}
    assert _store_keys(copy) == expected and len(expected) == len(before)
    with sqlite3.connect(copy) as db:
        assert db.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone() == ("2",)
    db.close()
    assert any(is_pruned_result(r) for r in before.values()) == store.startswith("tune_")


STUDY_SPECS = sorted((ROOT / "docs" / "study").glob("*/specs/*.yaml"))


def test_the_committed_studies_have_specs():
    assert {p.parent.parent.name for p in STUDY_SPECS} >= {"lambda", "kasa"}


@pytest.mark.parametrize("spec", STUDY_SPECS, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_run_of_a_committed_study_spec_is_in_its_store(spec, tmp_path):
    """What `peftlab study` wrote is what it ran: each stage's spec, expanded now, names runs its store holds."""
    store = spec.parent.parent / "results.sqlite"
    sweep = load_spec(spec, output_dir=str(tmp_path), store=str(store))
    keys = {run.key for run in sweep.runs}
    assert keys and keys <= _store_keys(store), sorted(keys - _store_keys(store))[:3]


def test_a_null_in_a_zip_leaves_the_key_at_its_default(tmp_path):
    """Rows that set different keys (study kasa's head row has no alpha, its paper row has): null = not set."""
    spec = tmp_path / "rows.yaml"
    spec.write_text("base: {model: tiny-bert, task: rte, epochs: 1}\n"
                    "zip:\n- method: [lora, kasa]\n  alpha: [null, 16.0]\n")
    first, second = load_spec(spec, output_dir=str(tmp_path / "runs")).runs
    from peftlab.resolve import build_run_config

    default_alpha = build_run_config(overrides=dict(model="tiny-bert", task="rte", method="lora", epochs=1)).alpha
    assert first.cell == {"method": "lora"} and first.config["alpha"] == default_alpha
    assert second.cell == {"method": "kasa", "alpha": 16.0} and second.config["alpha"] == 16.0
