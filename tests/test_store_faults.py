"""Results stores under concurrency and faults, with real processes and a fake train function (test_tune's:
epochs of made-up metrics, a checkpoint after each) so that every case takes seconds:

* two `peftlab sweep` drivers on one store at once, and a sweep beside a `peftlab tune` on the same store:
  no lost, duplicated or mislabelled row, and each run (a complete run, or a pruned trial) trained once;
* a driver SIGKILLed while it writes the store, at the k-th SQL write statement for several k (a seam in
  SQLite's trace callback, so each trial dies inside another transaction), or after a run's result.json is
  written but before the store records it: after each kill `peftlab store check` finds nothing but stale
  running rows, and the next run picks the interrupted work up;
* a write that fails for a full disk: the driver runs with ``RLIMIT_FSIZE`` (SIGXFSZ ignored, so a write past
  the limit is an ``EFBIG`` OSError in SQLite, a log or a result.json) at several limits: it ends with one
  line, the store stays intact, no run is recorded failed because of the disk, and the next run completes.

This file is also the driver the tests start (``python tests/test_store_faults.py sweep|tune SPEC``).
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

TESTS = Path(__file__).resolve().parent
FAKE = "test_tune:fake_train"
SLEEP_ENV = "PEFTLAB_TEST_TUNE_SLEEP"  # seconds per fake epoch (test_tune's fake train)
KILL_AT_WRITE_ENV = "PEFTLAB_TEST_KILL_AT_WRITE"  # SIGKILL this driver at its k-th SQL write statement
KILL_AFTER_RESULT_ENV = "PEFTLAB_TEST_KILL_AFTER_RESULT"  # SIGKILL it once result.json of run N is written
BASE = {"model": "tiny-bert", "task": "rte", "epochs": 3, "lr": 1e-3}
WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER", "COMMIT")


# --------------------------------------------------------------------------- the driver (a child process)


def _kill_at_write(k: int) -> None:
    """Every SQLite connection of this process counts its write statements and SIGKILLs the process when the
    k-th starts (SQLite's trace callback runs before the statement does: a COMMIT never happens)."""
    real_connect, seen = sqlite3.connect, [0]

    def trace(statement: str) -> None:
        if statement.lstrip().upper().startswith(WRITES):
            seen[0] += 1
            if seen[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)

    def connect(*args, **kwargs):
        conn = real_connect(*args, **kwargs)
        conn.set_trace_callback(trace)
        return conn

    sqlite3.connect = connect


def _kill_after_result(n: int) -> None:
    """The n-th run this driver trains SIGKILLs it after writing its result.json, before the store records it."""
    import test_tune

    real, count = test_tune.fake_train, [0]

    def fake_train(cfg, on_epoch_end=None):
        result = real(cfg, on_epoch_end)
        count[0] += 1
        if count[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    test_tune.fake_train = fake_train


def drive(argv: list[str]) -> int:
    sys.path.insert(0, str(TESTS))
    if os.environ.get(KILL_AT_WRITE_ENV):
        _kill_at_write(int(os.environ[KILL_AT_WRITE_ENV]))
    if os.environ.get(KILL_AFTER_RESULT_ENV):
        _kill_after_result(int(os.environ[KILL_AFTER_RESULT_ENV]))
    import peftlab.lab.runner as runner_module
    from peftlab.cli.main import main

    runner_module.DEFAULT_TRAIN = FAKE  # what `peftlab sweep` / `peftlab tune` train with, in this process only
    return main(argv)


if __name__ == "__main__":
    sys.exit(drive(sys.argv[1:]))


# --------------------------------------------------------------------------- helpers (the tests' side)

import pytest  # noqa: E402

from peftlab.errors import PeftlabError  # noqa: E402
from peftlab.lab.spec import load_spec  # noqa: E402
from peftlab.lab.store import Store, config_key  # noqa: E402
from peftlab.lab.store_schema import PRUNED_MARK, SCHEMA_VERSION, unpruned_key  # noqa: E402
from peftlab.lab.store_check import check_store  # noqa: E402


def driver(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def sweep_spec(tmp_path: Path, grid: dict, **extra) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "runs"), "base": BASE, "grid": grid, **extra}))
    return path


