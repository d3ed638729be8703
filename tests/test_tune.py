"""`peftlab tune`: spec checks, pruning on the per-epoch dev metric, divergence/collapse stopped and reported,
seed re-runs naming the winner, the summary (also in `peftlab report`), and kill + rerun resuming without
training a finished trial again. A fake train function (epochs of made-up metrics through the real
``on_epoch_end`` protocol) keeps most tests instant; the real loop on tiny-bert checks a diverging lambda."""

from __future__ import annotations

import json
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
from peftlab.lab.store_schema import pruned_dir, pruned_key
from peftlab.lab.tune.run import load_summary, run_tune
from peftlab.lab.tune.spec import load_tune_spec, run_config
from peftlab.lab.tune.summary import render_summary, summaries_beside

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
from conftest import DATA_DIR as DATA, needs_data  # noqa: E402
from fake_results import checked  # noqa: E402

FAKE = "test_tune:fake_train"
SLEEP_ENV = "PEFTLAB_TEST_TUNE_SLEEP"  # seconds per fake epoch (the kill test needs time to kill)
BASE = {"model": "tiny-bert", "task": "rte", "epochs": 4, "lr": 1e-3}


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# --------------------------------------------------------------------------- a fake train function
# The dev accuracy of a (lr_ratio, lr, seed) after each epoch; lr_ratio 16 diverges at epoch 2, 32 collapses.
QUALITY = {1: 0.60, 2: 0.70, 4: 0.80, 8: 0.50, 16: 0.95}  # 16: the best first epoch


def fake_accuracy(lr_ratio: float, lr: float, seed: int, epoch: int) -> float:
    return QUALITY[int(lr_ratio)] + (0.02 if lr > 1e-3 else 0.0) + 0.01 * (seed % 100) + 0.02 * epoch


def fake_train(cfg, on_epoch_end=None) -> dict:
    """Trains nothing: epochs of made-up metrics, with a checkpoint after each (resumable), honouring stop."""
    import shutil

    assert cfg.resolved, "a run gets the config its spec resolved (train() would not resolve it again)"

    from peftlab.training.state import EpochEnd

    out = Path(cfg.output_dir)
    result_file, state_file = out / "result.json", out / "checkpoint" / "state.json"
    if cfg.overwrite and out.exists():
        shutil.rmtree(out)
    if result_file.is_file():
        return json.loads(result_file.read_text())
    state = json.loads(state_file.read_text()) if cfg.resume and state_file.is_file() else {"log": []}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    status, reason, stopped = "ok", None, None
    for epoch in range(len(state["log"]) + 1, cfg.epochs + 1):
        time.sleep(float(os.environ.get(SLEEP_ENV, "0")))
        with open(out.parent / "calls.jsonl", "a") as handle:
            handle.write(json.dumps({"dir": out.name, "epoch": epoch, "pid": os.getpid()}) + "\n")
        if cfg.optim.lr_ratio == 16 and epoch == 2:
            status, reason = "diverged", f"non-finite loss at step 9 (epoch {epoch})"
            break
        accuracy = 0.5 if (cfg.optim.lr_ratio == 32 and epoch >= 2) else fake_accuracy(
            cfg.optim.lr_ratio if cfg.optim.lr_ratio not in (32, 64) else 4, cfg.optim.lr, cfg.seed, epoch)
        if cfg.optim.lr_ratio == 32 and epoch >= 2:
            status, reason = "collapsed", f"accuracy fell to 0.5 <= chance 0.5 at epoch {epoch}"
        if cfg.optim.lr_ratio == 64:  # never leaves chance
            accuracy = 0.5 + 0.001 * epoch
            if epoch == cfg.epochs:
                status, reason = "no_learning", "best accuracy 0.504 <= chance 0.5 + 0.05"
        state["log"].append({"epoch": epoch, "train_loss": 1.0 / epoch, "metrics": {"accuracy": accuracy}, "seconds": 0.0})
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(state))
        stop = on_epoch_end(EpochEnd(epoch, {"accuracy": accuracy}, "accuracy", status)) if on_epoch_end else None
        if stop and epoch < cfg.epochs:
            stopped = {"epoch": epoch, "reason": stop if isinstance(stop, str) else "stopped"}
            break
    log = state["log"]
    best = max(log, key=lambda r: r["metrics"]["accuracy"]) if log else {"epoch": 0, "metrics": {}}
    result = {"schema_version": 1, "status": status, "status_reason": reason, "task": cfg.task, "seed": cfg.seed,
              "epochs": cfg.epochs, "config": cfg.to_dict(), "primary_metric": "accuracy", "epochs_log": log,
              "best": best, "final": {"metrics": log[-1]["metrics"] if log else {}}, "stopped_early": stopped,
              "majority_baseline": 0.5, "trainable_params": {"adapter": 10, "head": 2, "total": 12}}
    result = checked(result)
    result_file.write_text(json.dumps(result))
    shutil.rmtree(out / "checkpoint", ignore_errors=True)
    return result


