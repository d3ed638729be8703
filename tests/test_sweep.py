"""`peftlab sweep` and the results store: grid expansion, spec errors, concurrent writers, skip/resume/retry,
worker processes, and a real tiny-model sweep killed with SIGKILL and re-run."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from peftlab.errors import PeftlabError
from peftlab.lab.store import Store, config_key, short_key
from peftlab.lab import store_owner
from peftlab.lab.store_owner import LEASE_SECONDS, owner_alive, process_identity, read_beats, write_beat
from peftlab.lab.spec import expand, load_spec, run_name
from peftlab.lab.sweep import run_sweep

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
from conftest import DATA_DIR as DATA, needs_data  # noqa: E402
from fake_results import checked  # noqa: E402


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# --------------------------------------------------------------------------- a fake train function
# Importable by name ("test_sweep:fake_train") so that spawned workers and subprocesses can use it.

FAKE_SLEEP_ENV = "PEFTLAB_TEST_FAKE_SLEEP"


def fake_train(cfg) -> dict:
    """Treats its output folder like peftlab.training.loop.train; lr_ratio 8 raises, lr_ratio 16 collapses."""
    import shutil

    assert cfg.resolved, "a run gets the config its spec resolved (train() would not resolve it again)"

    out = Path(cfg.output_dir)
    result_file, checkpoint = out / "result.json", out / "checkpoint" / "state.json"
    if cfg.overwrite and out.exists():
        shutil.rmtree(out)
    finished = result_file.is_file() and json.loads(result_file.read_text())["status"] != "failed"
    if finished and not cfg.resume:
        raise PeftlabError(f"{out} already holds a finished run")
    if not cfg.resume and out.exists() and any(out.iterdir()):
        raise PeftlabError(f"{out} holds an unfinished run")
    mode = ("finished" if finished else "resume" if checkpoint.is_file() else "restart") if cfg.resume else "fresh"
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / "calls.jsonl", "a") as handle:
        handle.write(json.dumps({"dir": out.name, "resume": cfg.resume, "overwrite": cfg.overwrite,
                                 "mode": mode, "pid": os.getpid()}) + "\n")
    if mode == "finished":
        return json.loads(result_file.read_text())
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    time.sleep(float(os.environ.get(FAKE_SLEEP_ENV, "0")))
    if cfg.optim.lr_ratio == 8:
        raise RuntimeError(f"boom at lr_ratio {cfg.optim.lr_ratio}")
    accuracy = 0.6 + 0.01 * cfg.seed
    result = {"schema_version": 1, "status": "collapsed" if cfg.optim.lr_ratio == 16 else "ok",
              "status_reason": "fell to chance" if cfg.optim.lr_ratio == 16 else None, "task": cfg.task,
              "method": cfg.method, "seed": cfg.seed, "epochs": cfg.epochs, "config": cfg.to_dict(),
              "primary_metric": "accuracy", "best": {"epoch": 1, "metrics": {"accuracy": accuracy}},
              "final": {"metrics": {"accuracy": accuracy}}, "trainable_params": {"adapter": 10, "head": 2, "total": 12},
              "majority_baseline": 0.5}
    result = checked(result)
    result_file.write_text(json.dumps(result))
    return result


def killed_worker_train(cfg) -> dict:
    """fake_train, except that lr_ratio 32 kills its own process mid-run (as the OOM killer would)."""
    if cfg.optim.lr_ratio == 32:
        os.kill(os.getpid(), signal.SIGKILL)
    return fake_train(cfg)


def calls(root: Path) -> list[dict]:
    path = root / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


FAKE_BASE = {"model": "tiny-bert", "task": "rte", "epochs": 1}


# --------------------------------------------------------------------------- grid expansion


def test_expand_is_the_cartesian_product_in_axis_order():
    cells = expand({"model": "m", "lr": 1e-4}, {"lr_ratio": [1, 2], "seed": [0, 1, 2]})
    assert len(cells) == 6
    assert [(c["lr_ratio"], c["seed"]) for c in cells] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert all(c["model"] == "m" and c["lr"] == 1e-4 for c in cells)


def test_expand_zip_groups_vary_together():
    cells = expand({}, {"seed": [0, 1]}, [{"task": ["rte", "mrpc", "cola"], "epochs": [10, 5, 3]},
                                          {"lr": [1e-4, 2e-4], "lr_ratio": [1, 4]}])
    assert len(cells) == 2 * 3 * 2
    assert {(c["task"], c["epochs"]) for c in cells} == {("rte", 10), ("mrpc", 5), ("cola", 3)}
    assert {(c["lr"], c["lr_ratio"]) for c in cells} == {(1e-4, 1), (2e-4, 4)}
    assert cells[0] == {"seed": 0, "task": "rte", "epochs": 10, "lr": 1e-4, "lr_ratio": 1}


def test_expand_zip_length_mismatch_is_a_user_error():
    with pytest.raises(PeftlabError, match=r"zip\[0\].*different lengths.*task: 2, epochs: 3"):
        expand({}, {}, [{"task": ["rte", "mrpc"], "epochs": [1, 2, 3]}])


@pytest.mark.parametrize("grid, zips, message", [
    ({"lr": []}, None, "grid.lr is an empty list"),
    ({"lr": 1e-4}, None, "grid.lr must be a list"),
    ({"lr": [1e-4]}, [{"lr": [1e-4]}], "'lr' is swept twice"),
    ({}, [{"task": []}], r"zip\[0\].task is an empty list"),
    ({}, [{}], r"zip\[0\] must be a non-empty mapping"),
])
def test_expand_rejects_bad_grids(grid, zips, message):
    with pytest.raises(PeftlabError, match=message):
        expand({}, grid, zips)


# --------------------------------------------------------------------------- specs


def test_load_spec_resolves_runs_keys_and_folders(tmp_path):
    spec = write_spec(tmp_path / "demo.yaml", {"base": {**FAKE_BASE, "max-train-samples": 16},
                                               "grid": {"targets": ["q,v", ["q", "k", "v"]], "seed": [0, 1]}})
    sweep = load_spec(spec, output_dir=str(tmp_path / "runs"))
    assert len(sweep.runs) == 4 and sweep.axes == ["targets", "seed"]
    assert sweep.store_path == tmp_path / "runs" / "results.sqlite"
    first = sweep.runs[0]
    assert first.config["targets"] == "q,v" and first.config["max_train_samples"] == 16
    assert first.output_dir == str(tmp_path / "runs" / f"{run_name(first.config)}-{short_key(first.key)}")
    # readable: task, method, targets, lambda, seed, then the key's hash
    assert Path(first.output_dir).name.startswith(f"{first.config['task']}-{first.config['method']}-qv-l1-s0-")
    assert first.key == config_key(first.config)  # output_dir is not part of the key
    assert sweep.runs[2].config["targets"] == "q,k,v"
    # the same config under another root has the same key
    again = load_spec(spec, output_dir=str(tmp_path / "elsewhere"))
    assert [r.key for r in again.runs] == [r.key for r in sweep.runs]
    # default root: runs/<spec stem>
    assert load_spec(spec).output_root == Path("runs") / "demo"


def test_load_spec_drops_duplicate_cells(tmp_path):
    spec = write_spec(tmp_path / "dup.yaml", {"base": FAKE_BASE, "grid": {"lr_ratio": [1, 1.0, 2]}})
    sweep = load_spec(spec)
    assert len(sweep.runs) == 2 and sweep.duplicates == 1


@pytest.mark.parametrize("spec, message", [
    ({"base": {"lr_rato": 2}}, "unknown config key 'lr_rato'.*did you mean 'lr_ratio'"),
    ({"grid": {"metod": ["lora"]}}, "unknown config key 'metod'.*did you mean 'method'"),
    ({"zip": [{"tsak": ["rte"]}]}, "unknown config key 'tsak'.*did you mean 'task'"),
    ({"gird": {"seed": [0]}}, "unknown sweep spec key 'gird'.*did you mean 'grid'"),
    ({"grid": {"seed": []}}, "grid.seed is an empty list"),
    ({"base": {"output_dir": "x"}}, "'output_dir' cannot be set in base"),
    ({"grid": {"resume": [True]}}, "'resume' cannot be set in grid"),
    # a value is checked where the spec gives it: the message names that key
    ({"grid": {"lr_ratio": [1, -2]}}, r"--lr-ratio must be a finite number > 0, got -2.0 \(.*: grid.lr_ratio\)"),
    ({"grid": {"method": ["lora", "lorra"]}}, r"unknown method 'lorra' \(did you mean 'lora'\?\) \(.*: grid.method\)"),
    # a problem of a run's whole config is named by that run
    ({"grid": {"rank": [4], "packing": [False, True]}}, r"run \{rank=4 packing=.*\}: --packing packs decoder"),
])
def test_bad_specs_are_one_line_user_errors(tmp_path, spec, message):
    full = {**spec, "base": {**FAKE_BASE, **spec.get("base", {})}}
    path = write_spec(tmp_path / "bad.yaml", full)
    with pytest.raises(PeftlabError, match=message) as info:
        load_spec(path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec", sorted((REPO / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_specs_load_with_the_run_count_they_state(spec):
    import re

    stated = re.search(r"^# Runs: .*= (\d+)", spec.read_text(), re.MULTILINE)
    assert stated, f"{spec.name} must state its run count in a '# Runs: ... = N' comment"
    sweep = load_spec(spec)
    assert len(sweep.runs) == int(stated.group(1)) and sweep.duplicates == 0
    if spec.stem.endswith("_minilm"):  # the name says the model: MiniLM-L6 only ...
        assert all(run.config["model"] == "minilm-l6" for run in sweep.runs)
    elif spec.stem.endswith("_roberta"):  # ... or RoBERTa (GPU recipes), never the fast CPU model
        assert not any(run.config["model"] == "minilm-l6" for run in sweep.runs)


def main(argv):  # imported lazily: spawned children import this module and should start fast
    from peftlab.cli.main import main as cli_main

    return cli_main(argv)


def test_missing_spec_exits_2(tmp_path, capsys):
    assert main(["sweep", str(tmp_path / "nope.yaml")]) == 2
    assert "sweep spec not found" in capsys.readouterr().err


def test_dry_run_lists_every_run_and_the_size(tmp_path, capsys):
    spec = write_spec(tmp_path / "dry.yaml", {"output_dir": str(tmp_path / "runs"), "base": FAKE_BASE,
                                              "grid": {"lr_ratio": [1, 2, 4]},
                                              "zip": [{"seed": [0, 1], "max_train_samples": [8, 16]}]})
    assert main(["sweep", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    plan = [line for line in out if not line.startswith("preflight")]  # then what the preflight found (issue 38)
    assert len(plan) == 7
    assert "lr_ratio=1 seed=0 max_train_samples=8" in plan[0]
    assert plan[-1].startswith("6 runs: 0 finished, 0 failed, 6 to run") and out[-1] == "preflight: no problem found"
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


# --------------------------------------------------------------------------- the store under concurrency


def _store_writer(path: str, keys: list[str], name: str, out: str, barrier) -> None:
    store = Store(path)
    store.register((k, {"name": k}, f"/tmp/{k}") for k in keys)
    barrier.wait(60)  # both claim at the same time
    mine = []
    for key in keys:
        row = store.claim(key)
        if row is None:  # the other writer claimed it first
            continue
        mine.append(row["key"])
        time.sleep(0.005)  # "training"
        assert store.finish(row["key"], {"status": "ok", "by": name})
    Path(out).write_text(json.dumps(mine))
    store.close()


def test_store_two_concurrent_writers_lose_and_duplicate_nothing(tmp_path):
    path = tmp_path / "results.sqlite"
    keys = [f"{i:064x}" for i in range(60)]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_store_writer,
                         args=(str(path), keys, f"w{i}", str(tmp_path / f"w{i}.json"), barrier)) for i in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    claimed = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    assert sorted(claimed[0] + claimed[1]) == sorted(keys)  # every run claimed exactly once
    assert claimed[0] and claimed[1]  # both writers did work
    with Store(path) as store:
        assert store.journal_mode == "wal"
        rows = store.rows()
        assert sorted(r["key"] for r in rows) == sorted(keys)
        assert all(r["status"] == "ok" and r["attempts"] == 1 and r["result"]["status"] == "ok" for r in rows)
        by = {r["key"]: r["result"]["by"] for r in rows}
        assert all(by[k] == "w0" for k in claimed[0]) and all(by[k] == "w1" for k in claimed[1])
        assert sqlite3.connect(path).execute("SELECT count(*) FROM runs").fetchone()[0] == len(keys)


def _proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` (Linux), None when it is gone: how this test sees that workers exited."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]


def test_owner_liveness_is_read_from_the_heartbeat():
    now = time.time()
    host = socket.gethostname()
    me = process_identity()
    assert me.startswith(f"{host}|{os.getpid()}|") and process_identity() == me
    assert owner_alive(me, now, now) and owner_alive(me, now - LEASE_SECONDS + 1, now)
    assert not owner_alive(me, now - LEASE_SECONDS - 1, now)  # stopped beating: gone, whatever /proc says
    assert not owner_alive(me, None, now)  # never beat (e.g. a recycled pid under another owner string)
    assert not owner_alive(None, now, now) and not owner_alive("not an owner", now, now)
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not owner_alive(f"{host}|{proc.pid}|x", now, now)  # this machine, pid gone: gone before its lease ends
    elsewhere = f"another-host-{host}|{proc.pid}|x"
    assert owner_alive(elsewhere, now, now)  # another machine that beats holds its run ...
    assert not owner_alive(elsewhere, now - LEASE_SECONDS - 1, now)  # ... until its beat lapses


def test_a_claim_beats_until_the_store_closes_and_a_lapsed_holder_is_requeued(tmp_path, monkeypatch):
    monkeypatch.setattr(store_owner, "BEAT_SECONDS", 0.05)
    store = Store(tmp_path / "results.sqlite")
    store.register([("a", {"seed": 0}, str(tmp_path / "a")), ("b", {"seed": 1}, str(tmp_path / "b"))])
    assert read_beats(store.conn) == {}  # nobody holds anything yet
    assert store.claim("a") is not None
    first = read_beats(store.conn)[store.owner]
    time.sleep(0.3)
    renewed = read_beats(store.conn)[store.owner]
    assert renewed > first  # the daemon thread renews the beat while the run is held
    assert store.holder_alive(store.owner)
    # a holder on another machine: held while it beats, claimable again once its beat is older than the lease
    other = f"another-host-{socket.gethostname()}|4242|x"
    store.conn.execute("UPDATE runs SET status = 'running', owner = ? WHERE key = 'b'", (other,))
    write_beat(store.conn, other, time.time())
    assert store.prepare(["a", "b"])["running"] == 0 and store.statuses() == {"a": "running", "b": "running"}
    write_beat(store.conn, other, time.time() - LEASE_SECONDS - 1)
    assert store.prepare(["a", "b"])["running"] == 1 and store.statuses() == {"a": "running", "b": "pending"}
    beat = store._heartbeat
    assert beat is not None and beat.is_alive()
    store.close()
    assert store._heartbeat is None and not beat.is_alive()  # the thread ends with the store that claimed


# --------------------------------------------------------------------------- sweeps with a fake train


def test_sweep_records_failures_skips_finished_and_retries_failed(tmp_path):
    root = tmp_path / "runs"
    spec = write_spec(tmp_path / "s.yaml", {"output_dir": str(root), "base": FAKE_BASE,
                                            "grid": {"lr_ratio": [1, 8, 16], "seed": [0, 1]}})
    sweep = load_spec(spec)
    outcome = run_sweep(sweep, train_fn=fake_train, progress=False)
    assert outcome.counts["ok"] == 2 and outcome.counts["failed"] == 2 and outcome.counts["collapsed"] == 2
    assert len(calls(root)) == 6
    with Store(sweep.store_path) as store:
        rows = {r["key"]: r for r in store.rows()}
    failed = [r for r in rows.values() if r["status"] == "failed"]
    assert all(r["error"] == "RuntimeError: boom at lr_ratio 8.0" and r["result"] is None for r in failed)
    assert all(r["seconds"] is not None and r["started"] and r["finished"] for r in rows.values())
    log = (root / "logs" / f"{short_key(failed[0]['key'])}.log").read_text()
    assert "Traceback" in log and "boom at lr_ratio" in log

    # re-running skips every finished run and leaves failed ones alone
    again = run_sweep(load_spec(spec), train_fn=fake_train, progress=False)
    assert again.ran == 0 and len(calls(root)) == 6
    # --retry-failed reruns exactly the failed ones
    retried = run_sweep(load_spec(spec), train_fn=fake_train, progress=False, retry_failed=True)
    assert retried.ran == 2 and len(calls(root)) == 8
    with Store(sweep.store_path) as store:
        assert sorted(r["attempts"] for r in store.rows()) == [1, 1, 1, 1, 2, 2]
    log = (root / "logs" / f"{short_key(failed[0]['key'])}.log").read_text()  # appended: both starts, numbered
    assert [line.split()[5:7] for line in log.splitlines() if line.startswith("====")] == [["attempt", "1"],
                                                                                           ["attempt", "2"]]


def test_a_shared_base_option_need_not_apply_to_every_method_of_a_sweep(tmp_path):
    """`peftlab train --method vera --alpha 32` is refused (alpha would be ignored); a sweep's shared base is not."""
    spec = write_spec(tmp_path / "s.yaml", {"output_dir": str(tmp_path / "runs"),
                                            "base": {**FAKE_BASE, "alpha": 32, "dropout": 0.1},
                                            "grid": {"method": ["lora", "vera", "full"]}})
    outcome = run_sweep(load_spec(spec), train_fn=fake_train, progress=False)
    assert outcome.counts["ok"] == 3


