"""The fixed-rate study protocol (``python -m studies.fixed_rate``, beside the package): the design's stages, the
picks made on selection seeds and judged on held-out seeds, the controls, resuming, the report. A fake train
function (made-up metrics of eta_QK, eta_V, seed and epoch through the real store and sweep; the fair protocol's
tests use it too) keeps it instant."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from peftlab.errors import PeftlabError
from peftlab.lab.store import Store
from peftlab.lab.study_plan import StudyPaths
from studies.fixed_rate import design as sd
from studies.fixed_rate.run import run_study

from fake_results import checked

FAKE = "test_study:fake_train"
SLEEP_ENV = "PEFTLAB_TEST_STUDY_SLEEP"  # seconds per fake run (the kill test needs time to kill)
TESTS = Path(__file__).resolve().parent
BASE = {"model": "tiny-bert", "method": "lora", "targets": "q,v", "epochs": 2, "max_train_samples": 64,
        "report_to": "none"}


def world(lr: float, ratio: float, seed: int) -> float:
    """Accuracy of a cell in a world where eta_V matters (best near 3e-3) and lambda 4 adds a point on top:
    the best diagonal rate is 4e-3, lambda 4 at 1e-3 (eta_V 4e-3) the best off-diagonal cell, and
    eta_V >= 1.6e-2 never learns."""
    eta_v = lr * ratio
    if eta_v >= 1.6e-2:
        return 0.5
    quality = 0.80 - 4.0 * (math.log10(eta_v) - math.log10(3e-3)) ** 2 * 0.1 + (0.01 if ratio == 4 else 0.0)
    return round(quality + 0.003 * ((seed * 7919) % 5), 6)


def fake_train(cfg, on_epoch_end=None) -> dict:
    """Trains nothing: a result.json with the contract's fields, a curve when --eval-steps is set."""
    from peftlab.training.state import EpochEnd

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    time.sleep(float(os.environ.get(SLEEP_ENV, "0")))
    with open(out.parent / "calls.jsonl", "a") as handle:
        handle.write(json.dumps({"lr": cfg.optim.lr, "ratio": cfg.optim.lr_ratio, "seed": cfg.seed, "targets": ",".join(cfg.targets),
                                 "epochs": cfg.epochs}) + "\n")
    final = world(cfg.optim.lr, cfg.optim.lr_ratio, cfg.seed) - (0.004 if "k" in cfg.targets else 0.0)
    log, curve, stopped, status = [], [], None, "ok"
    for epoch in range(1, cfg.epochs + 1):
        accuracy = 0.5 if final <= 0.5 else final - 0.1 / epoch
        log.append({"epoch": epoch, "metrics": {"accuracy": accuracy}, "train_loss": 1.0 / epoch, "seconds": 0.0})
        if getattr(cfg, "eval_steps", 0):
            curve += [{"step": 4 * (epoch - 1) + s, "epoch": epoch - 1 + s / 4, "metrics": {"accuracy": accuracy},
                       "epoch_end": s == 4} for s in (2, 4)]
        stop = on_epoch_end(EpochEnd(epoch, {"accuracy": accuracy}, "accuracy", "ok")) if on_epoch_end else None
        if stop and epoch < cfg.epochs:
            stopped, status = {"epoch": epoch, "reason": str(stop)}, "pruned"
            break
    best = max(log, key=lambda r: r["metrics"]["accuracy"]) if cfg.epochs else None
    if cfg.epochs == 0:
        log, best = [], {"epoch": 0, "metrics": {"accuracy": 0.5}}
    elif status == "ok" and best["metrics"]["accuracy"] <= 0.55:
        status = "no_learning"
    result = {"schema_version": 1, "status": status, "status_reason": None, "task": cfg.task, "seed": cfg.seed,
              "epochs": cfg.epochs, "epochs_run": len(log), "config": cfg.to_dict(), "primary_metric": "accuracy",
              "epochs_log": log, "best": best, "final": {"metrics": (log[-1] if log else best)["metrics"]},
              "before": {"metrics": {"accuracy": 0.5}} if cfg.epochs == 0 else None,
              "stopped_early": stopped, "majority_baseline": 0.5, "train_examples": 64 * len(log),
              "curve": curve, "trainable_params": {"adapter": 10, "head": 2, "total": 12},
              "code": {"commit": "f" * 40, "dirty": False, "version": "0", "source_digest": "d" * 64}}
    result = checked(result)
    (out / "result.json").write_text(json.dumps(result))
    return result


