"""The fair-comparison protocol: three disjoint splits, early stopping to a plateau, labels from every evaluation
point, each row's rate search extended past an edge, and `peftlab study --dry-run` stating all of it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from peftlab.lab import study_protocol as sp
from peftlab.lab.study_fair import replay_searches
from test_run_record import scripted_glue, tiny_cfg, toy_cfg, toy_sst2
from peftlab.training.loop import train


# --------------------------------------------------------------------------- three disjoint splits


def distinct_sst2(root, n_train: int = 120, n_dev: int = 40):
    """A GLUE-layout SST-2 whose every sentence is unique (a numbered token), so overlap is caught by text."""
    folder = root / "glue" / "SST-2"
    folder.mkdir(parents=True)
    rows = {"train.tsv": [(f"train sentence {i} {'wonderful' if i % 2 else 'terrible'}", i % 2) for i in range(n_train)],
            "dev.tsv": [(f"dev sentence {i} {'wonderful' if i % 2 else 'terrible'}", i % 2) for i in range(n_dev)]}
    for name, pairs in rows.items():
        (folder / name).write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in pairs))
    return root


def test_the_selection_split_is_disjoint_from_every_training_subset_and_the_test_split(tmp_path):
    from peftlab.tasks import data_files as data

    root = distinct_sst2(tmp_path / "data")
    full = data.load_split("sst2", "train", root)
    test = set(data.load_split("sst2", "validation", root)["text_a"])
    pool, selection, stratified = data.selection_split(full, 30, seed=0, regression=False)
    chosen = set(selection["text_a"])
    assert len(chosen) == 30 and stratified
    assert sorted(selection["label"]).count(1) == 15  # stratified: the training split's 50/50
    assert not chosen & test
    for seed in range(5):  # what every seed's training subset is drawn from
        drawn = set(data.subset(pool, 60, seed)["text_a"])
        assert not drawn & chosen and not drawn & test
    again = data.selection_split(full, 30, seed=0, regression=False)[1]
    assert list(again["text_a"]) == list(selection["text_a"])  # fixed by --eval-seed, not by the training seed


def test_a_split_whose_selection_overlaps_training_would_be_caught(tmp_path):
    """The oracle above can fail: a subset drawn from the whole training split does meet the selection split."""
    from peftlab.tasks import data_files as data

    full = data.load_split("sst2", "train", distinct_sst2(tmp_path / "data"))
    selection = set(data.selection_split(full, 30, seed=0, regression=False)[1]["text_a"])
    assert set(data.subset(full, 100, 0)["text_a"]) & selection


def test_a_run_chooses_on_the_selection_split_and_reports_the_test_split(tmp_path):
    result = train(toy_cfg(tmp_path / "run", distinct_sst2(tmp_path / "data"), epochs=2, selection_samples=24,
                           max_train_samples=48))
    assert result["choice_metric"] == "selection_accuracy"
    assert result["selection"]["examples"] == 24 and result["selection"]["stratified"]
    assert result["train_examples"] == 2 * 48
    metrics = result["best"]["metrics"]
    assert {"accuracy", "selection_accuracy"} <= set(metrics)
    best_epoch = max(result["epochs_log"], key=lambda e: (e["metrics"]["selection_accuracy"], -e["epoch"]))
    assert result["best"]["epoch"] == best_epoch["epoch"] == result["test"]["epoch"]
    # the test split is read once, on the saved (selection-best) weights: no epoch's choice could see it
    assert result["test"]["metrics"]["accuracy"] == metrics["accuracy"]
    for epoch in result["epochs_log"]:
        assert ("accuracy" in epoch["metrics"]) == (epoch["epoch"] == result["best"]["epoch"] == 2)
    assert all(set(point["metrics"]) == {"selection_accuracy", "selection_f1"} or "accuracy" not in point["metrics"]
               for point in result["curve"])


def test_selection_samples_is_refused_for_a_task_without_a_glue_training_split(tmp_path):
    from peftlab.errors import PeftlabError

    with pytest.raises(PeftlabError, match="not a GLUE task"):
        tiny_cfg(tmp_path / "run", task="gsm8k", model="tiny-llama", selection_samples=10)


# --------------------------------------------------------------------------- to the plateau; labels


def test_early_stopping_ends_the_run_at_its_plateau_and_keeps_it_ok(tmp_path, monkeypatch):
    values = {f"epoch{e}": {"accuracy": v} for e, v in enumerate([0.6, 0.8, 0.79, 0.8005, 0.7, 0.9], start=1)}
    scripted_glue(monkeypatch, values, chance=0.5)
    result = train(tiny_cfg(tmp_path / "run", epochs=6, early_stop_patience=2, early_stop_min_delta=0.001))
    assert result["status"] == "ok" and result["stopped_early"] is None
    assert result["early_stopped"]["epoch"] == 4 and result["epochs_run"] == 4
    assert result["plateau"] == {"verdict": "stopped", "patience": 2, "min_delta": 0.001, "best_gain_epoch": 2,
                                 "evals_without_gain": 2}
    assert result["best"]["epoch"] == 4  # the best epoch is still the best value; only the gain has a threshold


def test_a_run_still_gaining_at_its_cap_says_so(tmp_path, monkeypatch):
    scripted_glue(monkeypatch, {"epoch1": {"accuracy": 0.6}, "epoch2": {"accuracy": 0.7}}, chance=0.5)
    result = train(tiny_cfg(tmp_path / "run", epochs=2, early_stop_patience=3))
    assert result["plateau"]["verdict"] == "improving" and result["early_stopped"] is None


def test_a_run_that_rises_and_falls_back_between_epoch_ends_is_collapsed(tmp_path, monkeypatch):
    # 24 examples / batch 8 = 3 steps per epoch; --eval-steps 2 evaluates at step 2 (mid epoch 1) and 4 (mid 2)
    values = {"step2": {"accuracy": 0.70}, "epoch1": {"accuracy": 0.5}, "step4": {"accuracy": 0.5},
              "epoch2": {"accuracy": 0.5}}
    scripted_glue(monkeypatch, values, chance=0.5)
    result = train(tiny_cfg(tmp_path / "run", epochs=2, eval_steps=2))
    assert result["status"] == "collapsed", result["status_reason"]
    assert "after reaching 0.7000" in result["status_reason"]


# --------------------------------------------------------------------------- rate searches


def fake_store(design: sp.Design, task: str, scores: dict[str, dict[float, float]]) -> dict[str, dict]:
    """Store rows by run key for every search config whose rate has a score (row name -> rate -> value)."""
    from peftlab.lab.study_plan import keyed

    rows = {}
    for row in design.rows:
        for step in range(-6, 7):
            rate = sp.rate_at(row, step, design.protocol.grid_factor)
            if rate not in scores.get(row.name, {}):
                continue
            for config, key in keyed(sp.search_configs(design, task, row, [step])):
                value = scores[row.name][rate]
                rows[key] = {"key": key, "status": "ok", "config": config,
                             "result": {"choice_metric": "selection_accuracy", "primary_metric": "accuracy",
                                        "best": {"metrics": {"selection_accuracy": value}}}}
    return rows


def small_design(**protocol) -> sp.Design:
    rows = (sp.Row("lora", {"method": "lora"}, 1e-3), sp.Row("head", {"method": "head"}, 1e-3))
    return sp.Design("kasa", ("rte",), {"model": "tiny-bert", "epochs": 2, "targets": "q,v"}, rows,
                     sp.Protocol(selection_samples=8, **protocol), paper_arms=False)


def test_a_row_whose_best_rate_is_at_the_edge_gets_an_extended_grid():
    design = small_design(max_extensions=3)
    # lora keeps improving with the rate up to 4e-3 (two points past the first grid's edge), head peaks inside
    scores = {"lora": {5e-4: 0.6, 1e-3: 0.7, 2e-3: 0.75, 4e-3: 0.8, 8e-3: 0.7},
              "head": {5e-4: 0.6, 1e-3: 0.65, 2e-3: 0.62}}
    rounds = []
    store = fake_store(design, "rte", scores)

    def run_round(number, configs):
        rounds.append(sorted({c.get("lr", c.get("head_lr")) for c in configs if c["method"] == "lora"}))
        return store

    searches = replay_searches(design, "rte", {}, run_round)
    assert rounds[0] == [5e-4, 1e-3, 2e-3] and rounds[-1] == [5e-4, 1e-3, 2e-3, 4e-3, 8e-3]
    assert searches["lora"].best.rate == 4e-3 and searches["lora"].at_edge is None
    assert searches["lora"].extensions == 2
    assert searches["head"].best.rate == 1e-3 and searches["head"].extensions == 0


def test_extensions_stop_at_their_limit_and_the_edge_is_reported():
    design = small_design(max_extensions=1)
    scores = {"lora": {5e-4: 0.6, 1e-3: 0.7, 2e-3: 0.75, 4e-3: 0.8, 8e-3: 0.9}, "head": {5e-4: 0.9, 1e-3: 0.6,
                                                                                       2e-3: 0.5, 2.5e-4: 0.95}}
    store = fake_store(design, "rte", scores)
    searches = replay_searches(design, "rte", {}, lambda number, configs: store)
    assert searches["lora"].best.rate == 4e-3 and searches["lora"].at_edge == "high"
    assert searches["head"].best.rate == 2.5e-4 and searches["head"].at_edge == "low"


def test_a_best_rate_tied_at_the_edge_is_a_plateau_and_is_not_extended():
    """A row that learned at no rate scores chance everywhere: its smallest rate 'wins' a tie at the low edge, and
    a grid extended for it would spend runs on a flat line (MRPC at 1,000 examples did). A best tied with an
    interior rate is no slope past the edge either; an edge rate better by any margin still extends."""
    design = small_design(max_extensions=3)
    scores = {"lora": {5e-4: 0.5, 1e-3: 0.5, 2e-3: 0.5}, "head": {5e-4: 0.6, 1e-3: 0.65, 2e-3: 0.65}}
    store = fake_store(design, "rte", scores)
    searches = replay_searches(design, "rte", {}, lambda number, configs: store)
    assert searches["lora"].best.rate == 5e-4 and searches["lora"].at_edge is None  # the tie's smaller rate
    assert searches["lora"].extensions == 0
    assert searches["head"].best.rate == 1e-3 and searches["head"].at_edge is None
    assert searches["head"].extensions == 0
    scores["head"] = {5e-4: 0.6, 1e-3: 0.65, 2e-3: 0.65 + 1e-6, 4e-3: 0.5}
    searches = replay_searches(design, "rte", {}, lambda number, configs: fake_store(design, "rte", scores))
    assert searches["head"].best.rate == 2e-3 and searches["head"].extensions == 1


@pytest.mark.parametrize("spread, equivalent", [(0.0, None), (0.001, True)])
def test_arms_alike_on_every_pair_get_no_equivalence_claim(spread, equivalent):
    """Two arms that learned nothing score the same on every seed: every paired difference is 0, the t statistic
    is 0/0, and TOST's would be infinite; the comparison says no difference and claims no equivalence. With any
    spread inside the margin, TOST decides as usual."""
    from peftlab.lab import verdicts as vt
    from peftlab.lab.study_fair_report import comparison_data, holm
    from peftlab.lab.table_model import Cell

    a, b = Cell(), Cell()
    for seed, shift in zip((100, 101, 102), (0.0, spread, -spread)):
        a.add_run("no_learning", seed, 0.5 + shift)
        b.add_run("no_learning", seed, 0.5)
    data = comparison_data("a − b", ("a", a), ("b", b), 0.01, 100.0, "the family")
    holm([data])
    assert data["n_pairs"] == 3 and data["diff"] == pytest.approx(0.0) and not data["significant"]
    text = vt.comparison_text(data)
    if equivalent is None:
        assert data["tost_p"] is None and not data["equivalent"] and "equivalent" not in text
    else:
        assert data["equivalent"] and "; equivalent within ±1 (TOST Holm p" in text


def test_every_finished_search_run_counts_and_a_crash_leaves_the_rate_unscored():
    row = sp.Row("lora", {"method": "lora"}, 1e-3)
    result = {"choice_metric": "selection_accuracy", "majority_baseline": 0.5, "best": {"metrics": {}}}
    labelled = {0: {"status": "no_learning", "result": {**result, "best": {"metrics": {"selection_accuracy": 0.52}}}},
                1: {"status": "diverged", "result": result}}
    score = sp.score_rate(row, 0, 2.0, labelled)
    assert score.mean == pytest.approx((0.52 + 0.5) / 2) and score.labels == ("no_learning", "diverged")
    crashed = sp.score_rate(row, 0, 2.0, {0: labelled[0], 1: {"status": "failed", "result": None}})
    assert crashed.mean is None


# --------------------------------------------------------------------------- the command


def test_study_dry_run_prints_the_protocol_and_refuses_the_other_protocols_flags():
    run = subprocess.run([sys.executable, "-m", "peftlab.cli.main", "study", "kasa", "--task", "rte", "--model",
                          "tiny-bert", "--rows", "lora,kasa", "--dry-run"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "lora: 0.00025, 0.0005, 0.001" in out and "selection 500 carved out of the training split" in out
    assert "early stopping after 3 evaluated epoch(s)" in out and "at most 20 epochs" in out
    assert "runs per task: 12 search + 40 held-out = 52" in out
    refused = subprocess.run([sys.executable, "-m", "peftlab.cli.main", "study", "kasa", "--task", "rte", "--lr",
                              "1e-3", "--dry-run"], capture_output=True, text=True)
    assert refused.returncode == 2 and "fixed-rate protocol" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_study_help_shows_the_protocol_options():
    out = subprocess.run([sys.executable, "-m", "peftlab.cli.main", "study", "lambda", "--help"],
                         capture_output=True, text=True).stdout
    for flag in ("--protocol", "--selection-samples", "--patience", "--min-delta", "--max-extensions", "--key-seeds"):
        assert flag in out


def test_plan_json_is_written_once_and_a_rerun_with_other_settings_is_refused(tmp_path):
    from peftlab.errors import PeftlabError
    from peftlab.lab.study_plan import save_fair_plan
    from peftlab.lab.study_plan import StudyPaths

    paths = StudyPaths(tmp_path / "s", tmp_path / "s" / "results.sqlite")
    save_fair_plan(paths, small_design())
    assert json.loads(paths.plan.read_text())["protocol"] == "fair"
    save_fair_plan(paths, small_design())
    with pytest.raises(PeftlabError, match="other settings"):
        save_fair_plan(paths, small_design(patience=5))


# --------------------------------------------------------------------------- a whole fair study, fake runs


def test_a_fair_study_searches_each_row_runs_the_picks_held_out_and_writes_its_verdicts_from_the_data(tmp_path):
    from peftlab.lab import verdicts as vt
    from peftlab.lab.study import run_fair_study
    from peftlab.lab.study_plan import StudyPaths
    from test_study import BASE, FAKE, calls

    rows = (sp.Row("lora", {"method": "lora"}, 1e-3), sp.Row("head", {"method": "head"}, 1e-3))
    design = sp.Design("kasa", ("rte",), dict(BASE), rows, sp.Protocol(selection_samples=8), heldout_seeds=3,
                       paper_arms=False)
    paths = StudyPaths(tmp_path / "f", tmp_path / "f" / "results.sqlite")
    run_fair_study(design, paths, workers=0, train_fn=FAKE, progress=False, say=lambda *a: None)
    made = calls(paths.root)
    # the fake world peaks at a rate of 3e-3: lora's first grid (5e-4 .. 2e-3) is extended to 4e-3 and 8e-3
    assert sorted({c["lr"] for c in made if c["seed"] < 100}) == [5e-4, 1e-3, 2e-3, 4e-3, 8e-3]
    assert {c["seed"] for c in made if c["seed"] >= 100} == {100, 101, 102}
    assert {c["lr"] for c in made if c["seed"] >= 100} == {4e-3}  # both rows' pick (head: its one rate)
    verdicts = json.loads((paths.root / "verdicts.json").read_text())["tasks"]["rte"]
    assert verdicts["rows"]["lora"]["chosen_rate"] == 4e-3 and verdicts["rows"]["lora"]["at_edge"] is None
    report = (paths.root / "REPORT.md").read_text()
    assert "**0.004: " in report and "peftlab study kasa --task rte" in report
    comparison = verdicts["families"]["adapter"]["lora − head (what the adapter adds)"]
    assert comparison["n_pairs"] == 3
    for line in vt.comparison_lines(comparison):
        assert line in report
    comparison["diff"] = -comparison["diff"]  # a sentence follows its number
    assert vt.comparison_lines(comparison)[0] not in report


def test_a_tune_with_a_selection_split_chooses_on_it_and_reports_the_test_split(tmp_path):
    import yaml

    from peftlab.lab.tune.spec import load_tune_spec
    from peftlab.lab.tune.summary import reported_metric

    spec = tmp_path / "tune.yaml"
    base = {"model": "tiny-bert", "task": "rte", "epochs": 2, "max_train_samples": 32, "selection_samples": 16}
    spec.write_text(yaml.safe_dump({"base": base, "search": {"lr_ratio": [1, 4]}, "budget": {"epochs": 100}}))
    tune = load_tune_spec(spec)
    assert tune.metric == "selection_accuracy" and reported_metric(tune.metric) == "accuracy"
    spec.write_text(yaml.safe_dump({"base": {**base, "selection_samples": 0}, "search": {"lr_ratio": [1, 4]},
                                    "budget": {"epochs": 100}}))
    assert load_tune_spec(spec).metric == "accuracy"


def test_sigma_movement_is_measured_against_adams_bound():
    from peftlab.lab.study_fair_report import sigma_vs_adam

    run = {"result": {"kasa_sigma": {"a": [1.0, 2.5], "b": [0.0]}, "kasa_sigma_init": {"a": [1.0, 2.0], "b": [0.1]},
                      "optimizer_steps": 100, "lr": 1e-3}}
    # module a moved 0.5 at most, b 0.1; Adam moves a parameter about one rate per step: 100 x 1e-3 = 0.1
    assert sigma_vs_adam([run]) == pytest.approx((5.0 + 1.0) / 2)
    assert sigma_vs_adam([{"result": {"optimizer_steps": 0}}]) is None