def epoch_calls(root: Path) -> list[dict]:
    path = root / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def spec_for(tmp_path: Path, **overrides) -> Path:
    spec = {"output_dir": str(tmp_path / "tune"), "base": BASE,
            "search": {"lr_ratio": [1, 2, 4, 8, 16]}, "budget": {"grid_fraction": 0.5}, "seeds": 3, "top_k": 2,
            "pruner": {"kind": "asha", "min_epochs": 1, "reduction_factor": 2}, **overrides}
    return write_spec(tmp_path / "tune.yaml", spec)


# --------------------------------------------------------------------------- specs


def test_spec_budget_grid_and_seed_reserve(tmp_path):
    tune = load_tune_spec(spec_for(tmp_path, search={"lr_ratio": [1, 2, 4, 8, 16], "lr": [5e-4, 1e-3]},
                                   budget={"grid_fraction": 0.35}, seeds=5))
    assert tune.grid_size == 10 and tune.epochs == 4
    assert tune.grid_epochs == 10 * 5 * 4 and tune.budget_epochs == pytest.approx(0.35 * 200)
    assert tune.seed_reserve == 2 * 4 * 4 and tune.search_budget == pytest.approx(70 - 32)
    assert len(tune.grid_points) == 10 and len({json.dumps(p) for p in tune.grid_points}) == 10
    assert tune.seed_list == [0, 1, 2, 3, 4]
    assert load_tune_spec(spec_for(tmp_path), seeds=2).seeds == 2  # --seeds overrides the spec


@pytest.mark.parametrize("overrides, message", [
    ({"search": {"seed": [0, 1]}}, "'seed' cannot be searched.*seeds: N"),
    ({"search": {"lr_rato": [1, 2]}}, "unknown config key 'lr_rato'.*did you mean 'lr_ratio'"),
    ({"search": {"lr_ratio": []}}, "search.lr_ratio is an empty list"),
    ({"search": {"lr_ratio": 4}}, "search.lr_ratio must be a list of values or a range"),
    ({"search": {"lr_ratio": {"low": 1}}}, "search.lr_ratio needs low and high"),
    ({"search": {"lr_ratio": {"low": 1, "high": 16}}}, "has no finite grid.*budget: {epochs: N}"),
    ({"budget": {"epochs": 8}}, "leaves -8 for the search.*raise the budget"),
    ({"budget": {"epochs": 10, "grid_fraction": 0.3}}, "not both"),
    ({"pruner": {"kind": "ashaa"}}, "unknown pruner.kind 'ashaa'.*did you mean 'asha'"),
    ({"serch": {}}, "unknown tune spec key 'serch'.*did you mean 'search'"),
    ({"search": {"lr_ratio": [1, -2]}}, r"--lr-ratio must be a finite number > 0, got -2.0 \(.*: search.lr_ratio\)"),
    ({"search": {"packing": [False, True]}}, r"search point \{packing=True\}: --packing packs decoder"),
    ({"heldout_seeds": -1}, r"heldout_seeds must be a whole number >= 0, got -1.*0 turns them off"),
    ({"heldout_seeds": "ten"}, r"heldout_seeds must be a whole number >= 0, got 'ten'"),
    ({"heldout_seeds": True}, r"heldout_seeds must be a whole number >= 0, got True"),
    ({"heldout_seed_start": 1.5}, r"heldout_seed_start must be a whole number >= 0, got 1.5"),
    ({"heldout_seed_start": -3}, r"heldout_seed_start must be a whole number >= 0, got -3"),
    ({"heldout_seed_start": 2}, r"held-out seeds 2..11 overlap the selection seeds 0..2.*heldout_seed_start: 1000"),
    ({"heldot_seeds": 3}, r"unknown tune spec key 'heldot_seeds'.*did you mean 'heldout_seeds'"),
])
def test_bad_tune_specs_are_one_line_user_errors(tmp_path, overrides, message):
    with pytest.raises(PeftlabError, match=message) as info:
        load_tune_spec(spec_for(tmp_path, **overrides))
    assert "\n" not in str(info.value)


