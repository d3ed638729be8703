"""`peftlab report`: grouping, mean ± sample std, Welch's t-test against scipy, labelled runs (collapsed, diverged)
averaged in at their value and counted, crashed runs left out, the before-fine-tuning row, and the md/latex/csv
renderings, from a store of synthetic results."""

from __future__ import annotations

import csv
import io
import statistics
import warnings
from collections import Counter
from pathlib import Path

import pytest
from scipy import stats

from _report_helpers import markdown, squash
from fake_results import checked
from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.lab.records import load_rows, parse_filter
from peftlab.lab.report import build_table
from peftlab.lab.store import Store
from peftlab.lab.table_model import Cell
from peftlab.lab.tables import format_cell, render_csv, render_latex

# (method, targets, lr_ratio) -> task -> per-seed accuracies
VALUES = {
    ("lora", "q,k,v", 1.0): {"rte": [0.60, 0.62, 0.61], "mrpc": [0.80, 0.81, 0.79]},
    ("lora", "q,v", 4.0): {"rte": [0.68, 0.70, 0.69], "mrpc": [0.81, 0.80, 0.83]},
    ("kasa", "q,v", 4.0): {"rte": [0.64, 0.66, 0.70], "mrpc": [0.84, 0.86, 0.85]},
}
PER_TASK_SAMPLES = {"rte": 500, "mrpc": 400}  # a per-task setting (zipped with the task): not a row key
# runs that finished labelled: in their cell at their value, beside the ok runs of VALUES
LABELLED = {(("kasa", "q,v", 4.0), "rte"): [0.47], (("lora", "q,v", 4.0), "mrpc"): [0.31]}


def finished(key: tuple, task: str) -> list[float]:
    """Every finished run's value of a cell: the ok runs, then the labelled ones."""
    return VALUES[key][task] + LABELLED.get((key, task), [])


def config(**overrides) -> dict:
    values = dict(model="tiny-bert", epochs=3, rank=8, max_train_samples=PER_TASK_SAMPLES[overrides["task"]])
    values.update(overrides)
    return build_run_config(overrides=values).to_dict()


MAJORITY = {"rte": 0.527, "mrpc": 0.684}  # the GLUE dev sets' most frequent class


def result(cfg: dict, accuracy: float, *, status: str = "ok", final: float | None = None) -> dict:
    adapter = 1000 if cfg["method"] == "lora" else 1016
    before = {"metrics": {"accuracy": accuracy}} if cfg["epochs"] == 0 else None
    return checked({"schema_version": 1, "status": status, "status_reason": None if status == "ok" else f"{status} at 2",
            "task": cfg["task"], "method": cfg["method"], "seed": cfg["seed"], "config": cfg,
            "majority_baseline": MAJORITY[cfg["task"]],
            "primary_metric": "accuracy", "best": {"epoch": 2, "metrics": {"accuracy": accuracy, "f1": 0.5}},
            "final": {"metrics": {"accuracy": accuracy if final is None else final}}, "before": before,
            "trainable_params": {"adapter": adapter, "head": 600 if cfg["task"] == "rte" else 602,
                                 "total": adapter + (600 if cfg["task"] == "rte" else 602)}})


