"""The tune-vs-grid comparison (scripts/tune_compare.py): the grid's best, the naive search's pick and the tune's
winner from a store built here with known metrics, each recomputed in the test with plain Python/numpy; only
finished ok runs count; missing held-out runs are named; and the committed lambda grid gives the issue's
naive cost (36 epochs)."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from peftlab.errors import PeftlabError
from peftlab.lab.store import Store, config_key
from peftlab.lab.tune.spec import load_tune_spec, run_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # research code beside the package
from tune_compare import (  # noqa: E402
    compare, compare_files, grid_best, index_rows, load_rows, naive_pick, naive_top_k_within, render_comparison)
from fake_results import checked  # noqa: E402 - tests/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 2
# best-epoch accuracy per (lr_ratio, seed); None: the run diverged in its second epoch
SELECTION = {1.0: [0.70, 0.90, 0.90], 2.0: [0.85, 0.80, 0.80], 4.0: [0.80, 0.60, 0.60], 8.0: [0.75, None, 0.95]}
HELDOUT = {2.0: {100: 0.81, 101: 0.79, 102: 0.83, 103: ("no_learning", 0.50)}, 1.0: {100: 0.88, 101: 0.86}}


def make_spec(tmp_path: Path, **overrides) -> Path:
    spec = {"output_dir": str(tmp_path / "tune"),
            "base": {"model": "tiny-bert", "task": "rte", "epochs": EPOCHS, "lr": 1e-3},
            "search": {"lr_ratio": [1, 2, 4, 8]}, "budget": {"grid_fraction": 1.0}, "seeds": 3, "top_k": 1,
            "heldout_seeds": 4, "heldout_seed_start": 100, **overrides}
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_result(cfg: dict, value: float, *, status: str = "ok", epochs: int = EPOCHS, stopped=None) -> dict:
    log = [{"epoch": e, "train_loss": 0.5, "metrics": {"accuracy": value - 0.01 * (epochs - e)}, "seconds": 1.0}
           for e in range(1, epochs + 1)]
    return checked({"status": status, "config": cfg, "primary_metric": "accuracy", "majority_baseline": 0.527,
                    "epochs_log": log, "best": {"epoch": epochs, "metrics": {"accuracy": value}},
                    "final": {"metrics": {"accuracy": log[-1]["metrics"]["accuracy"]}},
                    "trainable_params": {"adapter": 1000, "head": 600, "total": 1600}, "stopped_early": stopped})


def fake_store(tmp_path: Path):
    tune = load_tune_spec(make_spec(tmp_path))
    path = tmp_path / "grid.sqlite"
    with Store(path) as store:
        for lam, values in SELECTION.items():
            for seed, value in zip(tune.seed_list, values):
                cfg = run_config(tune, {"lr_ratio": lam}, seed).config
                if value is None:
                    store.add(cfg, result=run_result(cfg, 0.5, status="diverged", epochs=1))
                else:
                    store.add(cfg, result=run_result(cfg, value))
        for lam, by_seed in HELDOUT.items():
            for seed, value in by_seed.items():
                cfg = run_config(tune, {"lr_ratio": lam}, seed).config
                status, value = value if isinstance(value, tuple) else ("ok", value)
                store.add(cfg, result=run_result(cfg, value, status=status))
        # a pruned trial of lambda 4, seed 1 with a high value: under its own key, it must change nothing
        cfg = run_config(tune, {"lr_ratio": 4.0}, 1).config
        store.add(cfg, result=run_result(cfg, 0.99, epochs=1, stopped={"epoch": 1, "reason": "pruned"}))
    return tune, path


def expected_ranking(table: dict[float, list], seeds_of_interest=None):
    """The rule, written out: ok values only; any not-ok seed ranks a point below all-ok points; best mean."""
    def key(lam):
        values = [v for v in table[lam] if v is not None]
        return (sum(v is None for v in table[lam]), -statistics.fmean(values))
    return sorted(seeds_of_interest or table, key=key)


def test_grid_best_naive_pick_and_costs_match_an_independent_computation(tmp_path):
    tune, path = fake_store(tmp_path)
    by_key = index_rows(load_rows([path]))
    grid = grid_best(tune, by_key)
    best = expected_ranking(SELECTION)[0]
    assert best == 1.0 and grid.params == {"lr_ratio": best}  # lambda 8 has the higher ok mean but diverged once
    assert grid.selection.mean == pytest.approx(np.mean(SELECTION[1.0]))
    assert grid.selection.std == pytest.approx(np.std(SELECTION[1.0], ddof=1))
    assert grid.cost_epochs == 11 * EPOCHS + 2  # 12 runs; the diverged one trained 1 epoch + its partial one
    for k in (1, 2, 3, 4):
        first_round = sorted(SELECTION, key=lambda lam: -SELECTION[lam][0])[:k]  # seed 0 values
        want = expected_ranking(SELECTION, first_round)[0]
        pick = naive_pick(tune, by_key, top_k=k)
        assert pick.params == {"lr_ratio": want}, k
        # each re-seeded point: seeds 1 and 2, 2 epochs each (lambda 8's diverged seed: 1 logged + 1 partial)
        assert pick.cost_epochs == len(SELECTION) * EPOCHS + k * 2 * EPOCHS, k
    assert naive_pick(tune, by_key).params == {"lr_ratio": 2.0}  # the spec's top_k (1): not the grid's best
    # the budget sizes k: 4 points x 2 epochs first, then 2 more seeds x 2 epochs per re-seeded point
    assert [naive_top_k_within(tune, b) for b in (7, 8, 11, 12, 19, 20, 1000)] == [0, 0, 0, 1, 2, 3, 4]


def test_heldout_scores_count_only_ok_runs_and_name_the_missing_ones(tmp_path):
    tune, path = fake_store(tmp_path)
    summary = {"winner": {"params": {"lr_ratio": 2.0}}, "spent_epochs": 10, "pruner": "ASHA", "top_k": 1}
    comp = compare(tune, load_rows([path]), summary=summary)
    grid, naive, tuned = (comp.pick(s) for s in ("grid", "naive", "tune"))
    ok = [0.81, 0.79, 0.83]  # seed 103 never left chance: not a value
    assert naive.heldout.n == 3 and naive.heldout.mean == pytest.approx(np.mean(ok))
    assert naive.heldout.std == pytest.approx(np.std(ok, ddof=1)) and naive.heldout.statuses[103] == "no_learning"
    assert naive.heldout.missing == () and tuned.heldout == naive.heldout and tuned.cost_epochs == 10
    assert tuned.selection.mean == pytest.approx(np.mean(SELECTION[2.0]))
    assert grid.heldout.n == 2 and grid.heldout.mean == pytest.approx(0.87) and grid.heldout.missing == (102, 103)
    text = render_comparison([comp])
    assert "| rte | grid | lr_ratio=1 | 0.8333 ± 0.1155 (3 of 3) | 0.8700 ± 0.0141 (2 of 4) | 24 (100%) |" in text
    assert f"| rte | naive | lr_ratio=2 | 0.8167 ± 0.0289 (3 of 3) | {np.mean(ok):.4f} ± 0.0200 (3 of 4) |" in text
    assert "held-out runs missing: grid {lr_ratio=1} seed(s) 102, 103" in text
    assert "naive {" not in text.split("held-out runs missing")[1]  # the naive pick's are all there
    no_heldout = compare(load_tune_spec(make_spec(tmp_path, heldout_seeds=0)), load_rows([path]))
    assert no_heldout.pick("grid").heldout is None and "not asked" in render_comparison([no_heldout])


def test_a_complete_run_wins_over_an_old_stores_pruned_trial_of_its_key(tmp_path):
    """Two stores share a key: the grid's complete run and a schema-1 tune's pruned trial stored 'ok'."""
    tune, path = fake_store(tmp_path)
    rows = load_rows([path])
    cell = run_config(tune, {"lr_ratio": 1.0}, 0)
    legacy = {"key": cell.key, "status": "ok", "config": cell.config,
              "result": run_result(cell.config, 0.99, epochs=1, stopped={"epoch": 1, "reason": "pruned"})}
    for order in ([legacy] + rows, rows + [legacy]):
        assert index_rows(order)[cell.key]["result"]["best"]["metrics"]["accuracy"] == 0.70
    only_legacy = [r for r in rows if r["key"] != cell.key] + [legacy]
    with pytest.raises(PeftlabError, match="grid best: 1 run.* not finished.*lr_ratio=1.0.* seed 0"):
        grid_best(tune, index_rows(only_legacy))  # a pruned trial is no grid cell


def test_an_incomplete_grid_is_one_clear_error(tmp_path):
    tune, path = fake_store(tmp_path)
    with Store(path) as store:
        store.conn.execute("DELETE FROM runs WHERE key = ?", (run_config(tune, {"lr_ratio": 4.0}, 2).key,))
    with pytest.raises(PeftlabError, match=r"grid best: 1 run\(s\) of the grid are not finished") as info:
        compare(tune, load_rows([path]))
    assert "\n" not in str(info.value)
    assert naive_pick(tune, index_rows(load_rows([path]))).params == {"lr_ratio": 2.0}  # needs no lambda 4 seed 2


def test_the_script_prints_the_table(tmp_path, capsys):
    tune, path = fake_store(tmp_path)
    tune.output_root.mkdir()
    (tune.output_root / "tune.json").write_text(json.dumps(
        {"winner": {"params": {"lr_ratio": 2.0}}, "spent_epochs": 10, "top_k": 1}))
    spec = importlib.util.spec_from_file_location("tune_vs_grid", ROOT / "scripts" / "tune_vs_grid.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(path), str(tune.spec_path)]) == 0
    out = capsys.readouterr().out
    assert "| rte | tune | lr_ratio=2 |" in out and "| 10 (42%) |" in out
    assert compare_files(tune.spec_path, [path]).pick("tune") is not None  # tune.json found in output_dir
    assert script.main([str(path), f"{tune.spec_path}={tmp_path / 'nope.json'}"]) == 2
    assert "tune summary not found" in capsys.readouterr().err


def test_the_committed_lambda_grid_gives_the_issues_naive_cost():
    """Issue 21: 'a naive search (every config at seed 0, no pruning, re-seed the top 2: 36 epochs)'; the
    grid's best recomputed with sqlite and plain Python."""
    tune = load_tune_spec(ROOT / "configs" / "tune" / "lambda_sst2_minilm.yaml")
    store = ROOT / "docs" / "study" / "lambda_grid.sqlite"
    comp = compare(tune, load_rows([store]))
    assert comp.pick("naive").cost_epochs == 36 and comp.grid_epochs == 100
    wanted = {run_config(tune, p, s).key: (p["lr_ratio"], p["lr"]) for p in tune.grid_points for s in tune.seed_list}
    means: dict[tuple, list] = {}
    with sqlite3.connect(store) as db:
        for key, status, result in db.execute("SELECT key, status, result FROM runs"):
            if key in wanted and status == "ok":
                r = json.loads(result)
                means.setdefault(wanted[key], []).append(r["best"]["metrics"][r["primary_metric"]])
    db.close()
    best = max(means, key=lambda cell: statistics.fmean(means[cell]))
    assert all(len(v) == 5 for v in means.values()) and len(means) == 10
    assert (comp.pick("grid").params["lr_ratio"], comp.pick("grid").params["lr"]) == best
    assert config_key(run_config(tune, comp.pick("grid").params, 0).config) in wanted