def calls(root: Path) -> list[dict]:
    path = root / "runs" / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def small_design(**overrides) -> sd.Design:
    knobs = dict(kind="lambda", tasks=("rte",), base=dict(BASE), lr_grid=(1e-3, 2e-3), ratios=(2.0, 4.0, 8.0),
                 diagonal=(1e-3, 2e-3, 4e-3, 8e-3), selection_seeds=2, heldout_seeds=3, heldout_seed_start=100,
                 plateau_epochs=3, plateau_seeds=2, search_comparison=False)
    knobs.update(overrides)
    return sd.Design(**knobs)


def test_grid_has_the_diagonal_control_at_every_eta_v():
    design = small_design()
    cells = sd.grid_cells(design)
    eta_v = {c.eta_v for c in cells if not c.diagonal}
    diagonal = {c.lr for c in cells if c.diagonal}
    assert {v for v in eta_v if v <= max(design.diagonal)} <= diagonal  # every eta_V up to 8e-3 has its lambda 1
    assert len(cells) == 4 + 2 * 3 and cells[:4] == [sd.Cell(r, 1.0) for r in (1e-3, 2e-3, 4e-3, 8e-3)]


def test_picks_count_failed_seeds_at_chance():
    rows = [({"lr": 1e-3, "lr_ratio": 8.0, "seed": s}, {"status": st, "result": {
        "primary_metric": "accuracy", "majority_baseline": 0.5, "best": {"metrics": {"accuracy": v}}}})
        for s, st, v in ((0, "ok", 0.90), (1, "collapsed", 0.88))]
    rows += [({"lr": 2e-3, "lr_ratio": 1.0, "seed": s}, {"status": "ok", "result": {
        "primary_metric": "accuracy", "majority_baseline": 0.5, "best": {"metrics": {"accuracy": 0.8}}}})
        for s in (0, 1)]
    scores = sd.score_cells(rows, [0, 1])
    by_cell = {s.cell: s for s in scores}
    assert by_cell[sd.Cell(1e-3, 8.0)].mean == pytest.approx((0.90 + 0.5) / 2)  # the collapsed seed at chance
    assert by_cell[sd.Cell(1e-3, 8.0)].failed == 1
    picks = sd.pick_cells("rte", scores)
    assert picks.diagonal.cell == sd.Cell(2e-3, 1.0) and picks.off_diagonal.cell == sd.Cell(1e-3, 8.0)


def test_lambda_study_stages_picks_and_heldout_seeds(tmp_path):
    paths = StudyPaths(tmp_path / "study", tmp_path / "study" / "results.sqlite")
    design = run_study(small_design(), paths, workers=0, train_fn=FAKE, progress=False, report=False,
                       say=lambda *a: None)
    picks = json.loads((paths.root / "picks-rte.json").read_text())
    assert picks["diagonal"]["cell"] == {"lr": 4e-3, "ratio": 1.0}
    assert picks["off_diagonal"]["cell"] == {"lr": 1e-3, "ratio": 4.0}
    # the off-diagonal pick's controls: lambda 1 at its eta_QK (1e-3) and at its eta_V (4e-3, the diagonal pick)
    assert picks["controls"] == {"same_eta_qk": {"lr": 1e-3, "ratio": 1.0}, "same_eta_v": {"lr": 4e-3, "ratio": 1.0}}
    made = calls(paths.root)
    selection = {(c["lr"], c["ratio"]) for c in made if c["seed"] in (0, 1) and c["epochs"] == 2}
    assert len(selection) == len(sd.grid_cells(design))
    heldout = [c for c in made if c["seed"] >= 100]
    assert {c["seed"] for c in heldout} == {100, 101, 102}  # never a selection seed
    assert {(c["lr"], c["ratio"]) for c in heldout if c["epochs"] == 2 and c["targets"] == "q,v"} == {
        (1e-3, 4.0), (1e-3, 1.0), (4e-3, 1.0)}
    key = [c for c in heldout if c["targets"] == "q,k,v"]
    assert {(c["lr"], c["ratio"], c["seed"]) for c in key} == {(4e-3, 1.0, s) for s in (100, 101, 102)}
    plateau = [c for c in heldout if c["epochs"] == 3]
    assert {(c["lr"], c["ratio"], c["seed"]) for c in plateau} == {
        (lr, r, s) for lr, r in ((4e-3, 1.0), (1e-3, 4.0)) for s in (100, 101)}
    with Store(paths.store, create=False) as store:
        statuses = [row["status"] for row in store.rows()]
    assert statuses.count("no_learning") == 2  # eta_V 1.6e-2 (2e-3 x 8) never learns: both selection seeds
    # rerun: nothing trains again, the same picks
    before = len(made)
    run_study(small_design(), paths, workers=0, train_fn=FAKE, progress=False, report=False, say=lambda *a: None)
    assert len(calls(paths.root)) == before