@pytest.fixture
def store_path(tmp_path) -> Path:
    path = tmp_path / "results.sqlite"
    with Store(path) as store:
        for (method, targets, ratio), per_task in VALUES.items():
            for task, accs in per_task.items():
                for seed, acc in enumerate(accs):
                    cfg = config(task=task, method=method, targets=targets, lr_ratio=ratio, seed=seed)
                    store.add(cfg, result=result(cfg, acc, final=acc - 0.01))
        # labelled, so averaged in at their value: a collapsed kasa run on RTE, a diverged lora q,v run on MRPC;
        # crashed, so left out: a failed kasa run on RTE
        cfg = config(task="rte", method="kasa", targets="q,v", lr_ratio=4.0, seed=3)
        store.add(cfg, result=result(cfg, 0.47, status="collapsed"))
        store.add(config(task="rte", method="kasa", targets="q,v", lr_ratio=4.0, seed=4), status="failed",
                  error="RuntimeError: out of memory")
        cfg = config(task="mrpc", method="lora", targets="q,v", lr_ratio=4.0, seed=3)
        store.add(cfg, result=result(cfg, 0.31, status="diverged"))
        # a config whose only RTE runs collapsed
        for seed in range(2):
            cfg = config(task="rte", method="lora", targets="q,v", lr_ratio=8.0, seed=seed)
            store.add(cfg, result=result(cfg, 0.47, status="collapsed"))
        # before fine-tuning: epochs 0 (twice per seed on RTE, as a training grid would repeat it)
        for task, accs in {"rte": [0.52, 0.48], "mrpc": [0.68, 0.70]}.items():
            for seed, acc in enumerate(accs):
                for lr in (1e-4, 2e-4) if task == "rte" else (1e-4,):
                    cfg = config(task=task, method="lora", epochs=0, seed=seed, lr=lr)
                    store.add(cfg, result=result(cfg, acc))
        # unfinished rows are left out (and said so)
        store.register([("f" * 64, config(task="rte", method="lora", seed=9), "runs/x")])
    return path


def rows_by_label(table):
    return {(r.label.get("method"), r.label.get("targets"), r.label.get("lr_ratio")): r for r in table.rows
            if not r.before}


def test_cells_are_mean_sample_std_and_n_over_seeds(store_path):
    table = build_table(load_rows([store_path]))
    assert table.tasks == ["mrpc", "rte"]  # GLUE order
    assert table.label_keys == ["method", "targets", "lr_ratio"]  # only keys that vary; not max_train_samples
    rows = rows_by_label(table)
    assert len(rows) == 4
    for key, per_task in VALUES.items():
        for task in per_task:
            cell, accs = rows[key].cells[task], finished(key, task)
            assert cell.mean == pytest.approx(statistics.fmean(accs))
            assert cell.std == pytest.approx(statistics.stdev(accs))  # ddof = 1
            assert cell.std == pytest.approx(float(__import__("numpy").std(accs, ddof=1)))
            assert cell.n == len(accs)
    base = rows[("lora", "q,k,v", 1.0)]
    assert base.avg(table.tasks) == pytest.approx(statistics.fmean([statistics.fmean(a) for a in VALUES[
        ("lora", "q,k,v", 1.0)].values()]))
    assert base.params == {1600, 1602}
    assert any("per-task settings: max_train_samples mrpc=400, rte=500" in note for note in table.notes)
    assert any("1 pending" in note for note in table.notes)


def test_labelled_runs_are_averaged_in_and_counted_crashed_runs_left_out(store_path):
    table = build_table(load_rows([store_path]))
    rows = rows_by_label(table)
    kasa_rte = rows[("kasa", "q,v", 4.0)].cells["rte"]
    assert kasa_rte.values == pytest.approx([0.64, 0.66, 0.70, 0.47])  # the collapsed run at its value
    assert kasa_rte.statuses == ["ok", "ok", "ok", "collapsed"] and kasa_rte.seeds == [0, 1, 2, 3]
    assert dict(kasa_rte.labels) == {"collapsed": 1} and dict(kasa_rte.excluded) == {"failed": 1}
    values = [0.64, 0.66, 0.70, 0.47]
    # the label counted, the median and range of the cell beside its mean, the crash (no value) left out
    assert format_cell(kasa_rte, 100, 1) == (
        f"{statistics.fmean(values) * 100:.1f} ± {statistics.stdev(values) * 100:.1f} (4) [1 collapsed; median 65.0, "
        "range 47.0–70.0; left out: 1 failed]")
    lora_mrpc = rows[("lora", "q,v", 4.0)].cells["mrpc"]
    assert format_cell(lora_mrpc, 100, 1).endswith("(4) [1 diverged; median 80.5, range 31.0–83.0]")
    only_collapsed = rows[("lora", "q,v", 8.0)]
    assert format_cell(only_collapsed.cells["rte"], 100, 1) == \
        "47.0 ± 0.0 (2) [2 collapsed; median 47.0, range 47.0–47.0]"
    assert "mrpc" not in only_collapsed.cells and only_collapsed.avg(table.tasks) is None
    # a crash or a pruned trial did not finish: left out, without a distribution (no labelled run is averaged in)
    crashed = Cell(values=[0.60, 0.62], seeds=[0, 1], excluded=Counter(failed=1, pruned=1))
    assert format_cell(crashed, 100, 1) == "61.0 ± 1.4 (2) [left out: 1 failed, 1 pruned]"
    # a labelled run without a value (diverged before its first evaluation): counted under its label, unpaired
    cell = Cell()
    for seed, status, value in ((0, "ok", 0.60), (1, "ok", 0.62), (2, "diverged", None), (3, "ok", float("nan"))):
        cell.add_run(status, seed, value)
    assert cell.seeds == [0, 1] and dict(cell.no_value) == {"diverged": 1}
    assert format_cell(cell, 100, 1) == "61.0 ± 1.4 (2) [1 diverged (1 no value); left out: 1 missing metric]"
    assert format_cell(Cell(no_value=Counter(diverged=2)), 100, 1) == "2 diverged (2 no value)"


