"""`peftlab store check`: a store built by a real sweep (fake train function), then corrupted on purpose one way
at a time; the check names each problem (key, what, fix) and exits 1, `--repair` fixes what it safely can and
a second check is clean where it should be; a repair is idempotent and never deletes a row."""

from __future__ import annotations

import json
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from peftlab.cli.main import main
from peftlab.lab.spec import load_spec
from peftlab.lab.store import Store, short_key
from peftlab.lab.store_schema import pruned_key
from peftlab.lab.store_check import check_store
from peftlab.lab.sweep import run_sweep

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sweep import FAKE_BASE, fake_train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def swept(tmp_path):
    """A finished 4-run sweep (3 ok, 1 failed: lr_ratio 8 raises) and its store."""
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "runs"), "base": FAKE_BASE,
                                    "grid": {"lr_ratio": [1, 8], "seed": [0, 1]}}))
    sweep = load_spec(spec)
    run_sweep(sweep, train_fn=fake_train, progress=False)
    return sweep


def store_cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["store", "check", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def rows_by_status(sweep, status: str) -> list[dict]:
    with Store(sweep.store_path) as store:
        return [r for r in store.rows(parse=False) if r["status"] == status]


def sql(sweep, statement: str, *params) -> None:
    with sqlite3.connect(sweep.store_path) as conn:
        conn.execute(statement, params)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_clean_sweep_store_is_clean(swept, capsys):
    code, out, _ = store_cli(capsys, swept.store_path)
    assert code == 0 and out.strip().endswith("clean")
    assert "4 row(s) (2 ok, 2 failed), schema 2, integrity ok" in out
    code, out, _ = store_cli(capsys, swept.output_root, "--json")  # the folder holding it works too
    assert code == 0 and json.loads(out)["clean"] is True


def test_each_deliberate_corruption_is_found_and_repaired(swept, capsys):
    ok_rows = rows_by_status(swept, "ok")
    failed = rows_by_status(swept, "failed")[0]
    bad_json, mismatch = ok_rows
    # 1. a finished row whose result is not JSON (a torn write)
    sql(swept, "UPDATE runs SET result = ? WHERE key = ?", bad_json["result"][:25], bad_json["key"])
    # 2. a finished row whose result says another status
    relabel = {**json.loads(mismatch["result"]), "status": "collapsed", "status_reason": "fell to chance"}
    sql(swept, "UPDATE runs SET result = ? WHERE key = ?", json.dumps(relabel), mismatch["key"])
    # 3. a running row whose process is gone (a SIGKILLed sweep)
    owner = f"{socket.gethostname()}|{dead_pid()}|1"
    sql(swept, "UPDATE runs SET status = 'running', owner = ? WHERE key = ?", owner, failed["key"])
    # 4. a truncated result.json in a finished run's folder
    ok_folder = Path(mismatch["output_dir"]) / "result.json"
    ok_folder.write_text(ok_folder.read_text()[:40])

    found = check_store(swept.store_path)
    code, out, err = store_cli(capsys, swept.store_path)
    assert code == 1
    lines = [line for line in out.splitlines() if line.startswith(tuple(short_key(r["key"]) for r in ok_rows + [failed]))]
    assert len(lines) == len(found.problems) == 4  # one line per problem, each naming key, what and fix
    assert all("; fix: " in line for line in lines)
    assert f"{short_key(bad_json['key'])}: ok, but its result does not parse" in out
    assert f"{short_key(mismatch['key'])}: ok, but its result says collapsed" in out
    assert f"{short_key(failed['key'])}: running, but its owner (pid" in out and "is gone" in out
    assert "result.json does not parse" in out
    assert "4 problem(s); peftlab store check --repair fixes 4 of them" in err

    code, out, _ = store_cli(capsys, swept.store_path, "--repair")
    assert code == 0, out
    assert out.count("repaired ") == 4 and "clean after the repairs" in out
    with Store(swept.store_path) as store:
        rows = {r["key"]: r for r in store.rows()}
    assert len(rows) == 4  # nothing deleted
    assert rows[bad_json["key"]]["status"] == "failed" and "its result was unreadable" in rows[bad_json["key"]]["error"]
    assert rows[mismatch["key"]]["status"] == "collapsed"
    assert rows[failed["key"]]["status"] == "pending" and rows[failed["key"]]["owner"] is None
    assert json.loads(ok_folder.read_text())["status"] == "collapsed"  # rewritten from the store's copy

    code, out, _ = store_cli(capsys, swept.store_path, "--repair")  # idempotent
    assert code == 0 and "repaired" not in out.replace("nothing to repair", "") and "nothing to repair" in out
    # and the next sweep picks up the requeued run (trained afresh: its folder held a failed attempt)
    outcome = run_sweep(load_spec(swept.spec_path), train_fn=fake_train, progress=False, retry_failed=True)
    assert outcome.all_finished and check_store(swept.store_path).clean


def test_what_repair_cannot_fix_is_reported_and_left(swept, capsys):
    first, second = rows_by_status(swept, "ok")
    # a row filed under another run's key (its config edited): a mislabelled row
    config = json.loads(first["config"])
    sql(swept, "UPDATE runs SET config = ? WHERE key = ?", json.dumps({**config, "seed": 99}), first["key"])
    # two rows naming one folder
    sql(swept, "UPDATE runs SET output_dir = ? WHERE key = ?", first["output_dir"], second["key"])
    code, out, _ = store_cli(capsys, swept.store_path, "--repair")
    assert code == 1
    assert f"{short_key(first['key'])}: its key is not its config's" in out
    assert f"{short_key(second['key'])}: shares its run folder" in out
    assert "repaired nothing: no problem here can be fixed safely" in out
    with Store(swept.store_path) as store:
        assert store.get(first["key"])["config"]["seed"] == 99  # left as it was


def test_failed_without_error_pruned_under_complete_key_other_host_and_orphans(swept, capsys):
    ok, other = rows_by_status(swept, "ok")
    failed = rows_by_status(swept, "failed")[0]
    sql(swept, "UPDATE runs SET error = NULL WHERE key = ?", failed["key"])
    pruned = {**json.loads(ok["result"]), "status": "pruned", "epochs_run": 1,
              "stopped_early": {"epoch": 1, "reason": "asha"}}
    sql(swept, "UPDATE runs SET status = 'pruned', result = ? WHERE key = ?", json.dumps(pruned), ok["key"])
    shutil.rmtree(ok["output_dir"])  # the trial's folder went with it
    elsewhere = f"elsewhere-{socket.gethostname()}|4242|1"
    sql(swept, "UPDATE runs SET status = 'running', owner = ? WHERE key = ?", elsewhere, other["key"])
    sql(swept, "INSERT INTO owners (owner, beat) VALUES (?, ?)", elsewhere, time.time())  # beating: held there
    orphan = swept.output_root / "rte-lora-qv-l1-s7-000000000000"
    orphan.mkdir()
    (orphan / "config.yaml").write_text("task: rte\n")

    code, out, _ = store_cli(capsys, swept.store_path, "--repair")
    assert short_key(other["key"]) not in out  # another machine's run that still beats: not a problem
    assert f"{short_key(failed['key'])}: failed, but no error is recorded" in out
    assert f"{short_key(ok['key'])}: a pruned trial under the key of its config's complete run" in out
    assert f"{orphan}: a run folder no row of this store names" in out
    assert code == 1  # the orphan is left for the user
    with Store(swept.store_path) as store:
        assert store.get(other["key"])["status"] == "running"
        assert store.get(ok["key"]) is None and store.get(pruned_key(ok["key"], 1))["status"] == "pruned"
        assert "no error was recorded" in store.get(failed["key"])["error"]
    shutil.rmtree(orphan)
    code, out, _ = store_cli(capsys, swept.store_path)
    assert code == 0, out


def test_another_machines_run_whose_heartbeat_lapsed_is_requeued(swept, capsys):
    """A run held on a machine that died (its beat older than the lease) is no longer stuck running forever."""
    from peftlab.lab.store_owner import LEASE_SECONDS

    ok = rows_by_status(swept, "ok")[0]
    lost = f"lost-{socket.gethostname()}|4242|1"
    sql(swept, "UPDATE runs SET status = 'running', owner = ? WHERE key = ?", lost, ok["key"])
    sql(swept, "INSERT INTO owners (owner, beat) VALUES (?, ?)", lost, time.time() - LEASE_SECONDS - 30)
    code, out, _ = store_cli(capsys, swept.store_path)
    assert code == 1 and f"{short_key(ok['key'])}: running, but its owner (pid 4242 on lost-" in out
    assert "stopped beating" in out
    code, out, _ = store_cli(capsys, swept.store_path, "--repair")
    with Store(swept.store_path) as store:
        assert store.get(ok["key"])["status"] == "pending"


def test_a_truncated_store_file_is_found(swept, capsys, tmp_path):
    data = swept.store_path.read_bytes()
    damaged = tmp_path / "damaged.sqlite"
    damaged.write_bytes(data[: len(data) // 2])
    code, out, _ = store_cli(capsys, damaged)
    assert code == 1
    assert "store: " in out and ("integrity check failed" in out or "the file is damaged" in out
                                 or "rows cannot be read" in out)
    assert "fix: restore the store from a copy" in out
    code, _, _ = store_cli(capsys, damaged, "--repair")
    assert code == 1 and damaged.stat().st_size == len(data) // 2  # nothing it can do: the file is left as it is


@pytest.mark.parametrize("case", ["missing", "folder-without-store", "text-file", "other-sqlite"])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case):
    path = tmp_path / "x.sqlite"
    if case == "folder-without-store":
        path = tmp_path
    elif case == "text-file":
        path.write_text("not a database\n")
    elif case == "other-sqlite":
        sqlite3.connect(path).execute("CREATE TABLE t (a)").connection.close()
    code, out, err = store_cli(capsys, path)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("peftlab: error: ") and "fix: " in err


def test_the_committed_stores_check_clean_and_are_left_as_they_are(capsys):
    stores = sorted((REPO / "docs" / "study").glob("*.sqlite"))
    assert stores
    before = {p: p.read_bytes() for p in stores}
    for path in stores:
        code, out, _ = store_cli(capsys, path)
        assert code == 0, out
    assert {p: p.read_bytes() for p in stores} == before
    assert not [p for p in (REPO / "docs" / "study").iterdir() if p.name.endswith(("-wal", "-shm"))]