@pytest.mark.parametrize("spec", [
    {"base": {"vera_d_initial": 0.5}, "grid": {"method": ["lora", "dora"]}},  # shared, for none of its methods
    {"base": {"method": "lora"}, "grid": {"vera_d_initial": [0.1, 0.5]}},  # an axis every run would ignore
])
def test_an_option_none_of_a_sweeps_methods_uses_is_refused(spec, tmp_path):
    path = write_spec(tmp_path / "s.yaml", {"output_dir": str(tmp_path / "runs"),
                                            "base": {**FAKE_BASE, **spec["base"]}, "grid": spec["grid"]})
    with pytest.raises(PeftlabError, match="'vera_d_initial' is set, but none of the runs' methods .* uses it") as e:
        load_spec(path)
    assert str(path) in str(e.value) and "(vera)" in str(e.value) and "\n" not in str(e.value)


def test_a_study_or_tune_refuses_an_option_none_of_its_methods_uses(tmp_path, capsys):
    from peftlab.cli.main import main

    assert main(["study", "kasa", "--task", "rte", "--model", "tiny-bert", "--set", "vera_d_initial=0.5",
                 "--dry-run", "--output-dir", str(tmp_path / "study")]) == 2
    assert "'vera_d_initial' is set, but none of the runs' methods" in capsys.readouterr().err
    tune = write_spec(tmp_path / "t.yaml", {"output_dir": str(tmp_path / "tune"), "seeds": 1,
                                            "base": {**FAKE_BASE, "method": "lora"},
                                            "search": {"fourierft_n_frequency": [100, 200]},
                                            "budget": {"grid_fraction": 1.0}})
    assert main(["tune", str(tune), "--dry-run"]) == 2
    assert "'fourierft_n_frequency' is set, but none of the runs' methods (lora)" in capsys.readouterr().err


