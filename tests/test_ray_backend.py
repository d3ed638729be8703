"""`peftlab sweep --backend ray` and `peftlab tune --backend ray` on a local Ray with 2 CPUs (no network):
runs recorded once in the driver's store, resume and --retry-failed as locally, a Ray worker SIGKILLed
mid-run (re-run from its checkpoint, or recorded failed with the reason once its retries are spent), and
the one-line error without Ray."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from peftlab.lab.ray_backend import RayOptions
from peftlab.lab.store import Store
from peftlab.lab.sweep import load_spec, run_sweep

from conftest import DATA_DIR as DATA, needs_data  # noqa: E402
from faults import KILL_ENV  # noqa: E402
from test_tune import FAKE as FAKE_TUNE_TRAIN, epoch_calls, spec_for  # noqa: E402

KILLED_TRAIN = "faults:fake_train_killed"  # the tune tests' fake, SIGKILLing itself once after KILL_ENV's epoch

FAKE_SWEEP_TRAIN = "test_sweep:fake_train"  # lr_ratio 8 raises, 16 collapses (tests/test_sweep.py)


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def local_ray():
    import ray  # a test dependency (pip install -e .[test,ray]): never skipped
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def test_without_ray_backend_ray_is_one_line(tmp_path, monkeypatch, capsys):
    from peftlab.cli.main import main

    spec = write_spec(tmp_path / "s.yaml", {"output_dir": str(tmp_path / "runs"),
                                            "base": {"model": "tiny-bert", "task": "rte", "epochs": 1},
                                            "grid": {"lr_ratio": [1, 2]}})
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert main(["sweep", str(spec), "--backend", "ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--backend ray needs Ray" in err and 'pip install "peftlab[ray]"' in err
    assert not (tmp_path / "runs" / "results.sqlite").exists()
    assert main(["sweep", str(spec), "--gpus-per-run", "0.5"]) == 2
    assert "--gpus-per-run only applies to --backend ray" in capsys.readouterr().err


def test_sweep_on_ray_records_each_run_once_and_resumes(tmp_path, local_ray):
    spec = write_spec(tmp_path / "grid.yaml", {"output_dir": str(tmp_path / "runs"),
                                               "base": {"model": "tiny-bert", "task": "rte", "epochs": 1},
                                               "grid": {"lr_ratio": [1, 2, 8, 16], "seed": [0, 1]}})
    sweep = load_spec(spec)
    outcome = run_sweep(sweep, ray=RayOptions(), train_fn=FAKE_SWEEP_TRAIN, progress=False)
    assert outcome.total == 8 and outcome.ran == 8
    assert outcome.counts["ok"] == 4 and outcome.counts["collapsed"] == 2 and outcome.counts["failed"] == 2
    with Store(sweep.store_path) as store:
        rows = {r["key"]: r for r in store.rows()}
    assert len(rows) == 8 and all(r["attempts"] == 1 for r in rows.values())
    failed = [r for r in rows.values() if r["status"] == "failed"]
    assert all("boom at lr_ratio 8" in r["error"] for r in failed)
    ok = next(r for r in rows.values() if r["status"] == "ok")
    assert ok["result"] == json.loads((Path(ok["output_dir"]) / "result.json").read_text())
    assert (sweep.log_dir / f"{ok['key'][:12]}.log").is_file()  # each run's output in its log
    # rerun: nothing left to do; --retry-failed runs only the failed ones again
    again = run_sweep(load_spec(spec), ray=RayOptions(), train_fn=FAKE_SWEEP_TRAIN, progress=False)
    assert again.ran == 0 and again.counts["ok"] == 4
    retried = run_sweep(load_spec(spec), ray=RayOptions(), train_fn=FAKE_SWEEP_TRAIN, progress=False,
                            retry_failed=True)
    assert retried.ran == 2 and retried.counts["failed"] == 2
    with Store(sweep.store_path) as store:
        assert sorted(r["attempts"] for r in store.rows()) == [1] * 6 + [2, 2]


def _kill_spec(tmp_path: Path) -> Path:
    return write_spec(tmp_path / "kill.yaml", {"output_dir": str(tmp_path / "runs"),
                                               "base": {"model": "tiny-bert", "task": "rte", "epochs": 3,
                                                        "lr": 1e-3},
                                               "grid": {"lr_ratio": [1, 4]}})


@pytest.mark.slow
def test_a_killed_ray_worker_is_retried_from_the_checkpoint(tmp_path, local_ray, monkeypatch):
    """The first run to end epoch 1 SIGKILLs its worker; Ray runs the task again, which resumes the run's
    checkpoint: every run is in the store once, ok, and no epoch was trained twice."""
    sweep = load_spec(_kill_spec(tmp_path))
    monkeypatch.setenv(KILL_ENV, f"1:{tmp_path / 'killed'}")
    outcome = run_sweep(sweep, ray=RayOptions(max_retries=2), train_fn=KILLED_TRAIN, progress=False)
    assert (tmp_path / "killed").is_file()  # a worker really died
    assert outcome.counts["ok"] == 2 and outcome.counts["failed"] == 0
    with Store(sweep.store_path) as store:
        rows = store.rows()
    assert len(rows) == 2 and all(r["attempts"] == 1 for r in rows)
    calls = epoch_calls(tmp_path / "runs")
    assert len({(c["dir"], c["epoch"]) for c in calls}) == len(calls) == 6  # resumed, not restarted
    killed_pid = int((tmp_path / "killed").read_text())
    assert len({c["pid"] for c in calls}) >= 2 and killed_pid in {c["pid"] for c in calls}
    assert all(len(r["result"]["epochs_log"]) == 3 for r in rows)


@pytest.mark.slow
def test_a_ray_worker_killed_past_its_retries_is_failed_with_the_reason(tmp_path, local_ray, monkeypatch):
    sweep = load_spec(_kill_spec(tmp_path))
    monkeypatch.setenv(KILL_ENV, f"1:{tmp_path / 'killed'}")
    first = run_sweep(sweep, ray=RayOptions(max_retries=0), train_fn=KILLED_TRAIN, progress=False)
    assert first.counts["failed"] == 1 and first.counts["ok"] == 1  # the marker kills one worker only
    with Store(sweep.store_path) as store:
        failed = next(r for r in store.rows() if r["status"] == "failed")
    assert "Ray worker died 1 time(s)" in failed["error"]
    # --retry-failed: the failed run is queued again and resumes its checkpoint (epoch 1 is not redone)
    second = run_sweep(load_spec(_kill_spec(tmp_path)), ray=RayOptions(max_retries=0), train_fn=FAKE_TUNE_TRAIN,
                           progress=False, retry_failed=True)
    assert second.ran == 1 and second.counts["ok"] == 2
    calls = epoch_calls(tmp_path / "runs")
    assert len({(c["dir"], c["epoch"]) for c in calls}) == len(calls) == 6
    with Store(sweep.store_path) as store:
        rows = store.rows()
    assert len(rows) == 2 and sorted(r["attempts"] for r in rows) == [1, 2]


@pytest.mark.slow  # ~15 s: a study actor and five trials in Ray workers
def test_tune_on_ray(tmp_path, local_ray):
    from peftlab.lab.tune.run import run_tune
    from peftlab.lab.tune.spec import load_tune_spec

    tune = load_tune_spec(spec_for(tmp_path, seeds=2))
    summary = run_tune(tune, ray=RayOptions(), train_fn=FAKE_TUNE_TRAIN, progress=False)
    trials = {t["params"]["lr_ratio"]: t for t in summary["trials"]}
    assert set(trials) == {1.0, 2.0, 4.0, 8.0, 16.0}
    assert trials[16.0]["outcome"] == "diverged" and trials[4.0]["outcome"] == "complete"
    assert summary["winner"]["params"] == {"lr_ratio": 4.0} and summary["winner"]["n"] == 2
    calls = epoch_calls(tmp_path / "tune")
    # the search and seed re-runs (the budget's) plus the winner's 10 held-out seeds x 4 epochs (outside it)
    assert len({(c["dir"], c["epoch"]) for c in calls}) == len(calls) == summary["spent_epochs"] + 40
    assert summary["heldout"]["n"] == 10 and summary["heldout_epochs"] == 40
    with Store(tune.store_path) as store:
        rows = store.rows()
    assert len(rows) == len({r["key"] for r in rows}) == 5 + len(summary["candidates"]) + 10
    assert all(r["attempts"] == 1 for r in rows)
    # the driver recorded the pruned trials off the complete runs' keys, their folders renamed
    pruned = [r for r in rows if r["status"] == "pruned"]
    assert pruned and {r["key"] for r in pruned} == {t["key"] for t in summary["trials"] if t["outcome"] == "pruned"}
    assert all(".pruned-e" in r["key"] and Path(r["output_dir"]).is_dir() for r in pruned)
    assert not any(Path(r["config"]["output_dir"]).exists() for r in pruned)


@pytest.mark.slow
@needs_data("glue", "RTE", "train.tsv")
def test_real_run_on_ray_killed_mid_run_resumes(tmp_path, local_ray, monkeypatch):
    """The real loop (tiny-bert): the worker dies after epoch 1's checkpoint; the retry resumes at epoch 2."""
    monkeypatch.setenv("PEFTLAB_DATA_DIR", str(DATA))
    monkeypatch.setenv(KILL_ENV, f"1:{tmp_path / 'killed'}")
    spec = write_spec(tmp_path / "real.yaml", {
        "output_dir": str(tmp_path / "runs"),
        "base": {"model": "tiny-bert", "task": "rte", "max_train_samples": 16, "max_eval_samples": 16, "epochs": 2,
                 "max_length": 32, "batch_size": 8}, "grid": {"lr_ratio": [2]}})
    sweep = load_spec(spec)
    outcome = run_sweep(sweep, ray=RayOptions(max_retries=1), train_fn="faults:train_killed", progress=False)
    # tiny-bert on 16 examples may never leave chance (training/guards.py): no_learning is a finished run too
    assert outcome.counts["ok"] + outcome.counts["no_learning"] == 1 and (tmp_path / "killed").is_file()
    with Store(sweep.store_path) as store:
        (row,) = store.rows()
    assert row["attempts"] == 1 and len(row["result"]["epochs_log"]) == 2
    log = (sweep.log_dir / f"{row['key'][:12]}.log").read_text(errors="replace")
    assert log.count("in a Ray worker") == 2 and "resuming at epoch 2" in log