def test_before_fine_tuning_row(store_path):
    table = build_table(load_rows([store_path]))
    before = [r for r in table.rows if r.before]
    assert len(before) == 1 and table.rows[0] is before[0]  # first row
    assert before[0].name == "before fine-tuning"
    # the untrained model repeated for two learning rates counts once per seed
    assert before[0].cells["rte"].values == pytest.approx([0.52, 0.48])
    assert before[0].cells["mrpc"].values == pytest.approx([0.68, 0.70])
    md = markdown(table).splitlines()
    assert md[2].startswith("| before fine-tuning |  |  | 69.0 ± 1.4 (2) | 50.0 ± 2.8 (2) | 59.5 | – |")


def test_welch_t_test_against_scipy(store_path):
    table = build_table(load_rows([store_path]), baseline="method=lora,targets=q,k,v,lr_ratio=1", test="welch")
    rows = rows_by_label(table)
    base = VALUES[("lora", "q,k,v", 1.0)]
    marked = {}
    for key in [("lora", "q,v", 4.0), ("kasa", "q,v", 4.0)]:
        for task in ("rte", "mrpc"):  # the labelled runs in, at their value
            expected = stats.ttest_ind(finished(key, task), base[task], equal_var=False).pvalue
            cell = rows[key].cells[task]
            assert cell.comparison.p == pytest.approx(expected, rel=1e-12)
            assert cell.comparison.marked == (expected < 0.05)
            marked[(key, task)] = cell.comparison.marked
    assert any(marked.values()) and not all(marked.values())  # the inputs give both outcomes
    assert rows[("lora", "q,k,v", 1.0)].cells["rte"].comparison is None  # the baseline itself
    with warnings.catch_warnings():  # scipy warns about the constant group, as the report's footnote would say
        warnings.simplefilter("ignore")
        collapsed_p = stats.ttest_ind([0.47, 0.47], base["rte"], equal_var=False).pvalue
    assert rows[("lora", "q,v", 8.0)].cells["rte"].comparison.p == pytest.approx(collapsed_p, rel=1e-12)  # at their value
    # a stricter alpha marks fewer cells
    strict = build_table(load_rows([store_path]), baseline="method=lora,targets=q,k,v,lr_ratio=1", alpha=0.001,
                         test="welch")
    assert sum(r.cells[t].comparison.marked for r, t in strict.comparisons) < sum(marked.values())
    # the CSV carries the p-values
    lines = list(csv.DictReader(io.StringIO(render_csv(table))))
    kasa = next(line for line in lines if line["method"] == "kasa")
    assert float(kasa["rte_p"]) == pytest.approx(
        stats.ttest_ind(finished(("kasa", "q,v", 4.0), "rte"), base["rte"], equal_var=False).pvalue, rel=1e-12)
    assert kasa["rte_labels"] == "1 collapsed" and kasa["rte_excluded"] == "1 failed" and kasa["rte_n"] == "4"
    # unpaired, the labelled runs count wherever they are: the sensitivity is the test without them
    assert float(kasa["rte_p_without_labels"]) == pytest.approx(
        stats.ttest_ind(VALUES[("kasa", "q,v", 4.0)]["rte"], base["rte"], equal_var=False).pvalue, rel=1e-12)
    assert [line["baseline"] for line in lines].count("1") == 1