def epoch_one_calls(root: Path) -> dict[str, int]:
    """How many times each run folder name started training (epoch 1 of test_tune's fake train)."""
    counts: dict[str, int] = {}
    path = root / "calls.jsonl"
    for line in (path.read_text().splitlines() if path.exists() else []):
        call = json.loads(line)
        if call["epoch"] == 1:
            counts[call["dir"]] = counts.get(call["dir"], 0) + 1
    return counts


def assert_store_honest(store_path: Path, expected_keys: set[str]) -> list[dict]:
    """Every expected run finished exactly once under its own key, each row naming its own run and status."""
    with Store(store_path) as store:
        rows = store.rows()
    complete = [r for r in rows if PRUNED_MARK not in r["key"]]
    assert expected_keys <= {r["key"] for r in complete}, "a run of the spec is missing from the store (lost)"
    for row in rows:
        assert row["status"] not in ("pending", "running", "failed"), (row["key"], row["status"], row["error"])
        assert config_key(row["result"]["config"]) == unpruned_key(row["key"]), "a row holds another run's result"
        assert config_key(row["config"]) == unpruned_key(row["key"])
    check = check_store(store_path)
    assert check.clean, [p.line() for p in check.problems]
    return rows


def one_line_error(err: str) -> str:
    """The error line of a driver's stderr: exactly one, no traceback (besides it: the progress bar and notes)."""
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("peftlab: error: ")]
    assert len(errors) == 1, err[-3000:]
    assert "\n" not in errors[0] and err.rstrip().endswith(errors[0]), err[-3000:]  # the last thing said
    return errors[0]


# --------------------------------------------------------------------------- two drivers at once


def test_two_sweep_drivers_on_one_store_train_each_run_once(tmp_path):
    spec = sweep_spec(tmp_path, {"lr_ratio": [1, 2, 4], "seed": [0, 1, 2]})
    env = {SLEEP_ENV: "0.2"}  # 0.6 s a run: the two drivers overlap for most of the sweep
    first, second = driver("sweep", str(spec), env=env), driver("sweep", str(spec), env=env)
    results = [finish(first), finish(second)]
    for code, out, err in results:
        assert code == 0, err[-3000:]
        assert "9 runs: 9 ok;" in out  # each driver waits for the runs the other holds, so both see the end
    keys = set(load_spec(spec).keys)
    rows = assert_store_honest(tmp_path / "runs" / "results.sqlite", keys)
    assert len(rows) == 9 and all(r["attempts"] == 1 for r in rows)
    calls = epoch_one_calls(tmp_path / "runs")
    assert len(calls) == 9 and set(calls.values()) == {1}  # each run trained once, by one of the two