def test_a_rerun_with_other_settings_is_refused(tmp_path):
    paths = StudyPaths(tmp_path / "s", tmp_path / "s" / "results.sqlite")
    run_study(small_design(plateau_epochs=0), paths, workers=0, train_fn=FAKE, progress=False, report=False,
              say=lambda *a: None)
    with pytest.raises(PeftlabError, match="planned with other settings .*heldout_seeds"):
        run_study(small_design(plateau_epochs=0, heldout_seeds=4), paths, workers=0, train_fn=FAKE,
                  progress=False, report=False, say=lambda *a: None)


def test_confirmatory_design_runs_every_cell_on_heldout_seeds(tmp_path):
    paths = StudyPaths(tmp_path / "c", tmp_path / "c" / "results.sqlite")
    design = small_design(selection_seeds=0, lr_grid=(2e-4,), ratios=(8.0,), diagonal=(2e-4, 1.6e-3),
                          plateau_epochs=0, key_ablation=False)
    run_study(design, paths, workers=0, train_fn=FAKE, progress=False, report=False, say=lambda *a: None)
    made = calls(paths.root)
    assert {(c["lr"], c["ratio"]) for c in made} == {(2e-4, 1.0), (1.6e-3, 1.0), (2e-4, 8.0)}
    assert {c["seed"] for c in made} == {100, 101, 102}


def test_kasa_rows_use_the_papers_settings_per_task():
    design = sd.Design("kasa", tasks=("stsb", "qqp"), base=dict(BASE), selection_seeds=0, heldout_seeds=2,
                       plateau_epochs=0, plateau_seeds=0, long_epochs=6)
    stsb = sd.kasa_configs(design, "stsb")
    paper = [c for c in stsb if c.get("alpha") == 16.0 and c["epochs"] == 2]
    assert {(c["lr"], c["head_lr"], c["kasa_gamma"]) for c in paper} == {(3e-4, 3e-4, 1e-5)}
    assert {c["method"] for c in stsb} == {"head", "lora", "pissa", "milora", "kasa"}
    assert sorted({c["epochs"] for c in stsb}) == [0, 2, 6]
    assert {c["seed"] for c in stsb} == {100, 101}
    qqp_paper = [c for c in sd.kasa_configs(design, "qqp") if c.get("alpha") == 16.0]
    assert {c["lr"] for c in qqp_paper} == {design.spec.paper("qqp")["lr"]} == {5e-4}


@pytest.mark.parametrize("overrides, message", [
    (dict(selection_seeds=1), "picks on a single seed"),
    (dict(heldout_seed_start=1), "overlaps the selection seeds"),
    (dict(plateau_seeds=5), "exceeds --heldout-seeds"),
    (dict(ratios=(1.0, 2.0)), "lists lambda 1"),
    (dict(heldout_seeds=2**31), "goes past seed"),
])
def test_bad_designs_are_one_line_errors(overrides, message):
    with pytest.raises(PeftlabError, match=message) as info:
        small_design(**overrides)
    assert "\n" not in str(info.value)


def test_lambda_study_report(tmp_path):
    paths = StudyPaths(tmp_path / "full", tmp_path / "full" / "results.sqlite")
    design = small_design(plateau_epochs=3)
    run_study(design, paths, workers=0, train_fn=FAKE, progress=False, report=True, say=lambda *a: None)
    picks = json.loads((paths.root / "picks-rte.json").read_text())
    assert picks["search"] == {}  # the tune / naive comparison is scripts/tune_vs_grid.py
    report = (paths.root / "REPORT.md").read_text()
    verdicts = json.loads((paths.root / "verdicts.json").read_text())
    task = verdicts["tasks"]["rte"]
    # the fake world: lambda 4 adds exactly one point at every eta_V, so the held-out paired differences are exact;
    # the control at the same eta_V (4e-3) is the diagonal pick itself: compared once, not twice
    assert task["comparisons"]["off_vs_diag"]["diff"] == pytest.approx(1.0)
    assert task["comparisons"]["off_vs_diag"]["n_pairs"] == 3
    assert "off_vs_same_eta_v" not in task["comparisons"] and "is the best lambda-1 cell itself" in report
    assert "Verdict:" in report and "W_k frozen" in report and "Plateau arm" in report
    assert (paths.root / "figures" / "lr_grid.png").is_file()
    assert (paths.root / "figures" / "plateau_curves.png").is_file()
    assert "peftlab plot" in report and "--seeds 0-1" in report