def test_which_final_and_params_adapter(store_path):
    best = build_table(load_rows([store_path]))
    final = build_table(load_rows([store_path]), which="final", params="adapter")
    key = ("kasa", "q,v", 4.0)
    assert rows_by_label(final)[key].cells["mrpc"].mean == pytest.approx(
        rows_by_label(best)[key].cells["mrpc"].mean - 0.01)
    assert rows_by_label(final)[key].params == {1016}
    assert build_table(load_rows([store_path]), metric="f1").rows[1].cells["rte"].mean == pytest.approx(0.5)


def test_where_filter_keeps_the_before_row(store_path):
    table = build_table(load_rows([store_path]), where="lr_ratio=4,targets=q,v")
    assert [r.name if r.before else r.label["method"] for r in table.rows] == ["before fine-tuning", "lora", "kasa"]
    assert table.label_keys == ["method"]


def test_renderings(store_path):
    table = build_table(load_rows([store_path]), baseline="method=lora,targets=q,k,v,lr_ratio=1")
    md = markdown(table)
    lines = md.splitlines()
    assert lines[0] == "| method | targets | lr_ratio | MRPC | RTE | Avg | #Param |"
    assert lines[1] == "|---|---|---|---|---|---|---|"
    assert len([line for line in lines if line.startswith("| ")]) == 1 + 5 + 1  # and the majority-class row
    assert "| majority class |  |  | 68.4 | 52.7 | 60.6 | – |" in md
    assert "| lora (baseline) | q,k,v | 1 | 80.0 ± 1.0 (3) | 61.0 ± 1.0 (3) | 70.5 | 1.6K |" in md
    assert "† BH-adjusted p < 0.05 vs the baseline" in md and "mean ± sample std" in md
    assert "84.0 ± 1.0 (3)†" not in md  # kasa mrpc is 85.0 ± 1.0
    assert "85.0 ± 1.0 (3)†" in md

    tex = render_latex(table)
    assert r"\begin{tabular}{lllcccc}" in tex and r"\toprule" in tex and r"\bottomrule" in tex
    assert r"method & targets & lr\_ratio & MRPC & RTE & Avg & \#Param \\" in tex
    assert r"85.0 $\pm$ 1.0 (3)$^\dagger$" in tex
    # paired with the baseline's seeds 0-2, kasa's collapsed seed 3 is in no pair: no comparison without it
    assert r"[1 collapsed; median 65.0, range 47.0--70.0; left out: 1 failed]" in tex
    assert "±" not in tex.split(r"\begin{tabular}")[1]
    assert tex.count(r"\midrule") == 2  # after the header and after the before-fine-tuning row

    rows = list(csv.reader(io.StringIO(render_csv(table))))
    assert rows[0][:4] == ["method", "targets", "lr_ratio", "before_fine_tuning"]
    assert "mrpc_mean" in rows[0] and "rte_p" in rows[0] and rows[0][-2:] == ["params_total", "baseline"]
    assert len(rows) == 1 + 5 + 1
    by_method = {tuple(r[:3]): dict(zip(rows[0], r)) for r in rows[1:]}
    lora = by_method[("lora", "q,k,v", "1")]
    assert float(lora["rte_mean"]) == pytest.approx(61.0) and float(lora["rte_std"]) == pytest.approx(1.0)
    assert lora["rte_n"] == "3" and lora["params_total"] == "1602"


def test_baseline_and_filter_errors(store_path):
    rows = load_rows([store_path])
    with pytest.raises(PeftlabError, match="matches 3 rows of the table, not 1"):
        build_table(rows, baseline="method=lora")
    with pytest.raises(PeftlabError, match="matches 0 rows"):
        build_table(rows, baseline="method=dora")
    with pytest.raises(PeftlabError, match="unknown config key 'lr_rato'.*did you mean 'lr_ratio'"):
        build_table(rows, baseline="lr_rato=1")
    with pytest.raises(PeftlabError, match="no finished runs to report"):
        build_table(rows, where="method=vera")
    assert parse_filter("method=lora,targets=v,q,lr_ratio=2") == {"method": "lora", "targets": "q,v", "lr_ratio": 2.0}