def test_heldout_seeds_default_and_never_overlap_the_selection_seeds(tmp_path, capsys):
    from peftlab.cli.main import main

    tune = load_tune_spec(spec_for(tmp_path))
    assert tune.heldout_seeds == 10 and tune.heldout_seed_list == list(range(1000, 1010))
    assert not set(tune.heldout_seed_list) & set(tune.seed_list)
    assert tune.heldout_epochs == 40 and tune.budget_epochs == pytest.approx(0.5 * 60)  # not in the budget
    # the base seed moves the selection seeds; the check follows them
    with pytest.raises(PeftlabError, match="held-out seeds 1000..1009 overlap the selection seeds 998..1000"):
        load_tune_spec(spec_for(tmp_path, base={**BASE, "seed": 998}))
    with pytest.raises(PeftlabError, match="held-out seeds 5..14 overlap the selection seeds 0..5"):  # --seeds 6
        load_tune_spec(spec_for(tmp_path, heldout_seed_start=5), seeds=6)
    off = load_tune_spec(spec_for(tmp_path, heldout_seeds=0, heldout_seed_start=0))  # off: nothing to overlap
    assert off.heldout_seed_list == [] and "no held-out check" in off.describe()
    assert main(["tune", str(spec_for(tmp_path)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "then the winner on 10 held-out seed(s) 1000..1009 (40 epochs, outside the budget)" in out


def test_the_winner_is_judged_on_heldout_seeds_no_trial_used(tmp_path, capsys):
    from peftlab.cli.main import main

    tune = load_tune_spec(spec_for(tmp_path, seeds=3, heldout_seeds=4, heldout_seed_start=100))
    summary = run_tune(tune, train_fn=FAKE, progress=False)
    winner = summary["winner"]
    assert winner["params"] == {"lr_ratio": 4.0}
    with Store(tune.store_path) as store:
        rows = store.rows()
    trial_keys = {t["key"] for t in summary["trials"]}
    seeds_of = {}
    for row in rows:
        seeds_of.setdefault(float(row["config"]["lr_ratio"]), set()).add(row["config"]["seed"])
    assert all(row["config"]["seed"] == 0 for row in rows if row["key"] in trial_keys)  # trials: the base seed
    assert seeds_of[4.0] == {0, 1, 2, 100, 101, 102, 103}  # the winner: selection seeds, then held-out ones
    assert all(not {100, 101, 102, 103} & seeds for lam, seeds in seeds_of.items() if lam != 4.0)
    heldout = summary["heldout"]
    assert heldout["seeds"] == [100, 101, 102, 103] and heldout["n"] == 4 and heldout["done"]
    # independently: best epoch 4 of lr_ratio 4 at lr 1e-3 is 0.80 + 0.08 + 0.01 * seed
    expected = [0.88 + 0.01 * seed for seed in (100 % 100, 101 % 100, 102 % 100, 103 % 100)]
    assert heldout["mean"] == pytest.approx(sum(expected) / 4)
    assert heldout["std"] == pytest.approx(statistics_stdev(expected))
    assert winner["mean"] == pytest.approx(0.89)  # selection mean (seeds 0, 1, 2), reported apart
    calls = epoch_calls(tmp_path / "tune")
    assert summary["heldout_epochs"] == 16 and summary["spent_epochs"] == len(calls) - 16
    assert summary["spent_epochs"] <= tune.budget_epochs + tune.epochs  # the budget paid only for the choice
    assert json.loads(tune.summary_path.read_text())["heldout"]["n"] == 4
    assert main(["tune", str(tune.spec_path), "--summary"]) == 0
    out = capsys.readouterr().out
    assert f"held-out: accuracy {heldout['mean']:.4f} ± {heldout['std']:.4f} over 4 of 4 held-out seed(s) " \
           "100..103 (never used to choose)" in out
    assert "winner: lr_ratio=4: accuracy 0.8900 ± 0.0100 over 3 selection seed(s) 0..2" in out


def test_a_train_function_without_an_epoch_hook_is_refused_before_any_trial(tmp_path):
    tune = load_tune_spec(spec_for(tmp_path))

    def no_hook(cfg):  # nothing to prune through: every trial would fail with a TypeError
        raise AssertionError("no trial may start")

    with pytest.raises(PeftlabError, match="the train function .*no_hook takes no on_epoch_end.*fix: give it"):
        run_tune(tune, train_fn=no_hook, progress=False)
    assert not tune.store_path.exists()  # refused before the store was made
    summary = run_tune(tune, train_fn=lambda cfg, **options: fake_train(cfg, **options), progress=False)
    assert summary["winner"]["params"] == {"lr_ratio": 4.0}  # **options takes the hook: trials ran and pruned


def test_heldout_seeds_zero_runs_no_check_and_says_so(tmp_path):
    tune = load_tune_spec(spec_for(tmp_path, seeds=2, heldout_seeds=0))
    summary = run_tune(tune, train_fn=FAKE, progress=False)
    assert summary["heldout"] is None and summary["heldout_epochs"] == 0
    assert summary["spent_epochs"] == len(epoch_calls(tmp_path / "tune"))
    assert "held-out: none (heldout_seeds: 0)" in render_summary(summary)
    older = {k: v for k, v in summary.items() if not k.startswith("heldout")}  # a tune.json from before them
    assert "held-out: none (this tune predates held-out seeds): the score above flatters the winner" in \
        render_summary(older)


def test_run_heldout_scores_any_point_on_the_tunes_heldout_seeds(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))  # research code beside src
    from tune_compare import run_heldout

    tune = load_tune_spec(spec_for(tmp_path, heldout_seeds=3))
    (two, eight) = run_heldout(tune, [{"lr_ratio": 2.0}, {"lr_ratio": 8.0}], train_fn=FAKE, progress=False)
    assert two["seeds"] == [1000, 1001, 1002] and two["n"] == 3
    assert two["mean"] == pytest.approx(0.70 + 0.08 + 0.01)  # seeds % 100: 0, 1, 2
    assert eight["mean"] == pytest.approx(0.50 + 0.08 + 0.01)
    before = len(epoch_calls(tmp_path / "tune"))
    run_heldout(tune, [{"lr_ratio": 2.0}], train_fn=FAKE, progress=False)  # found by key: nothing retrained
    assert len(epoch_calls(tmp_path / "tune")) == before == 2 * 3 * 4
    with pytest.raises(PeftlabError, match="heldout_seeds: 0"):
        run_heldout(load_tune_spec(spec_for(tmp_path, heldout_seeds=0)), [{"lr_ratio": 2.0}], train_fn=FAKE)


def statistics_stdev(values):
    import statistics

    return statistics.stdev(values)


@pytest.mark.parametrize("spec", sorted((REPO / "configs" / "tune").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_tune_specs_load(spec):
    tune = load_tune_spec(spec)
    assert tune.grid_size and tune.description
    assert tune.budget_epochs <= 0.35 * tune.grid_epochs + 1e-9  # the goal: <= 35 % of the grid


# --------------------------------------------------------------------------- a tune, in process


def test_tune_prunes_stops_divergence_reruns_seeds_and_names_the_winner(tmp_path):
    tune = load_tune_spec(spec_for(tmp_path))
    summary = run_tune(tune, train_fn=FAKE, progress=False)
    trials = {t["params"]["lr_ratio"]: t for t in summary["trials"]}
    assert set(trials) == {1.0, 2.0, 4.0, 8.0, 16.0}  # every grid point tried once: the budget allows it
    assert trials[16.0]["outcome"] == "diverged" and "non-finite" in trials[16.0]["reason"]
    pruned = [t for t in summary["trials"] if t["outcome"] == "pruned"]
    assert pruned and all(t["epochs"] < 4 and "pruned by peftlab tune" in t["reason"] for t in pruned)
    assert trials[4.0]["outcome"] == "complete" and trials[4.0]["epochs"] == 4  # the best one is never pruned
    # the top (up to 2) complete trials x 3 seeds; the trial itself is seed 0, so 2 more runs each
    candidates = summary["candidates"]
    assert candidates[0]["params"] == {"lr_ratio": 4.0} and all(c["n"] == 3 for c in candidates)
    winner = summary["winner"]
    assert winner["params"] == {"lr_ratio": 4.0} and winner["mean"] == pytest.approx(0.80 + 0.08 + 0.01)
    assert winner["std"] == pytest.approx(0.01)
    # compute: epochs actually trained (from the calls) vs the grid's 5 x 3 x 4 = 60; the held-out check
    # (10 seeds x 4 epochs, the default) is counted apart from the budget
    calls = epoch_calls(tmp_path / "tune")
    assert summary["heldout_epochs"] == 40 and summary["total_epochs"] == len(calls)
    assert summary["spent_epochs"] == len(calls) - 40 and summary["grid_epochs"] == 60
    assert summary["fraction_of_grid"] == pytest.approx((len(calls) - 40) / 60)
    with Store(tune.store_path) as store:
        rows = store.rows()
    # every trial, seed run and held-out run is one ordinary row (with its result.json), none trained twice
    assert len(rows) == 5 + 2 * len(candidates) + 10 and all(r["attempts"] == 1 for r in rows)
    assert len({(c["dir"], c["epoch"]) for c in calls}) == len(calls)
    text = render_summary(summary)
    assert "winner: lr_ratio=4: accuracy 0.8900 ± 0.0100 over 3 selection seed(s) 0..2" in text
    assert "held-out: accuracy 0.9250 ± 0.0303 over 10 of 10 held-out seed(s) 1000..1009" in text
    assert "held-out check 40 epochs more, outside the budget" in text
    assert "| diverged |" in text and "% of it" in text
    assert json.loads(tune.summary_path.read_text())["winner"]["params"] == {"lr_ratio": 4.0}
    assert summaries_beside([tune.store_path]) == [text]  # what `peftlab report` prints after its table


def test_collapsed_trial_is_stopped_at_once(tmp_path):
    tune = load_tune_spec(spec_for(tmp_path, search={"lr_ratio": [4, 32]}, seeds=1, top_k=1,
                                   budget={"epochs": 8}))
    summary = run_tune(tune, train_fn=FAKE, progress=False)
    collapsed = next(t for t in summary["trials"] if t["params"]["lr_ratio"] == 32.0)
    assert collapsed["outcome"] == "collapsed" and collapsed["epochs"] == 2  # epoch 2 of 4: stopped there
    run = run_config(tune, {"lr_ratio": 32.0}, 0)
    # stopped at epoch 2 of 4: not the complete run of its config, so never under its key or in its folder
    assert not Path(run.output_dir).exists()
    result = json.loads((Path(pruned_dir(run.output_dir, 2)) / "result.json").read_text())
    assert result["status"] == "collapsed" and result["stopped_early"]["epoch"] == 2
    with Store(tune.store_path, create=False) as store:
        assert store.get(run.key) is None
        assert store.get(pruned_key(run.key, 2))["status"] == "collapsed"  # what stopped it, kept


def test_a_trial_that_never_learns_is_a_candidate_only_below_those_that_did(tmp_path):
    tune = load_tune_spec(spec_for(tmp_path, search={"lr_ratio": [4, 64]}, seeds=2, top_k=2, heldout_seeds=0,
                                   budget={"epochs": 30}, pruner={"kind": "none"}))
    summary = run_tune(tune, train_fn=FAKE, progress=False)
    trials = {t["params"]["lr_ratio"]: t for t in summary["trials"]}
    assert trials[64.0]["outcome"] == "no_learning" and trials[64.0]["value"] == pytest.approx(0.504)
    never = next(c for c in summary["candidates"] if c["params"] == {"lr_ratio": 64.0})
    assert never["n"] == 0 and never["not_ok"] == 2 and set(never["statuses"].values()) == {"no_learning"}
    assert summary["winner"]["params"] == {"lr_ratio": 4.0}
    (tmp_path / "alone").mkdir()
    alone = load_tune_spec(spec_for(tmp_path / "alone", search={"lr_ratio": [64]}, seeds=2, top_k=1,
                                    heldout_seeds=3, budget={"epochs": 12}))
    summary = run_tune(alone, train_fn=FAKE, progress=False)
    assert summary["winner"] is None and summary["heldout"] is None  # nothing learned: nothing to name or score
    assert "winner: none (no candidate has a seed run that finished ok" in render_summary(summary)


def test_the_search_stops_when_its_budget_is_spent(tmp_path):
    # budget 14 epochs, 1 seed: the search may start trials while fewer than 14 epochs are spent
    tune = load_tune_spec(spec_for(tmp_path, seeds=1, budget={"epochs": 6}, pruner={"kind": "none"}))
    summary = run_tune(tune, train_fn=FAKE, progress=False)
    assert len(summary["trials"]) == 2  # 4 epochs, then 8 >= 6: no third trial
    assert summary["search_epochs"] == 8 and summary["winner"] is not None


def test_summary_of_a_tune_and_report_cli(tmp_path, capsys):
    from peftlab.cli.main import main

    tune = load_tune_spec(spec_for(tmp_path, seeds=2))
    with pytest.raises(PeftlabError, match="no tune has run"):
        load_summary(tune)
    run_tune(tune, train_fn=FAKE, progress=False)
    assert main(["tune", str(tune.spec_path), "--summary"]) == 0
    out = capsys.readouterr().out
    assert "winner: lr_ratio=4" in out and "re-run with 2 seeds" in out
    assert main(["report", str(tune.store_path)]) == 0
    out = capsys.readouterr().out
    assert "peftlab tune: tune.yaml" in out and "winner: lr_ratio=4" in out
    # a second rerun trains nothing and names the same winner
    before = len(epoch_calls(tmp_path / "tune"))
    assert run_tune(tune, train_fn=FAKE, progress=False)["winner"]["params"] == {"lr_ratio": 4.0}
    assert len(epoch_calls(tmp_path / "tune")) == before


def test_changed_search_cannot_continue_the_study(tmp_path):
    run_tune(load_tune_spec(spec_for(tmp_path, seeds=1, search={"lr_ratio": [1, 2]}, budget={"epochs": 8})),
             train_fn=FAKE, progress=False)
    changed = load_tune_spec(spec_for(tmp_path, seeds=1, search={"lr_ratio": [1, 4]}, budget={"epochs": 8}))
    with pytest.raises(PeftlabError, match="spec's base, search, metric or pruner changed"):
        run_tune(changed, train_fn=FAKE, progress=False)


def test_ray_backend_without_ray_is_one_line(tmp_path, monkeypatch, capsys):
    from peftlab.cli.main import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert main(["tune", str(spec_for(tmp_path)), "--backend", "ray"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and 'pip install "peftlab[ray]"' in err
    assert main(["tune", str(spec_for(tmp_path)), "--address", "auto"]) == 2
    assert "--address only applies to --backend ray" in capsys.readouterr().err


# --------------------------------------------------------------------------- kill and rerun

DRIVER = """
import sys
from peftlab.lab.tune.run import run_tune
from peftlab.lab.tune.spec import load_tune_spec
run_tune(load_tune_spec(sys.argv[1]), train_fn="test_tune:fake_train", progress=True)
"""


@pytest.mark.slow  # two Python start-ups with torch, ~20 s
def test_killed_tune_resumes_without_rerunning_finished_trials(tmp_path):
    spec = spec_for(tmp_path, seeds=2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           SLEEP_ENV: "0.3"}
    root = tmp_path / "tune"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(spec)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        # kill in the middle of the third trial (two are finished and told)
        while time.monotonic() < deadline and len({c["dir"] for c in epoch_calls(root)}) < 3:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    first = epoch_calls(root)
    killed_dir = first[-1]["dir"]
    assert len({c["dir"] for c in first}) == 3
    rerun = subprocess.run([sys.executable, "-c", DRIVER, str(spec)], env={**env, SLEEP_ENV: "0"}, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "continuing 1 trial(s) left unfinished by a killed tune" in rerun.stdout
    calls = epoch_calls(root)
    # no epoch of any run trained twice: the finished trials were not rerun, the killed one resumed
    assert len({(c["dir"], c["epoch"]) for c in calls}) == len(calls)
    again = calls[len(first):]
    assert not any(c["dir"] in {f["dir"] for f in first} - {killed_dir} for c in again)
    summary = load_summary(load_tune_spec(spec))
    assert len(summary["trials"]) == 5 and len({t["key"] for t in summary["trials"]}) == 5
    assert all(t["outcome"] != "running" for t in summary["trials"])
    assert summary["winner"]["params"] == {"lr_ratio": 4.0}
    with Store(root / "results.sqlite") as store:
        rows = store.rows()
    assert all(r["status"] in ("ok", "diverged", "pruned") for r in rows)
    assert all((r["status"] == "pruned") == (".pruned-e" in r["key"]) for r in rows)  # pruned: never a run's key
    # the trials + one more seed per candidate + the winner's 10 held-out seeds
    assert len(rows) == 5 + len(summary["candidates"]) * (2 - 1) + 10


def test_a_tune_killed_after_a_pruned_trial_was_recorded_but_not_told_resumes(tmp_path, monkeypatch):
    """The store has moved the pruned trial's row to its pruned key, the study still has the trial running:
    the rerun tells it from the moved row and trains nothing of it again."""
    from peftlab.lab.tune import run as tune_module

    real_finish = tune_module.Tuner.finish
    killed = []

    def dies_once(self, key):
        row = self.store.find(key)
        if row is not None and row["status"] == "pruned" and not killed:
            killed.append(row["key"])
            raise KeyboardInterrupt  # as a kill right after Store.finish moved the row
        return real_finish(self, key)

    spec = spec_for(tmp_path, seeds=2, heldout_seeds=0)
    monkeypatch.setattr(tune_module.Tuner, "finish", dies_once)
    with pytest.raises(KeyboardInterrupt):
        run_tune(load_tune_spec(spec), train_fn=FAKE, progress=False)
    assert killed and ".pruned-e" in killed[0]
    first = epoch_calls(tmp_path / "tune")
    summary = run_tune(load_tune_spec(spec), train_fn=FAKE, progress=False)
    calls = epoch_calls(tmp_path / "tune")
    assert len({(c["dir"], c["epoch"]) for c in calls}) == len(calls)  # no epoch trained twice
    with Store(tmp_path / "tune" / "results.sqlite") as store:
        trial_dir = Path(store.get(killed[0])["config"]["output_dir"]).name
    assert trial_dir in {c["dir"] for c in first} and trial_dir not in {c["dir"] for c in calls[len(first):]}
    told = next(t for t in summary["trials"] if t["key"] == killed[0])
    assert told["outcome"] == "pruned" and told["state"] == "pruned" and len(calls) > len(first)
    assert summary["winner"]["params"] == {"lr_ratio": 4.0}


# --------------------------------------------------------------------------- the real loop


@pytest.mark.slow
@needs_data("glue", "RTE", "train.tsv")
def test_real_tune_prunes_a_diverging_lambda(tmp_path, monkeypatch):
    """tiny-bert on 16 RTE examples: lambda 1e30 (a huge eta_V) gives a non-finite loss, so that trial is
    stopped in its first epoch and reported diverged; the others run through the real on_epoch_end hook."""
    monkeypatch.setenv("PEFTLAB_DATA_DIR", str(DATA))
    monkeypatch.chdir(tmp_path)
    spec = write_spec(tmp_path / "real.yaml", {
        "output_dir": "runs/real",
        "base": {"model": "tiny-bert", "task": "rte", "max_train_samples": 16, "max_eval_samples": 16,
                 "epochs": 2, "max_length": 32, "batch_size": 8, "lr": 1e-3, "threads": 1},
        "search": {"lr_ratio": [1, 1.0e30]}, "budget": {"epochs": 6}, "seeds": 2, "top_k": 1, "heldout_seeds": 2})
    summary = run_tune(load_tune_spec(spec), progress=False)
    trials = {t["params"]["lr_ratio"]: t for t in summary["trials"]}
    assert trials[1e30]["outcome"] == "diverged" and trials[1e30]["epochs"] == 1
    assert "non-finite" in trials[1e30]["reason"]
    # lambda 1 runs both epochs through the real hook, never pruned (a lone trial is never pruned); whether
    # tiny-bert on 16 examples rises above chance is the loop's call (training/guards.py): either way the
    # tune must say it truthfully
    one = trials[1.0]
    assert one["outcome"] in ("complete", "no_learning") and one["epochs"] == 2
    (candidate,) = summary["candidates"]
    statuses = {run["status"] for run in Store(load_tune_spec(spec).store_path, create=False).rows()
                if run["config"]["lr_ratio"] == 1.0}
    if summary["winner"] is not None:  # it learned: scored on the held-out seeds by the real loop
        assert summary["winner"]["params"] == {"lr_ratio": 1.0} and summary["winner"]["n"] == 2
        assert summary["heldout"]["seeds"] == [1000, 1001] and summary["heldout"]["n"] + sum(
            st != "ok" for st in summary["heldout"]["statuses"].values()) == 2
    else:  # it never left chance on any seed: no winner, so nothing to score on held-out seeds
        assert statuses == {"no_learning"} and candidate["n"] == 0 and summary["heldout"] is None
        assert "winner: none (no candidate has a seed run that finished ok" in render_summary(summary)
    run_dir = Path(run_config(load_tune_spec(spec), {"lr_ratio": 1.0}, 0).output_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["stopped_early"] is None and len(result["epochs_log"]) == 2


def test_a_range_is_sampled_by_tpe_with_hyperband(tmp_path):
    tune = load_tune_spec(spec_for(tmp_path, base={**BASE, "lr_ratio": 4},
                                   search={"lr": {"low": 5e-4, "high": 2e-3, "log": True}, "rank": [4, 8]},
                                   budget={"epochs": 24}, seeds=2, top_k=1,
                                   pruner={"kind": "hyperband", "min_epochs": 1, "reduction_factor": 2}))
    assert tune.grid_size is None and tune.grid_epochs is None
    summary = run_tune(tune, train_fn=FAKE, progress=False)
    lrs = [t["params"]["lr"] for t in summary["trials"]]
    assert all(5e-4 <= lr <= 2e-3 for lr in lrs) and len(set(lrs)) == len(lrs)
    assert summary["search_epochs"] >= 24 - 4 and summary["winner"]["n"] == 2
    assert summary["fraction_of_grid"] is None and "% of it" not in render_summary(summary)