def test_kasa_study_runs_every_row_on_the_same_seeds_and_reports(tmp_path):
    paths = StudyPaths(tmp_path / "k", tmp_path / "k" / "results.sqlite")
    design = sd.Design("kasa", tasks=("rte",), base=dict(BASE), selection_seeds=0, heldout_seeds=3,
                       plateau_epochs=0, plateau_seeds=0, rows=("head", "lora", "kasa"))
    run_study(design, paths, workers=0, train_fn=FAKE, progress=False, report=True, say=lambda *a: None)
    made = calls(paths.root)
    assert {c["seed"] for c in made} == {100, 101, 102}
    report = (paths.root / "REPORT.md").read_text()
    assert "kasa − lora" in report and "lora − head (what the adapter adds)" in report


DRIVER = """
import sys
from pathlib import Path
from test_study import FAKE, small_design
from peftlab.lab.study_plan import StudyPaths
from studies.fixed_rate.run import run_study
root = Path(sys.argv[1])
run_study(small_design(), StudyPaths(root, root / "results.sqlite"), workers=1, train_fn=FAKE, progress=False,
          report=True)
"""


@pytest.mark.slow
def test_a_killed_study_resumes_and_ends_as_an_uninterrupted_one(tmp_path):
    path = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]  # studies/ sits beside tests/
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
           SLEEP_ENV: "0.15"}
    root = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(root)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(calls(root)) < 25:  # in the held-out stage (20 grid runs)
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    first = calls(root)
    rerun = subprocess.run([sys.executable, "-c", DRIVER, str(root)], env={**env, SLEEP_ENV: "0"}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    made = [json.dumps(c, sort_keys=True) for c in calls(root)]
    # at most the run in flight when the kill came trains twice; every finished run is reused
    assert len(made) - len(set(made)) <= 1
    assert len(made) > len(first)
    whole = tmp_path / "whole"
    run_study(small_design(), StudyPaths(whole, whole / "results.sqlite"), workers=1, train_fn=FAKE, progress=False,
              report=True, say=lambda *a: None)
    assert set(made) == {json.dumps(c, sort_keys=True) for c in calls(whole)}
    for name in ("picks-rte.json", "verdicts.json"):
        assert json.loads((root / name).read_text()) == json.loads((whole / name).read_text())


@pytest.mark.parametrize("argv", [
    ["lambda", "--task", "sst2,stsb", "--model", "tiny-bert", "--max-train-samples", "40",
     "--set", "max_length=32,rank=4", "--selection-seeds", "2", "--plateau-seeds", "3", "--no-search",
     "--ratios", "2,8", "--diagonal", "5e-4,4e-3"],
    ["kasa", "--task", "stsb", "--model", "tiny-bert", "--rows", "head,lora,kasa-paper", "--lr", "3e-4",
     "--long-epochs", "6", "--long-seeds", "2", "--heldout-seeds", "4"],
])
def test_the_reports_command_gives_the_design_back(argv, tmp_path):
    """REPORT.md's "reproduce" command, parsed again, is the same design: the command beside the numbers works."""
    import shlex

    from studies.fixed_rate.cli import build_parser, design_from_args
    from studies.fixed_rate.report import study_command

    design = design_from_args(build_parser().parse_args(argv))
    command = study_command(design, tmp_path / "study")
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "studies.fixed_rate"]
    assert design_from_args(build_parser().parse_args(words[3:])) == design
    assert f"--output-dir {tmp_path / 'study'}" in command