def test_a_sweep_and_a_tune_share_one_store(tmp_path):
    """The tune's trials are the sweep's cells at the base seed: whichever driver claims a run trains it, the
    other adopts its result (or waits for it); a trial the tune prunes moves to its pruned key, and the sweep
    trains the complete run of that cell, once."""
    root = tmp_path / "runs"
    spec = sweep_spec(tmp_path, {"lr_ratio": [1, 2, 4, 8]})
    tune_spec = tmp_path / "tune.yaml"
    tune_spec.write_text(yaml.safe_dump({
        "output_dir": str(root), "base": BASE, "search": {"lr_ratio": [1, 2, 4, 8]}, "budget": {"grid_fraction": 1.0},
        "seeds": 2, "top_k": 1, "heldout_seeds": 0,
        "pruner": {"kind": "asha", "min_epochs": 1, "reduction_factor": 2}}))
    env = {SLEEP_ENV: "0.3"}
    tune = driver("tune", str(tune_spec), env=env)
    deadline = time.monotonic() + 60
    while not epoch_one_calls(root) and tune.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # the tune has begun its first trial: the sweep starts into the middle of the search
    sweep = driver("sweep", str(spec), env=env)
    (tune_code, tune_out, tune_err), (sweep_code, sweep_out, sweep_err) = finish(tune), finish(sweep)
    assert tune_code == 0, tune_out[-2000:] + tune_err[-3000:]
    assert sweep_code == 0, sweep_err[-3000:]
    assert "4 runs: 4 ok;" in sweep_out
    assert "trial" in tune_out and "failed" not in tune_out, tune_out
    rows = assert_store_honest(root / "results.sqlite", set(load_spec(spec).keys))
    pruned = [r for r in rows if PRUNED_MARK in r["key"]]
    calls = epoch_one_calls(root)
    for row in rows:
        if PRUNED_MARK in row["key"]:
            continue
        name = Path(row["output_dir"]).name
        trials = sum(1 for p in pruned if unpruned_key(p["key"]) == row["key"])
        assert calls.get(name) == 1 + trials, (name, calls.get(name), trials)  # the complete run once, each trial once
    assert all(Path(p["output_dir"]).is_dir() for p in pruned)  # a pruned trial's folder went with its row


def test_a_tune_trial_held_by_another_process_is_waited_for_not_failed(tmp_path):
    """Deterministic half of the case above: the tune's only trial is being trained by another live process
    (a sweep) when the tune reaches it. The tune waits for that run and takes its outcome; it neither trains it
    a second time nor records the trial failed."""
    import threading

    from peftlab.resolve import resolved_from_dict
    from peftlab.lab.store_owner import write_beat
    from peftlab.lab.tune.run import run_tune
    from peftlab.lab.tune.spec import load_tune_spec, run_config
    from test_tune import fake_train

    spec = tmp_path / "tune.yaml"
    spec.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "runs"), "base": BASE, "search": {"lr_ratio": [4]},
                                    "budget": {"grid_fraction": 1.0}, "seeds": 1, "top_k": 1, "heldout_seeds": 0}))
    tune = load_tune_spec(spec)
    run = run_config(tune, {"lr_ratio": 4.0}, tune.base_seed)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    owner = f"{socket.gethostname()}|{holder.pid}|holder"
    with Store(tune.store_path) as store:
        store.register([(run.key, run.config, run.output_dir)])
        store.conn.execute("UPDATE runs SET status = 'running', owner = ?, attempts = 1 WHERE key = ?",
                           (owner, run.key))
        write_beat(store.conn, owner, time.time())  # it holds the run (within the lease for this whole test)

    def the_other_process_finishes() -> None:
        deadline = time.monotonic() + 60
        while not tune.study_path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.0)  # the tune has asked for its trial and met the held run by now
        result = fake_train(resolved_from_dict(run.config))  # a store row holds a resolved config
        with Store(tune.store_path) as store:
            assert store.finish(run.key, result, owner=owner)
        holder.kill()

    other = threading.Thread(target=the_other_process_finishes)
    other.start()
    try:
        summary = run_tune(tune, train_fn=FAKE, progress=False)
    finally:
        other.join()
        holder.kill()
        holder.wait()
    (trial,) = summary["trials"]
    assert trial["outcome"] == "complete", trial
    assert summary["winner"]["params"] == {"lr_ratio": 4.0}
    assert epoch_one_calls(tmp_path / "runs") == {Path(run.output_dir).name: 1}  # trained once, by the other