def test_cli_writes_each_format(store_path, tmp_path, capsys):
    for suffix, marker in ((".md", "| method |"), (".tex", r"\begin{tabular}"), (".csv", "method,targets")):
        out = tmp_path / f"table{suffix}"
        assert main(["report", str(store_path), "--out", str(out), "--baseline",
                     "method=lora,targets=q,k,v,lr_ratio=1"]) == 0
        assert marker in squash(out.read_text())
    assert main(["report", str(store_path.parent), "--format", "md", "--digits", "2"]) == 0  # a sweep folder works
    assert "80.00 ± 1.00 (3)" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing.sqlite")]) == 2
    assert "results store not found" in capsys.readouterr().err
    (tmp_path / "junk.sqlite").write_text("not a database")
    assert main(["report", str(tmp_path / "junk.sqlite")]) == 2
    assert "junk.sqlite" in capsys.readouterr().err


def test_methods_keep_the_order_the_runs_list_them():
    """The table needs no method code: rows follow the order the runs name their methods (a sweep's grid order)."""
    def row(method, seed):
        cfg = config(task="rte", method=method, seed=seed, targets="q,v")
        return {"key": f"{method}{seed}", "status": "ok", "config": cfg, "result": result(cfg, 0.6 + seed / 100)}

    rows = [row(m, s) for m in ("vera", "kasa", "lora") for s in range(2)]
    assert [r.label["method"] for r in build_table(rows).rows] == ["vera", "kasa", "lora"]
    assert [r.label["method"] for r in build_table(rows[::-1]).rows] == ["lora", "kasa", "vera"]
    # --where on targets is a projection set: order and case do not matter
    assert len(build_table(rows, where="targets=V,q").rows) == 3


def test_pruned_tune_trials_are_counted_not_averaged(store_path):
    """A `peftlab tune` trial stopped after epoch 1 (result.json stopped_early) is not a full run: counted, not
    averaged into the cell."""
    with Store(store_path) as store:
        cfg = config(task="mrpc", method="lora", targets="q,k,v", lr_ratio=1.0, seed=7)
        pruned = result(cfg, 0.99)
        pruned["stopped_early"] = {"epoch": 1, "reason": "pruned by ASHA"}
        store.add(cfg, result=pruned)
    cell = rows_by_label(build_table(load_rows([store_path])))[("lora", "q,k,v", 1.0)].cells["mrpc"]
    assert cell.values == pytest.approx([0.80, 0.81, 0.79]) and dict(cell.excluded) == {"pruned": 1}
    assert format_cell(cell, 100, 1).endswith("(3) [left out: 1 pruned]")


def test_runs_scored_on_different_test_examples_are_refused(store_path, tmp_path):
    rows = load_rows([store_path])
    assert build_table(rows).rows  # no digest recorded: nothing to compare them by
    for i, row in enumerate(rows):
        if row.get("result"):
            row["result"]["eval_examples_digest"] = "a" * 16
    assert build_table(rows).rows  # one test set per task
    moved = next(r for r in rows if r.get("result") and r["result"]["task"] == "mrpc")
    moved["result"]["eval_examples_digest"] = "b" * 16
    with pytest.raises(PeftlabError, match="mrpc runs were scored on different test examples"):
        build_table(rows)


def test_a_metric_no_run_has_is_one_line_not_a_table_of_left_out_runs(capsys):
    from peftlab.cli.main import main

    store = Path(__file__).resolve().parents[1] / "docs" / "study" / "kasa" / "results.sqlite"
    assert main(["report", str(store), "--metric", "pearsn"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "--metric pearsn: no finished run has it" in err and "pearson" in err
    assert main(["report", str(store), "--metric", "spearman"]) == 0