def test_sweep_console_prints_each_finished_runs_primary_metric(tmp_path, capfd):
    root = tmp_path / "runs"
    spec = write_spec(tmp_path / "s.yaml", {"output_dir": str(root), "base": FAKE_BASE,
                                            "grid": {"lr_ratio": [1, 8], "seed": [0, 2]}})
    run_sweep(load_spec(spec), train_fn=fake_train, progress=True)
    err = capfd.readouterr().err
    assert "(lr_ratio=1 seed=0): ok, accuracy best 0.6000 (epoch 1), final 0.6000" in err
    assert "(lr_ratio=1 seed=2): ok, accuracy best 0.6200 (epoch 1), final 0.6200" in err
    assert "(lr_ratio=8 seed=0) failed: RuntimeError: boom" in err


def test_sweep_resumes_a_killed_run_and_adopts_a_finished_one(tmp_path):
    root = tmp_path / "runs"
    spec = write_spec(tmp_path / "s.yaml", {"output_dir": str(root), "base": FAKE_BASE, "grid": {"seed": [0, 1, 2]}})
    sweep = load_spec(spec)
    killed, finished_unrecorded, fresh = sweep.runs
    with Store(sweep.store_path) as store:
        store.register((r.key, r.config, r.output_dir) for r in sweep.runs)
        # run 0: its process was killed mid-run, after a checkpoint
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        store.conn.execute("UPDATE runs SET status='running', attempts=1, owner=? WHERE key=?",
                           (f"{socket.gethostname()}|{dead.pid}|1", killed.key))
        out = Path(killed.output_dir)
        (out / "checkpoint").mkdir(parents=True)
        (out / "checkpoint" / "state.json").write_text("{}")
        (out / "config.yaml").write_text(yaml.safe_dump(killed.config))
        # run 1: finished on disk, but the sweep died before recording it
        store.conn.execute("UPDATE runs SET status='running', attempts=1, owner=? WHERE key=?",
                           (f"{socket.gethostname()}|{dead.pid}|1", finished_unrecorded.key))
    from peftlab.resolve import resolved_from_dict

    done_cfg = resolved_from_dict(finished_unrecorded.config)  # the run's config as its spec resolved it
    fake_train(done_cfg)
    (root / "calls.jsonl").unlink()
    # run 2: a folder of some other config sits where it should go
    stale = Path(fresh.output_dir)
    stale.mkdir(parents=True)
    (stale / "config.yaml").write_text(yaml.safe_dump({**fresh.config, "lr": 0.5}))

    outcome = run_sweep(sweep, train_fn=fake_train, progress=False)
    assert outcome.counts["ok"] == 3
    by_dir = {c["dir"]: c for c in calls(root)}
    killed_dir, fresh_dir = Path(killed.output_dir).name, Path(fresh.output_dir).name
    assert by_dir[killed_dir]["resume"] is True and by_dir[killed_dir]["mode"] == "resume"
    assert Path(finished_unrecorded.output_dir).name not in by_dir  # adopted from result.json, not rerun
    assert by_dir[fresh_dir]["overwrite"] is True and by_dir[fresh_dir]["resume"] is False
    with Store(sweep.store_path) as store:
        attempts = {r["key"]: r["attempts"] for r in store.rows()}
    assert attempts == {killed.key: 2, finished_unrecorded.key: 2, fresh.key: 1}


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _count(store_path: Path, status: str) -> int:
    if not store_path.exists():
        return 0
    try:
        with sqlite3.connect(store_path, timeout=10) as conn:
            return conn.execute("SELECT count(*) FROM runs WHERE status = ?", (status,)).fetchone()[0]
    except sqlite3.OperationalError:  # the sweep is still creating it
        return 0