def test_a_pruned_trial_is_found_after_a_sweep_queued_the_complete_run(tmp_path):
    """The race behind a tune trial read as failed beside a sweep: between the trial's pruning (its row moves to
    the pruned key) and the tune reading the outcome, the sweep registers the cell's complete run under the
    key. The trial's outcome is its pruned row, not that pending (or running) complete run."""
    from peftlab.lab.store_schema import pruned_key

    key, config = "ab" * 32, {"model": "tiny-bert"}
    with Store(tmp_path / "results.sqlite") as store:
        store.register([(key, config, str(tmp_path / "run"))])
        store.claim(key)
        assert store.finish(key, {"status": "pruned", "epochs_run": 1, "stopped_early": {"epoch": 1}})
        store.register([(key, config, str(tmp_path / "run"))])  # the sweep's next round
        assert store.find(key, settled=True)["key"] == pruned_key(key, 1)
        assert store.find(key)["status"] == "pending"  # (the row under the key, for everyone else)
        store.claim(key)  # and while the sweep trains it
        assert store.find(key, settled=True)["key"] == pruned_key(key, 1)
        assert store.finish(key, {"status": "ok"})  # once the complete run is recorded, it is the one found
        assert store.find(key, settled=True)["key"] == key


# --------------------------------------------------------------------------- SIGKILL while writing


def test_sweep_killed_at_sql_writes_then_rerun_completes(tmp_path):
    spec = sweep_spec(tmp_path, {"lr_ratio": [1, 2], "seed": [0, 1, 2]})
    store_path = tmp_path / "runs" / "results.sqlite"
    kills = random.Random(25).sample(range(1, 30), 6)  # a full 6-run sweep makes about 40 write statements
    killed = 0
    for k in kills:
        code, _, err = finish(driver("sweep", str(spec), env={KILL_AT_WRITE_ENV: str(k)}))
        if code == 0:
            continue  # the sweep was done before its k-th write (later trials then have nothing left to do)
        assert code == -signal.SIGKILL, err[-3000:]
        killed += 1
        if store_path.exists():  # after a kill: nothing but stale running rows, never a damaged or torn store
            check = check_store(store_path)
            assert check.integrity == "ok"
            assert all("running, but its owner" in p.what for p in check.problems), [p.line() for p in check.problems]
    assert killed >= 3
    code, out, err = finish(driver("sweep", str(spec)))
    assert code == 0 and "6 runs: 6 ok;" in out, err[-3000:]
    assert_store_honest(store_path, set(load_spec(spec).keys))
    calls = epoch_one_calls(tmp_path / "runs")
    assert len(calls) == 6 and sum(calls.values()) <= 6 + killed  # a kill costs at most the run it interrupted


def test_sweep_killed_after_a_result_is_written_adopts_it(tmp_path):
    spec = sweep_spec(tmp_path, {"lr_ratio": [1, 2]})
    code, _, _ = finish(driver("sweep", str(spec), env={KILL_AFTER_RESULT_ENV: "2"}))
    assert code == -signal.SIGKILL
    store_path = tmp_path / "runs" / "results.sqlite"
    problems = [p.what for p in check_store(store_path).problems]
    assert len(problems) == 1 and "running, but its owner" in problems[0]  # the run whose record was cut off
    code, out, err = finish(driver("sweep", str(spec)))
    assert code == 0 and "2 runs: 2 ok;" in out, err[-3000:]
    assert_store_honest(store_path, set(load_spec(spec).keys))
    assert set(epoch_one_calls(tmp_path / "runs").values()) == {1}  # the finished run was adopted, not retrained


def test_a_commit_that_fails_leaves_no_transaction_open(tmp_path):
    """A COMMIT SQLite refuses (a full disk, here an authorizer) used to leave the transaction open, holding
    the store's write lock for as long as the process lived: every other driver then waited, then failed."""
    key = "cd" * 32
    store = Store(tmp_path / "results.sqlite")
    store.register([(key, {"model": "tiny-bert"}, str(tmp_path / "run"))])

    def deny_commit(action, arg, *rest):
        return sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_TRANSACTION and arg == "COMMIT" else sqlite3.SQLITE_OK

    store.conn.set_authorizer(deny_commit)
    with pytest.raises(sqlite3.DatabaseError):
        store.claim(key)
    store.conn.set_authorizer(None)
    assert not store.conn.in_transaction  # rolled back, the lock released
    with Store(tmp_path / "results.sqlite", timeout=2) as other:
        assert other.claim(key) is not None  # another process can write at once
    store.close()


