"""Stores that cannot lie (issue 21, section 2): schema 2 with no_learning / pruned, a schema-1 store migrated
in place (rows and rowids kept, its pruned "ok" trials moved off the complete runs' keys), pruned trials
re-keyed and their folders renamed when recorded (locally and through Ray's record path), and the done-when
check: `peftlab tune` into a store, then `peftlab sweep` of the same grid into it re-runs the pruned cells."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from peftlab.lab.store import Store, config_key
from peftlab.lab.store_schema import FINISHED, NOT_OK, SCHEMA_VERSION, effective_status, pruned_dir, pruned_key

from test_tune import BASE, FAKE, epoch_calls, fake_train, spec_for  # noqa: E402

# The runs table exactly as schema 1 created it (peftlab before issue 21).
SCHEMA_1 = """
CREATE TABLE IF NOT EXISTS runs (
    key TEXT PRIMARY KEY,
    status TEXT NOT NULL CHECK (status IN ('pending', 'running', 'ok', 'diverged', 'collapsed', 'failed')),
    config TEXT NOT NULL,
    result TEXT,
    output_dir TEXT,
    started TEXT,
    finished TEXT,
    seconds REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    owner TEXT,
    created TEXT NOT NULL,
    updated TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta (name, value) VALUES ('schema_version', '1');
"""
STAMP = "2025-01-01T00:00:00.000+00:00"


def config(seed: int, lr_ratio: float = 4.0) -> dict:
    return {"model": "tiny-bert", "task": "rte", "epochs": 2, "lr_ratio": lr_ratio, "seed": seed}


def result(cfg: dict, *, status: str = "ok", epochs: int = 2, stopped: bool = False) -> dict:
    log = [{"epoch": e, "metrics": {"accuracy": 0.6 + 0.05 * e}} for e in range(1, epochs + 1)]
    return {"status": status, "config": cfg, "primary_metric": "accuracy", "epochs_log": log, "best": log[-1],
            "stopped_early": {"epoch": epochs, "reason": "pruned by peftlab tune"} if stopped else None}


def schema1_store(path: Path, rows: list[tuple[str, dict, dict | None, str | None]]) -> None:
    """A store written by schema-1 peftlab: (status, config, result, output_dir) rows, in this order."""
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA_1)
        for status, cfg, res, out in rows:
            db.execute("INSERT INTO runs (key, status, config, result, output_dir, attempts, created, updated) "
                       "VALUES (?, ?, ?, ?, ?, 1, ?, ?)",
                       (config_key(cfg), status, json.dumps(cfg), None if res is None else json.dumps(res), out,
                        STAMP, STAMP))
    db.close()


def rowids(path: Path) -> dict[int, tuple[str, str]]:
    with sqlite3.connect(path) as db:
        return {rowid: (key, status) for rowid, key, status in db.execute("SELECT rowid, key, status FROM runs")}


def test_the_new_statuses_are_grouped_as_the_contract_says():
    assert set(FINISHED) == {"ok", "diverged", "collapsed", "no_learning", "pruned"}
    assert set(NOT_OK) == {"diverged", "collapsed", "failed", "no_learning", "pruned"}
    assert SCHEMA_VERSION == 2


def test_a_schema1_store_reads_as_it_is_and_migrates_in_place_on_write(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done, pruned, broken = config(0), config(1), config(2)
    folder = tmp_path / "runs" / "rte-pruned"
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps(result(pruned, epochs=1, stopped=True)))
    path = tmp_path / "old.sqlite"
    schema1_store(path, [("ok", done, result(done), "runs/rte-done"),
                         ("ok", pruned, result(pruned, epochs=1, stopped=True), "runs/rte-pruned"),
                         ("failed", broken, None, None), ("pending", config(3), None, None)])
    with sqlite3.connect(path) as db, pytest.raises(sqlite3.IntegrityError):  # the table really is schema 1
        db.execute("UPDATE runs SET status = 'pruned' WHERE rowid = 1")
    db.close()
    before, ids = hashlib.sha256(path.read_bytes()).hexdigest(), rowids(path)

    with Store(path, create=False) as store:  # read-only: untouched, but its pruned trial reads as pruned
        statuses = store.statuses()
        rows = store.rows()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert statuses[config_key(pruned)] == "pruned" and statuses[config_key(done)] == "ok"
    assert [r["status"] for r in rows] == ["ok", "pruned", "failed", "pending"]

    with Store(path) as store:  # written: migrated
        assert store.schema == 2
        migrated = {r["key"]: r for r in store.rows()}
        store.add(config(4), result={**result(config(4)), "status": "no_learning"})  # the new CHECK admits it
    after = rowids(path)
    moved = pruned_key(config_key(pruned), 1)
    assert set(after) == set(ids) | {max(ids) + 1}  # every rowid kept, one row added
    for rowid, (key, status) in ids.items():
        expected = (moved, "pruned") if key == config_key(pruned) else (key, status)
        assert after[rowid] == expected
    assert config_key(pruned) not in migrated  # off the complete run's key ...
    assert migrated[moved]["config"] == pruned and migrated[moved]["result"]["stopped_early"]  # ... all kept
    assert migrated[moved]["output_dir"] == pruned_dir("runs/rte-pruned", 1)
    assert not folder.exists() and (tmp_path / pruned_dir("runs/rte-pruned", 1) / "result.json").is_file()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone() == ("2",)
        assert "'no_learning'" in db.execute("SELECT sql FROM sqlite_master WHERE name = 'runs'").fetchone()[0]
        assert db.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND name = 'runs_status'").fetchone()
    db.close()


def test_the_migration_is_one_transaction(tmp_path, monkeypatch):
    """A migration that fails half-way leaves the schema-1 store exactly as it was."""
    import peftlab.lab.store as store_module

    path = tmp_path / "old.sqlite"
    schema1_store(path, [("ok", config(0), result(config(0)), None),
                         ("ok", config(1), result(config(1), epochs=1, stopped=True), None)])
    ids = rowids(path)
    real = store_module.migrate_v1

    def half_way(conn, stamp):
        real(conn, stamp)  # the table rebuilt, the pruned row moved ...
        raise RuntimeError("killed mid-migration")  # ... and then the process dies

    monkeypatch.setattr(store_module, "migrate_v1", half_way)
    with pytest.raises(RuntimeError, match="killed mid-migration"):
        Store(path)
    assert rowids(path) == ids
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone() == ("1",)
    db.close()


def test_committed_stores_still_read(tmp_path):
    root = Path(__file__).resolve().parents[1] / "docs" / "study"
    for path in sorted(root.glob("*.sqlite")):
        before = hashlib.sha256(path.read_bytes()).hexdigest()
        with Store(path, create=False) as store:
            rows = store.rows()
        assert rows and hashlib.sha256(path.read_bytes()).hexdigest() == before
        if path.stem.startswith("tune_"):  # the tunes' pruned trials, stored ok in schema 1, read as pruned
            assert any(r["status"] == "pruned" for r in rows)
            assert all(r["status"] == effective_status("ok", r["result"]) for r in rows if r["status"] != "failed")


@pytest.mark.parametrize("legacy", [False, True], ids=["status pruned", "ok + stopped_early"])
def test_a_pruned_result_moves_to_its_own_key_and_frees_the_folder(tmp_path, legacy):
    cfg = {**config(0), "output_dir": str(tmp_path / "runs" / "trial")}
    key = config_key(cfg)
    trial = result(cfg, status="ok" if legacy else "pruned", epochs=1, stopped=True)
    if not legacy:
        trial["epochs_run"] = 1
    Path(cfg["output_dir"]).mkdir(parents=True)
    (Path(cfg["output_dir"]) / "result.json").write_text(json.dumps(trial))
    with Store(tmp_path / "s.sqlite") as store:
        store.register([(key, cfg, cfg["output_dir"])])
        assert store.claim(key) is not None
        assert store.finish(key, trial)
        assert store.get(key) is None  # never under the complete run's key
        row = store.get(pruned_key(key, 1))
        assert row["status"] == "pruned" and row["config"] == cfg and row["result"] == trial
        assert row["output_dir"] == pruned_dir(cfg["output_dir"], 1) and store.find(key) == row
        assert (Path(row["output_dir"]) / "result.json").is_file() and not Path(cfg["output_dir"]).exists()
        assert store.register([(key, cfg, cfg["output_dir"])]) == 1  # the complete run: a new pending row
        assert store.statuses()[key] == "pending" and store.find(key)["status"] == "pending"
        # an import of a pruned result is re-keyed too
        other = config(5)
        assert store.add(other, result=result(other, epochs=1, stopped=True)) == pruned_key(config_key(other), 1)


def test_the_detached_record_path_rekeys_a_pruned_trial(tmp_path):
    from peftlab.lab.runner import record

    cfg = {**config(0), "output_dir": str(tmp_path / "trial")}
    key = config_key(cfg)
    Path(cfg["output_dir"]).mkdir()
    with Store(tmp_path / "s.sqlite") as store:
        store.register([(key, cfg, cfg["output_dir"])])
        store.claim(key)
        assert record(store, key, {"result": result(cfg, epochs=1, stopped=True), "pid": 1}) == "pruned"
        assert store.get(key) is None and store.get(pruned_key(key, 1))["status"] == "pruned"
        assert Path(pruned_dir(cfg["output_dir"], 1)).is_dir()


def test_a_sweep_sets_a_pruned_folder_aside_and_trains_the_complete_run(tmp_path):
    """A pruned trial's folder still where the cell's run goes (e.g. a kill between recording and renaming):
    the sweep moves it aside instead of adopting it as the finished cell."""
    from peftlab.lab.spec import load_spec
    from peftlab.lab.sweep import run_sweep

    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "runs"), "base": BASE,
                                    "grid": {"lr_ratio": [4]}}))
    (run,) = load_spec(spec).runs
    out = Path(run.output_dir)
    out.mkdir(parents=True)
    (out / "result.json").write_text(json.dumps(result(run.config, epochs=1, stopped=True)))
    outcome = run_sweep(load_spec(spec), train_fn=fake_train, progress=False)
    assert outcome.counts["ok"] == 1
    assert [c["epoch"] for c in epoch_calls(tmp_path / "runs")] == [1, 2, 3, 4]  # trained, all 4 epochs
    assert json.loads((out / "result.json").read_text())["stopped_early"] is None
    assert (Path(pruned_dir(out, 1)) / "result.json").is_file()


def test_tune_then_sweep_of_the_same_grid_reruns_the_pruned_cells(tmp_path):
    """The done-when check: pruned trials are stored apart; the sweep trains exactly the cells without a
    complete run (the pruned ones among them), skips the finished ones, and every cell ends complete."""
    from peftlab.lab.spec import load_spec
    from peftlab.lab.sweep import dry_run, run_sweep
    from peftlab.lab.tune.run import load_summary, run_tune
    from peftlab.lab.tune.spec import load_tune_spec
    from peftlab.lab.tune.study import StudyKeeper

    tune = load_tune_spec(spec_for(tmp_path, heldout_seeds=0))
    summary = run_tune(tune, train_fn=FAKE, progress=False)
    pruned_trials = [t for t in summary["trials"] if t["outcome"] == "pruned"]
    assert pruned_trials
    with Store(tune.store_path) as store:
        rows = store.rows()
    by_key = {r["key"]: r for r in rows}
    for trial in pruned_trials:  # the summary and the study's trial attributes follow the moved row
        row = by_key[trial["key"]]
        assert row["status"] == "pruned" and trial["key"] == pruned_key(config_key(row["config"]), trial["epochs"])
        assert config_key(row["config"]) not in by_key and Path(row["output_dir"]).is_dir()
        assert not Path(row["config"]["output_dir"]).exists()  # the complete run's folder is free
    keeper = StudyKeeper(tune, create=False)
    attrs = {t["number"]: t["attrs"]["key"] for t in keeper.trials()}
    keeper.close()
    assert all(attrs[t["number"]] == t["key"] for t in summary["trials"])
    assert load_summary(tune)["winner"]["params"] == summary["winner"]["params"]

    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"output_dir": str(tune.output_root), "store": str(tune.store_path),
                                    "base": BASE, "grid": {"lr_ratio": [1, 2, 4, 8, 16], "seed": tune.seed_list}}))
    sweep = load_spec(grid)
    complete_before = {k for k, r in by_key.items() if r["status"] in FINISHED and r["status"] != "pruned"}
    expected = [run for run in sweep.runs if run.key not in complete_before]
    pruned_cells = {config_key(by_key[t["key"]]["config"]) for t in pruned_trials}
    assert pruned_cells <= {run.key for run in expected}  # computed from the tune's own rows
    calls_before = len(epoch_calls(tune.output_root))
    dry_run(sweep)
    outcome = run_sweep(sweep, train_fn=fake_train, progress=False)
    assert outcome.ran == len(expected)  # the pruned cells re-run, the finished ones skipped
    trained = epoch_calls(tune.output_root)[calls_before:]
    assert {c["dir"] for c in trained} == {Path(run.output_dir).name for run in expected}
    # every re-run trains all its epochs afresh (lr_ratio 16 diverges in its second, as fake_train does)
    assert len(trained) == sum(2 if run.config["lr_ratio"] == 16 else BASE["epochs"] for run in expected)
    with Store(tune.store_path) as store:
        after = {r["key"]: r for r in store.rows()}
    for key in pruned_cells:
        assert after[key]["status"] == "ok" and len(after[key]["result"]["epochs_log"]) == BASE["epochs"]
    assert all(after[t["key"]]["status"] == "pruned" for t in pruned_trials)  # the trials are still there
    assert outcome.counts["ok"] + outcome.counts["diverged"] == len(sweep.runs)
    assert run_sweep(load_spec(grid), train_fn=fake_train, progress=False).ran == 0  # and now it is complete


def test_dry_run_calls_pruned_cells_to_run(tmp_path, capsys):
    """A sweep's --dry-run against an unmigrated (schema-1) tune store: the pruned trial is not a finished cell."""
    from peftlab.lab.spec import load_spec
    from peftlab.lab.sweep import dry_run

    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "runs"), "base": BASE,
                                    "grid": {"lr_ratio": [2, 4]}}))
    sweep = load_spec(spec)
    two, four = sweep.runs
    sweep.store_path.parent.mkdir(parents=True)
    schema1_store(sweep.store_path, [("ok", two.config, result(two.config), None),
                                      ("ok", four.config, result(four.config, epochs=1, stopped=True), None)])
    dry_run(sweep)
    out = capsys.readouterr().out.splitlines()
    assert "pruned" in out[1] and out[-1].startswith("2 runs: 1 finished, 0 failed, 1 to run")


@pytest.mark.parametrize("spans, hours", [
    ([("00:00", "01:00"), ("00:30", "02:00")], 2.0),  # two workers overlapping: counted once
    ([("00:00", "01:00"), ("05:00", "06:00")], 2.0),  # a pause between sessions: left out
    ([("00:00", "03:00"), ("01:00", "02:00")], 3.0),  # a run inside another
    ([("00:00", "01:00"), ("01:00", "01:30"), (None, None)], 1.5),  # touching; a row never started
])
def test_a_studys_wall_time_is_the_union_of_its_runs_intervals(spans, hours):
    from peftlab.lab.store_schema import busy_seconds

    rows = [{"started": start and f"2026-12-05T{start}:00.000+00:00",
             "finished": end and f"2026-12-05T{end}:00.000+00:00"} for start, end in spans]
    assert busy_seconds(rows) == pytest.approx(hours * 3600)
