"""`peftlab report` on stores that could mislead: runs that never learned (no_learning) kept in the mean and the
pairs at their value, their label counted beside the cell with its median and range and the comparison without
them, tune trials pruned beside their complete run counted once, and tables whose runs come from more than one
commit refused without --allow-mixed-code."""

from __future__ import annotations

import json
import sqlite3

import pytest
from scipy import stats

from _report_helpers import markdown
from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.lab.records import load_rows
from peftlab.lab.report import build_table
from peftlab.lab.store import Store, config_key
from peftlab.lab.tables import render_csv
from fake_results import checked  # noqa: E402 - tests/ is on sys.path

SHA_A, SHA_B = "a" * 40, "b" * 40


def config(**overrides) -> dict:
    values = dict(model="tiny-bert", task="stsb", epochs=2, rank=8, method="lora")
    values.update(overrides)
    return build_run_config(overrides=values).to_dict()


def result(cfg: dict, value: float, *, status: str = "ok", **extra) -> dict:
    return checked({"schema_version": 1, "status": status, "status_reason": None if status == "ok" else f"{status}: bar",
            "config": cfg, "primary_metric": "pearson", "majority_baseline": 0.0,  # STS-B: a correlation
            "best": {"epoch": 2, "metrics": {"pearson": value}},
            "final": {"metrics": {"pearson": value}}, "trainable_params": {"adapter": 10, "head": 2, "total": 12},
            **extra}, written_before=() if "code" in extra else ("code",))  # no code: an older peftlab's record


def row(cfg: dict, res: dict | None, *, status: str | None = None, key: str | None = None) -> dict:
    """A row as load_rows returns it (statuses the store of this checkout may not admit yet, e.g. no_learning)."""
    return {"key": key or config_key(cfg), "status": status or res["status"], "config": cfg, "result": res,
            "output_dir": None}


# --------------------------------------------------------------------------- no_learning


STSB = {0: 0.80, 1: 0.025, 2: 0.82, 3: 0.050, 4: 0.79}  # two seeds never left zero correlation


def stsb_rows(lr_ratio: float = 1.0) -> list[dict]:
    out = []
    for seed, value in STSB.items():
        cfg = config(seed=seed, lr_ratio=lr_ratio)
        out.append(row(cfg, result(cfg, value, status="ok" if value > 0.5 else "no_learning")))
    return out


def test_no_learning_runs_are_averaged_in_and_their_label_counted():
    table = build_table(stsb_rows())
    cell = table.rows[0].cells["stsb"]
    assert cell.values == pytest.approx([0.80, 0.025, 0.82, 0.050, 0.79])  # every finished seed, at its value
    assert cell.seeds == [0, 1, 2, 3, 4] and dict(cell.labels) == {"no_learning": 2} and not cell.excluded
    md = markdown(table)
    # the mean of all five seeds, never a mean of the three that learned: the label and the spread beside it
    assert "| 49.7 ± 42.0 (5) [2 no_learning; median 79.0, range 2.5–82.0] |" in md
    assert "no_learning: best dev metric never clearly above chance" in md
    head, *lines = render_csv(table).splitlines()
    rows = [dict(zip(head.split(","), line.split(","))) for line in lines]
    values = next(r for r in rows if "majority class" not in r.values())  # the runs' row, not STS-B's majority 0
    assert float(values["stsb_median"]) == pytest.approx(79.0) and float(values["stsb_min"]) == pytest.approx(2.5)
    assert float(values["stsb_max"]) == pytest.approx(82.0) and values["stsb_labels"] == "2 no_learning"
    assert values["stsb_n"] == "5" and values["stsb_excluded"] == ""


def test_a_no_learning_seed_stays_in_the_paired_comparison():
    other = {s: 0.81 + s / 100 for s in range(5)}
    rows = stsb_rows(1.0) + [row(c, result(c, other[s])) for s, c in ((s, config(seed=s, lr_ratio=2.0))
                                                                      for s in range(5))]
    table = build_table(rows, baseline="lr_ratio=1")
    comparison = next(r for r in table.rows if r.label["lr_ratio"] == 2.0).cells["stsb"].comparison
    assert comparison.n_pairs == 5  # every seed both rows finished, the baseline's no_learning seeds 1 and 3 too
    every = stats.ttest_rel([other[s] for s in range(5)], [STSB[s] for s in range(5)])
    assert comparison.p == pytest.approx(every.pvalue, rel=1e-12)
    # the sensitivity: the same test on the seeds that learned (0, 2, 4), corrected apart
    without = comparison.without_labels
    learned = stats.ttest_rel([other[s] for s in (0, 2, 4)], [STSB[s] for s in (0, 2, 4)])
    assert without.n_pairs == 3 and without.p == pytest.approx(learned.pvalue, rel=1e-12)
    md = markdown(table)
    assert f"5 pairs [without labels: Δ +{(0.83 - (0.80 + 0.82 + 0.79) / 3) * 100:.1f}" in md
    assert "without labels: the same test with the labelled runs of both cells left out" in md


def test_a_run_folder_with_status_no_learning_is_read(tmp_path, capsys):
    folders = []
    for seed, value in STSB.items():
        cfg = config(seed=seed)
        folder = tmp_path / f"run{seed}"
        folder.mkdir()
        (folder / "result.json").write_text(json.dumps(result(cfg, value,
                                                              status="ok" if value > 0.5 else "no_learning")))
        folders.append(str(folder))
    assert main(["report", *folders]) == 0
    assert "49.7 ± 42.0 (5) [2 no_learning; median 79.0, range 2.5–82.0]" in capsys.readouterr().out