def test_a_reader_waits_for_a_store_another_driver_is_creating(tmp_path):
    """Two drivers started at once: the second's preflight opened the store read-only between the first's
    connect (an empty file) and its schema commit, and took it for a foreign file ("no such table: meta")."""
    path = tmp_path / "results.sqlite"
    creator = sqlite3.connect(path)  # the file exists, its tables do not yet
    creator.execute("PRAGMA journal_mode = WAL")

    def create_later():
        time.sleep(0.5)
        Store(path).close()

    thread = threading.Thread(target=create_later)
    thread.start()
    with Store(path, create=False) as reader:
        assert reader.schema == SCHEMA_VERSION and reader.statuses() == {}
    thread.join()
    creator.close()


def test_an_empty_file_is_still_refused_as_a_store(tmp_path, monkeypatch):
    import peftlab.lab.store as store_module

    monkeypatch.setattr(store_module, "_CREATION_GRACE_S", 0.2)
    path = tmp_path / "results.sqlite"
    sqlite3.connect(path).close()
    path.write_bytes(b"")
    with pytest.raises(PeftlabError, match="not a peftlab results store"):
        Store(path, create=False)


# --------------------------------------------------------------------------- a full disk


def _file_size_limit(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


@pytest.mark.slow
@pytest.mark.parametrize("what", ["sweep", "tune"])
def test_a_full_disk_ends_with_one_line_and_the_next_run_completes(tmp_path, what):
    root = tmp_path / "runs"
    if what == "sweep":
        spec = sweep_spec(tmp_path, {"lr_ratio": [1, 2], "seed": [0, 1, 2]})
        expected = set(load_spec(spec).keys)
    else:
        spec = tmp_path / "tune.yaml"
        spec.write_text(yaml.safe_dump({
            "output_dir": str(root), "base": BASE, "search": {"lr_ratio": [1, 2, 4]}, "budget": {"grid_fraction": 1.0},
            "seeds": 2, "top_k": 1, "heldout_seeds": 0}))
        expected = set()
    store_path = root / "results.sqlite"
    # a full disk met inside the run itself (the train function's own file, before any store write fails):
    # the run is handed back, never recorded failed
    calls = root / "calls.jsonl"
    calls.parent.mkdir(parents=True, exist_ok=True)
    with open(calls, "a") as handle:  # an epoch-0 line the call counts ignore, past the limit below
        handle.write(json.dumps({"dir": "padding", "epoch": 0, "pad": "x" * 200_000}) + "\n")
    code, out, err = finish(driver(what, str(spec), preexec_fn=_file_size_limit(calls.stat().st_size)))
    assert code == 2 and "no space left for run " in one_line_error(err) and "File too large" in err
    with Store(store_path) as store:
        assert not [r for r in store.rows() if r["status"] in ("failed", "running")]
    calls.write_text("".join(line for line in calls.read_text().splitlines(True) if '"padding"' not in line))
    # then the store's own writes (its WAL) meet the limit, at a different point at each limit
    failures = 0
    for limit in (12_000, 70_000, 100_000):  # the store cannot open; fails mid-sweep; fails late
        code, out, err = finish(driver(what, str(spec), preexec_fn=_file_size_limit(limit)))
        if code == 0:
            continue
        failures += 1
        line = one_line_error(err)
        assert "File too large" in line or "disk" in line or "space" in line, line
        assert "fix: " in line
        if store_path.exists():
            check = check_store(store_path)
            assert check.integrity == "ok", check.integrity
            assert all("running, but its owner" in p.what for p in check.problems), [p.line() for p in check.problems]
            with Store(store_path) as store:
                assert not [r for r in store.rows() if r["status"] == "failed"], "a full disk is not the run's failure"
    assert failures >= 2
    code, out, err = finish(driver(what, str(spec)))
    assert code == 0, out[-2000:] + err[-3000:]
    assert_store_honest(store_path, expected)