def test_a_worker_killed_mid_run_fails_that_run_only(tmp_path):
    """--workers 2, one run per fresh process: the run whose process dies is recorded failed with why, the runs
    beside and after it finish, and only the sweep's process writes the store."""
    root = tmp_path / "runs"
    spec = write_spec(tmp_path / "s.yaml", {"output_dir": str(root), "base": FAKE_BASE,
                                            "grid": {"lr_ratio": [1, 32, 2]}})
    outcome = run_sweep(load_spec(spec), workers=2, train_fn="test_sweep:killed_worker_train", progress=False,
                        poll_seconds=0.1)
    assert outcome.counts["ok"] == 2 and outcome.counts["failed"] == 1 and len(outcome.failed_keys) == 1
    with Store(root / "results.sqlite") as store:
        rows = {row["config"]["lr_ratio"]: row for row in store.rows()}
    assert {ratio: row["status"] for ratio, row in rows.items()} == {1: "ok", 32: "failed", 2: "ok"}
    assert rows[32]["error"].startswith("worker process died") and all(r["attempts"] == 1 for r in rows.values())
    pids = [c["pid"] for c in calls(root)]
    assert len(set(pids)) == len(pids) == 2 and os.getpid() not in pids  # a fresh process per run


@pytest.mark.slow
def test_worker_sweep_killed_leaves_no_orphans_and_reruns_cleanly(tmp_path):
    """--workers 2: runs spread over two processes, failures recorded; SIGKILL of the sweep takes its workers
    down with it, and the rerun finishes every run exactly once."""
    root = tmp_path / "runs"
    spec = write_spec(tmp_path / "s.yaml", {"output_dir": str(root), "base": FAKE_BASE,
                                            "grid": {"seed": list(range(5)), "lr_ratio": [1, 8]}})
    script = ("import sys; from peftlab.lab.spec import load_spec; from peftlab.lab.sweep import run_sweep; "
              "o = run_sweep(load_spec(sys.argv[1]), workers=2, train_fn='test_sweep:fake_train', progress=False, "
              "poll_seconds=0.2); print('COUNTS', o.counts)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           FAKE_SLEEP_ENV: "0.7"}
    proc = subprocess.Popen([sys.executable, "-c", script, str(spec)], env=env, cwd=tmp_path)
    store_path = root / "results.sqlite"
    try:
        _wait_for(lambda: _count(store_path, "ok") >= 2, 90, "two finished runs")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # each run trained in a fresh process, and the workers die with their parent (they watch it): nothing keeps
    # training in the background
    worker_pids = {c["pid"] for c in calls(root)}
    assert len(worker_pids) == len(calls(root)) >= 2 and os.getpid() not in worker_pids
    _wait_for(lambda: not any(_proc_state(pid) not in (None, "Z", "X") for pid in worker_pids), 10, "workers to exit")
    first = calls(root)

    rerun = subprocess.run([sys.executable, "-c", script, str(spec)], env={**env, FAKE_SLEEP_ENV: "0"}, cwd=tmp_path,
                           timeout=120, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "'ok': 5" in rerun.stdout and "'failed': 5" in rerun.stdout
    with Store(store_path) as store:
        rows = store.rows()
    assert len(rows) == 10 and len({r["key"] for r in rows}) == 10
    for row in rows:
        failing = row["config"]["lr_ratio"] == 8
        assert row["status"] == ("failed" if failing else "ok")
        assert (row["error"] or "").startswith("RuntimeError: boom") == failing
    made = calls(root)
    again = [c for c in made[len(first):] if c["dir"] in {f["dir"] for f in first}]
    assert len(again) <= 2  # only runs killed in flight (one per worker) were started twice
    assert {c["dir"] for c in made} == {Path(r["output_dir"]).name for r in rows}


# --------------------------------------------------------------------------- a real sweep, SIGKILLed


@pytest.mark.slow
@needs_data("glue", "RTE", "train.tsv")
def test_real_sweep_killed_mid_run_and_rerun(tmp_path):
    """12 tiny-bert runs on an RTE subset through the CLI; SIGKILL after >= 3 finished; the rerun completes
    with every run present exactly once and ok."""
    spec = write_spec(tmp_path / "tiny.yaml", {
        "output_dir": "runs/tiny",
        # 2 epochs: a run's checkpoint after its first stays while it trains its second, so the kill lands mid-run
        # (with 1 epoch that window closed at once, and on an idle machine all 12 could finish before the kill)
        "base": {"model": "tiny-bert", "task": "rte", "max_train_samples": 32, "max_eval_samples": 32, "epochs": 2,
                 "max_length": 32, "batch_size": 8, "checkpoint_every": 1},
        "grid": {"method": ["lora", "kasa"], "lr_ratio": [1, 4], "seed": [0, 1, 2]}})
    env = {**os.environ, "PEFTLAB_DATA_DIR": str(DATA), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # a 32-wide model gains nothing from threads on a shared CPU
    command = [sys.executable, "-m", "peftlab.cli.main", "sweep", str(spec)]
    store_path = tmp_path / "runs" / "tiny" / "results.sqlite"
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def in_flight_with_checkpoint():
        with sqlite3.connect(store_path, timeout=10) as conn:
            running = conn.execute("SELECT key, output_dir FROM runs WHERE status = 'running'").fetchall()
        return next((key for key, out in running if (tmp_path / out / "checkpoint" / "state.json").is_file()), None)

    def finished() -> int:  # tiny-bert on 32 examples may never leave chance: no_learning is finished too
        return _count(store_path, "ok") + _count(store_path, "no_learning")

    killed = None
    try:
        _wait_for(lambda: finished() >= 3 or proc.poll() is not None, 150, "three finished runs")
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        try:  # kill mid-run, after its first checkpoint (checkpoint_every: 1), to exercise the resume
            killed = _wait_for(in_flight_with_checkpoint, 30, "a run with a checkpoint")
        except AssertionError:
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    finished_before = finished()
    assert 3 <= finished_before < 12

    rerun = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    with Store(store_path) as store:
        rows = store.rows()
    assert len(rows) == 12 and len({r["key"] for r in rows}) == 12
    assert all(r["status"] in ("ok", "no_learning") for r in rows)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "no_learning")}
    assert "12 runs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ";" in rerun.stdout
    assert sum(r["attempts"] for r in rows) <= 13  # only the run killed mid-way was started twice
    for row in rows:
        result = json.loads((tmp_path / row["output_dir"] / "result.json").read_text())
        assert result["status"] == row["status"] and config_key(result["config"]) == row["key"]
        assert row["result"]["final"] == result["final"]
    if killed is not None:  # the killed run went on from its checkpoint
        assert {r["key"]: r["attempts"] for r in rows}[killed] == 2
        log = (tmp_path / "runs" / "tiny" / "logs" / f"{short_key(killed)}.log").read_text(errors="replace")
        assert "from its checkpoint" in log and "resuming at epoch" in log
    methods = {(r["config"]["method"], r["config"]["lr_ratio"]) for r in rows}
    assert methods == {("lora", 1.0), ("lora", 4.0), ("kasa", 1.0), ("kasa", 4.0)}

    from peftlab.lab.report import build_table

    table = build_table(rows)
    # every run in one of the 4 cells, averaged or counted apart (a no_learning run is never averaged)
    cells = [cell for row in table.rows if not row.reference for cell in row.cells.values()]
    assert [cell.n + sum(cell.excluded.values()) for cell in cells] == [3, 3, 3, 3]


def test_run_keys_survive_new_options_at_their_neutral_values():
    """A run recorded before an option existed keeps its key, so rerunning its spec finds it."""
    from peftlab.config import TrainConfig

    now = TrainConfig(model="tiny-bert").to_dict()
    before = {k: v for k, v in now.items() if k not in ("save", "scheduler", "grad_accum", "max_steps", "threads",
                                                         "gradient_checkpointing")}
    before["checkpoint_every"] = 0  # its old default
    assert config_key(now) == config_key(before)
    assert config_key({**now, "scheduler": "cosine"}) != config_key(now)  # a real change still changes it
    assert config_key({**now, "threads": 4}) == config_key(now)  # threads never change what is computed