# --------------------------------------------------------------------------- pruned trials


def test_a_pruned_trial_beside_its_complete_run_is_counted_once(tmp_path):
    """An older tune store kept its pruned trial as ``ok`` + ``stopped_early`` under the complete run's key; the
    grid's store holds the complete run. Whichever is listed first, the (config, seed) counts once, complete."""
    tune, grid = tmp_path / "tune" / "results.sqlite", tmp_path / "grid" / "results.sqlite"
    tune.parent.mkdir()
    grid.parent.mkdir()
    with Store(tune) as store:
        cfg = config(seed=0)
        key = store.add(cfg, result=result(cfg, 0.709, stopped_early={"epoch": 1, "reason": "pruned by ASHA"}))
    with sqlite3.connect(tune) as conn:  # as a store written before pruned trials got their own key and status
        conn.execute("UPDATE runs SET key = ?, status = 'ok' WHERE key = ?", (config_key(cfg), key))
    assert [(r["key"], r["status"]) for r in load_rows([tune])] == [(config_key(cfg), "ok")]
    with Store(grid) as store:
        for seed, value in enumerate((0.835, 0.84, 0.83)):
            cfg = config(seed=seed)
            store.add(cfg, result=result(cfg, value))
    for order in ([tune, grid], [grid, tune]):
        cell = build_table(load_rows(order)).rows[0].cells["stsb"]
        assert sorted(cell.values) == pytest.approx([0.83, 0.835, 0.84]) and not cell.excluded

    # the new store: status pruned under its own key, beside the complete run of the same config and seed
    rows = [row(config(seed=s), result(config(seed=s), v)) for s, v in enumerate((0.835, 0.84, 0.83))]
    pruned = result(config(seed=0), 0.709, status="pruned", stopped_early={"epoch": 1}, epochs_run=1)
    rows.append(row(config(seed=0), pruned, key="pruned-trial-seed-0"))
    alone = result(config(seed=7), 0.5, status="pruned", stopped_early={"epoch": 1}, epochs_run=1)
    rows.append(row(config(seed=7), alone, key="pruned-trial-seed-7"))  # no complete run: counted, not averaged
    table = build_table(rows)
    cell = table.rows[0].cells["stsb"]
    assert sorted(cell.values) == pytest.approx([0.83, 0.835, 0.84]) and dict(cell.excluded) == {"pruned": 1}
    assert table.superseded_pruned == 1
    md = markdown(table)
    assert "| 83.5 ± 0.5 (3) [left out: 1 pruned] |" in md
    assert "1 pruned tune trial not counted: a complete run of the same config and seed is in the table." in md


# --------------------------------------------------------------------------- code provenance


def code(commit: str | None, dirty: bool | None = False, digest: str = "d" * 64) -> dict:
    return {"commit": commit, "dirty": dirty, "version": "0.1.0", "source_digest": digest}


def store_of(path, codes: list[dict]) -> str:
    with Store(path) as store:
        for seed, extra in enumerate(codes):
            cfg = config(seed=seed)
            store.add(cfg, result=result(cfg, 0.8 + seed / 100, **extra))
    return str(path)


def test_mixed_commits_are_refused_without_the_flag(tmp_path, capsys):
    path = store_of(tmp_path / "results.sqlite", [{"code": code(SHA_A)}] * 3 + [{"git_commit": SHA_B + "+dirty"}] * 2)
    with pytest.raises(PeftlabError, match=r"the table mixes runs of 2 code versions \(aaaaaaa ×3, bbbbbbb ×2\).*"
                                           "--allow-mixed-code"):
        build_table(load_rows([path]))
    assert main(["report", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mixes runs of 2 code versions" in err and "fix:" in err
    assert main(["report", path, "--allow-mixed-code"]) == 0
    out = capsys.readouterr().out
    assert ("code: 2 commits (aaaaaaa ×3, bbbbbbb ×2); 2 of 5 runs from a dirty tree (uncommitted changes); "
            "MIXED code, shown because of --allow-mixed-code") in out
    # narrowing the table to one commit's runs needs no flag
    assert "code: 1 commit (aaaaaaa ×1); no dirty runs" in markdown(build_table(load_rows([path]),
                                                                                   where="seed=0"))


def test_one_commit_is_accepted_and_said_so(tmp_path):
    path = store_of(tmp_path / "results.sqlite", [{"code": code(SHA_A, dirty=True), "git_commit": SHA_A + "+dirty"},
                                                  {"code": code(SHA_A)}, {"git_commit": SHA_A}])
    md = markdown(build_table(load_rows([path])))
    assert "code: 1 commit (aaaaaaa ×3); 1 of 3 runs from a dirty tree (uncommitted changes)" in md


def test_runs_without_a_commit_are_grouped_by_source_digest_else_unknown(tmp_path):
    same = [{"code": code(None, None, "e" * 64)}] * 2
    md = markdown(build_table(load_rows([store_of(tmp_path / "a.sqlite", same)])))
    assert "code: 1 source digest without a commit (source eeeeeeeeeeee ×2); no dirty runs" in md
    mixed = same + [{}]  # a run that recorded no code at all
    with pytest.raises(PeftlabError, match=r"2 code versions \(source eeeeeeeeeeee ×2, unknown ×1\)"):
        build_table(load_rows([store_of(tmp_path / "b.sqlite", mixed)]))
    md = markdown(build_table(load_rows([tmp_path / "b.sqlite"]), allow_mixed_code=True))
    assert "1 run recording no code" in md