def test_top_k_without_no_search_is_refused_not_ignored(tmp_path, capsys):
    """The tune comparison --top-k sized left the study: the flag alone would do nothing, so it is refused; with
    --no-search (the committed stores' reproduce commands) it is only recorded, as their plan.json holds it."""
    from studies.fixed_rate.cli import main

    argv = ["lambda", "--task", "sst2", "--top-k", "3", "--dry-run", "--output-dir", str(tmp_path / "study")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--top-k" in err and "scripts/tune_vs_grid.py" in err
    assert main(argv + ["--no-search"]) == 0
    assert not (tmp_path / "study").exists()  # a dry run writes nothing


def test_peftlab_study_points_the_fixed_rate_protocol_to_its_new_command(capsys):
    from peftlab.cli.main import main

    assert main(["study", "lambda", "--protocol", "fixed-rate", "--task", "sst2", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "python -m studies.fixed_rate" in err


@pytest.mark.parametrize("argv", [
    ["study", "lambda", "--protocol", "fixed-rate", "--task", "sst2", "--no-search"],  # the old README line
    ["study", "lambda", "--task", "sst2", "--lr-grid", "5e-4,1e-3"],  # the old REPORT.md commands' flags
    ["study", "kasa", "--task", "stsb", "--long-epochs", "6"],
])
def test_a_fixed_rate_flag_on_peftlab_study_says_where_the_protocol_went(argv, capsys):
    from peftlab.cli.main import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "python -m studies.fixed_rate" in err and "did you mean" not in err


def test_an_old_spec_copy_with_a_fixed_rate_section_is_told_what_to_delete(tmp_path):
    from peftlab.lab.study_spec import load_study_spec

    old = yaml.safe_load((Path(__file__).resolve().parents[1] / "src/peftlab/lab/studies/kasa.yaml").read_text())
    old["fixed-rate"] = {"options": {"rows": "head,lora"}}
    path = tmp_path / "old_copy.yaml"
    path.write_text(yaml.safe_dump(old))
    with pytest.raises(PeftlabError, match="'fixed-rate' section.*studies.fixed_rate.*delete the section"):
        load_study_spec(path)


def test_the_fixed_rate_command_errors_are_one_line_and_it_runs_the_preflight(tmp_path, capsys):
    from studies.fixed_rate.cli import main

    assert main(["lambda", "--task", "sst2", "--method", "lorra"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lorra" in err
    assert main(["lambda", "--task", "sst2", "--bogus"]) == 2
    assert "unknown flag '--bogus'" in capsys.readouterr().err
    assert main(["lambda", "--task", "sst2", "--lr-grid", "abc", "--dry-run"]) == 2
    assert "e.g. --lr-grid 5e-4,1e-3,2e-3" in capsys.readouterr().err
    out_dir = tmp_path / "study"
    assert main(["kasa", "--task", "rte", "--model", "tiny-bert", "--dry-run", "--output-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "preflight data: ok" in out and "preflight: no problem found" in out
    assert not out_dir.exists()


def test_a_stage_estimate_of_early_stopped_runs_uses_the_epochs_they_ran_not_the_cap(tmp_path, monkeypatch):
    """The fair protocol caps runs at 20 epochs but stops them at their plateau: the held-out stage's estimate is
    the study's early-stopped runs' median epochs x its seconds per epoch, per worker (it was the cap's)."""
    from peftlab.lab.study import Study
    from peftlab.lab.study_plan import SAFETY, duration_text

    def row(epochs_run: int, seconds: float, patience: int | None = 3) -> dict:
        return {"status": "ok", "seconds": seconds, "config": {"epochs": 20, "early_stop_patience": patience},
                "result": {"epochs_log": [{"epoch": e} for e in range(1, epochs_run + 1)]}}

    study = Study(design=None, paths=StudyPaths(tmp_path, tmp_path / "results.sqlite"), workers=2)
    monkeypatch.setattr(study, "rows_by_key", lambda: {"a": row(6, 60.0), "b": row(8, 80.0), "c": row(10, 100.0),
                                                       "d": row(20, 200.0, patience=None)})
    assert study.pace() == (10.0, 8)  # 10 s per epoch; the early-stopped runs' median: 8 epochs
    capped = [{"epochs": 20, "early_stop_patience": 3}] * 4
    fixed = [{"epochs": 6}] * 4
    assert study.eta_text(capped, 12) == f", ~{duration_text(12 * 8 * 10.0 * SAFETY / 2)}"
    assert study.eta_text(fixed, 12) == f", ~{duration_text(12 * 6 * 10.0 * SAFETY / 2)}"
    assert study.eta_text(capped, 0) == ""
