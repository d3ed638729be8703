"""`peftlab report` statistics and inputs: --test welch|student against scipy, the Benjamini-Hochberg correction
over all the table's comparisons, p-values and differences in the md/latex cells, the majority-class row, run
folders as inputs and the --params conventions (Yao et al.'s), from synthetic results. (The paired tests, CIs,
TOST, Holm and power: test_report_paired.py.)"""

from __future__ import annotations

import csv
import io
import json
import statistics
from pathlib import Path

import pytest
import yaml
from scipy import stats

from _report_helpers import markdown, squash
from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.lab.records import load_rows
from peftlab.lab.report import build_table
from peftlab.lab.store import Store, config_key
from peftlab.lab.tables import format_p, render_csv, render_latex
from fake_results import checked  # noqa: E402 - tests/ is on sys.path

BASELINE = "method=lora,lr_ratio=1"
# (method, lr_ratio) -> task -> accuracy (MCC for CoLA) of seeds 0..4; unequal spreads, so Welch != Student
VALUES = {
    ("lora", 1.0): {"rte": [0.60, 0.62, 0.61, 0.63, 0.59], "mrpc": [0.80, 0.81, 0.79, 0.80, 0.82],
                    "cola": [0.40, 0.42, 0.41, 0.39, 0.43]},
    ("lora", 2.0): {"rte": [0.66, 0.70, 0.61, 0.72, 0.64], "mrpc": [0.81, 0.80, 0.83, 0.78, 0.84],
                    "cola": [0.44, 0.47, 0.38, 0.49, 0.45]},
    ("kasa", 2.0): {"rte": [0.69, 0.70, 0.68, 0.71, 0.69], "mrpc": [0.85, 0.86, 0.84, 0.87, 0.80],
                    "cola": [0.41, 0.43, 0.40, 0.42, 0.44]},
}
TASKS = ["cola", "mrpc", "rte"]  # the table's (GLUE) order
METRIC = {"rte": "accuracy", "mrpc": "accuracy", "cola": "matthews_correlation"}
MAJORITY = {"rte": 0.527, "mrpc": 0.684, "cola": 0.0}  # a fixed dev set: the same for every run
ROBERTA_LORA_QV = {"adapter": 294_912, "head": 592_130, "total": 294_912 + 592_130}  # Yao et al.: reads 1.48M
ROBERTA_FULL_QV = {"adapter": 14_174_208, "head": 592_130, "total": 14_174_208 + 592_130}  # reads 14.76M


def config(**overrides) -> dict:
    values = dict(model="tiny-bert", epochs=3, rank=8)
    values.update(overrides)
    return build_run_config(overrides=values).to_dict()


def result(cfg: dict, value: float, *, majority: float | None = None, params: dict | None = None) -> dict:
    metric = METRIC.get(cfg["task"], "accuracy")
    out = {"schema_version": 1, "status": "ok", "status_reason": None, "config": cfg, "primary_metric": metric,
           "best": {"epoch": 2, "metrics": {metric: value}}, "final": {"metrics": {metric: value}},
           "before": {"metrics": {metric: value}} if cfg["epochs"] == 0 else None,
           "trainable_params": params or {"adapter": 1000, "head": 600, "total": 1600},
           "majority_baseline": majority if majority is not None else MAJORITY[cfg["task"]]}
    return checked(out)


@pytest.fixture
def store_path(tmp_path) -> Path:
    path = tmp_path / "results.sqlite"
    with Store(path) as store:
        for (method, ratio), per_task in VALUES.items():
            for task, values in per_task.items():
                for seed, value in enumerate(values):  # inserted in seed order: the cells' order
                    cfg = config(task=task, method=method, lr_ratio=ratio, seed=seed)
                    store.add(cfg, result=result(cfg, value, majority=MAJORITY[task]))
        for task in TASKS:  # before fine-tuning (epochs 0), which also knows the majority class
            for seed in range(2):
                cfg = config(task=task, method="lora", epochs=0, seed=seed)
                store.add(cfg, result=result(cfg, 0.5 if task != "cola" else 0.0, majority=MAJORITY[task]))
    return path


def csv_rows(table) -> list[dict]:
    return list(csv.DictReader(io.StringIO(render_csv(table))))


def trained_lines(table) -> dict[tuple[str, str], dict]:
    return {(line["method"], line["lr_ratio"]): line for line in csv_rows(table)
            if line["method"] in ("lora", "kasa")}


# --------------------------------------------------------------------------- --test


@pytest.mark.parametrize("test, equal_var", [("student", True), ("welch", False)])
def test_p_values_equal_scipy_ttest_ind(store_path, test, equal_var):
    table = build_table(load_rows([store_path]), baseline=BASELINE, test=test)
    lines = trained_lines(table)
    base = VALUES[("lora", 1.0)]
    differs = 0
    for (method, ratio), per_task in VALUES.items():
        line = lines[(method, f"{ratio:g}")]
        for task in TASKS:
            if (method, ratio) == ("lora", 1.0):
                assert line[f"{task}_p"] == "" and line["baseline"] == "1"  # the baseline is not tested
                continue
            expected = stats.ttest_ind(per_task[task], base[task], equal_var=equal_var).pvalue
            assert float(line[f"{task}_p"]) == expected  # exactly scipy's
            other = stats.ttest_ind(per_task[task], base[task], equal_var=not equal_var).pvalue
            differs += float(line[f"{task}_p"]) != other
    assert differs >= 4  # the data tell the two tests apart
    name = {"student": "Student's t-test", "welch": "Welch's t-test"}[test]
    other_name = {"student": "Welch's t-test", "welch": "Student's t-test"}[test]
    md, tex = markdown(table), render_latex(table)
    assert name in md and other_name not in md
    assert f"equal_var={equal_var}" in md
    assert any(line.startswith("% ") and name in line for line in tex.splitlines())


def test_cli_test_and_correction_flags(store_path, tmp_path, capsys):
    out = tmp_path / "t.csv"
    assert main(["report", str(store_path), "--baseline", BASELINE, "--test", "student", "--correction", "none",
                 "--out", str(out)]) == 0
    line = next(r for r in csv.DictReader(io.StringIO(out.read_text())) if r["method"] == "kasa")
    assert float(line["rte_p"]) == stats.ttest_ind(VALUES[("kasa", 2.0)]["rte"], VALUES[("lora", 1.0)]["rte"],
                                                   equal_var=True).pvalue
    assert line["rte_p_adj"] == ""  # no correction asked for
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["report", str(store_path), "--test", "t"])
    assert "invalid choice: 't'" in capsys.readouterr().err
    with pytest.raises(PeftlabError, match="--test must be auto, paired, wilcoxon, welch, student, got 'pared'.*"
                                           "did you mean 'paired'"):
        build_table(load_rows([store_path]), test="pared")
    with pytest.raises(PeftlabError, match="--correction must be bh, holm, none"):
        build_table(load_rows([store_path]), correction="bonferroni")
    with pytest.raises(PeftlabError, match="--ci must be t or bootstrap"):
        build_table(load_rows([store_path]), ci="jackknife")


# --------------------------------------------------------------------------- --correction


def test_benjamini_hochberg_over_all_comparisons(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE, test="welch")  # bh is the default
    assert table.correction == "bh"
    lines = csv_rows(table)
    head = list(lines[0])
    for task in TASKS:
        assert head.index(f"{task}_p_adj") == head.index(f"{task}_p") + 1  # beside the raw p
    raw, adj = [], []
    for line in lines:  # table order: rows, then tasks
        for task in TASKS:
            if line[f"{task}_p"]:
                raw.append(float(line[f"{task}_p"]))
                adj.append(float(line[f"{task}_p_adj"]))
    assert len(raw) == 2 * 3  # two rows against the baseline, three tasks each
    assert adj == list(stats.false_discovery_control(raw, method="bh"))
    assert [row.cells[task].comparison.p for row, task in table.comparisons] == raw

    # the marks use the adjusted p: lora lr_ratio 2 on RTE (raw 0.045, adjusted 0.091) loses its dagger
    rows = {(r.label["method"], r.label["lr_ratio"]): r for r in table.rows if not r.reference}
    lora_rte, kasa_rte = rows[("lora", 2.0)].cells["rte"].comparison, rows[("kasa", 2.0)].cells["rte"].comparison
    assert lora_rte.p < 0.05 <= lora_rte.p_adj and not lora_rte.marked
    assert kasa_rte.p_adj < 0.05 and kasa_rte.marked
    raw_table = build_table(load_rows([store_path]), baseline=BASELINE, correction="none", test="welch")
    raw_rows = {(r.label["method"], r.label["lr_ratio"]): r for r in raw_table.rows if not r.reference}
    assert raw_rows[("lora", 2.0)].cells["rte"].comparison.marked
    assert raw_rows[("lora", 2.0)].cells["rte"].comparison.p_adj is None
    assert sum(r.cells[t].comparison.marked for r, t in raw_table.comparisons) > sum(
        r.cells[t].comparison.marked for r, t in table.comparisons)

    md, raw_md = markdown(table), markdown(raw_table)
    assert "† BH-adjusted p < 0.05 vs the baseline (method=lora,lr_ratio=1" in md
    assert "Benjamini-Hochberg (BH; false discovery rate, scipy.stats.false_discovery_control) over the 6 " \
           "comparisons in the table" in md
    assert "† p < 0.05 vs the baseline (method=lora,lr_ratio=1" in raw_md and "No multiple-comparison correction over the 6 comparisons" in raw_md
    assert "adj" not in raw_md


# --------------------------------------------------------------------------- p-values in the cells


def test_cells_show_p_values_and_the_baseline_row(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE, test="welch")
    md = markdown(table)
    lines = md.splitlines()

    def cell(values):
        return f"{statistics.fmean(values) * 100:.1f} ± {statistics.stdev(values) * 100:.1f} (5)"

    def delta(values, reference):  # Welch's difference of means and its 95 % t interval, from scipy
        low, high = stats.ttest_ind(values, reference, equal_var=False).confidence_interval(0.95)
        diff = statistics.fmean(values) - statistics.fmean(reference)
        return f"Δ {diff * 100:+.1f} (CI {low * 100:+.1f}, {high * 100:+.1f})"

    lora, kasa, base = VALUES[("lora", 2.0)], VALUES[("kasa", 2.0)], VALUES[("lora", 1.0)]
    lora_line = next(line for line in lines if line.startswith("| lora | 2 |"))
    # raw p < 0.05, but no dagger; an unpaired test names no pairs
    assert f"| {cell(lora['rte'])} {delta(lora['rte'], base['rte'])} p=0.045 (adj 0.091) |" in lora_line
    kasa_line = next(line for line in lines if line.startswith("| kasa | 2 |"))
    assert f"| {cell(kasa['rte'])}† {delta(kasa['rte'], base['rte'])} p<0.001 (adj <0.001) |" in kasa_line
    assert f"| {cell(kasa['mrpc'])} {delta(kasa['mrpc'], base['mrpc'])} p=0.026 (adj 0.078) |" in kasa_line
    assert "pairs" not in lora_line + kasa_line
    # the baseline row says so and carries neither dagger nor p
    base_line = next(line for line in lines if line.startswith("| lora (baseline) | 1 |"))
    avg = statistics.fmean(statistics.fmean(v) for v in base.values()) * 100
    assert base_line == (f"| lora (baseline) | 1 | {cell(base['cola'])} | {cell(base['mrpc'])} | "
                         f"{cell(base['rte'])} | {avg:.1f} | 1.6K |")
    assert 'its row reads "(baseline)"' in md
    raw_md = markdown(build_table(load_rows([store_path]), baseline=BASELINE, correction="none", test="welch"))
    assert f"| {cell(lora['rte'])}† {delta(lora['rte'], base['rte'])} p=0.045 |" in raw_md

    tex = render_latex(table)
    assert r"(5)$^\dagger$ $\Delta$ +8.4 (CI +6.4, +10.4) p$<$0.001 (adj $<$0.001)" in tex
    assert "p=0.045 (adj 0.091)" in tex and r"lora (baseline) & 1 &" in tex


def test_format_p():
    assert format_p(None) == "" and format_p(float("nan")) == "n/a"
    assert format_p(0.0123) == "0.012" and format_p(0.5) == "0.5" and format_p(0.0004) == "<0.001"
    # never rounded across alpha: 0.04996 would read 0.05 next to a dagger
    assert format_p(0.04996, 0.05) == "0.04996" and format_p(0.04996) == "0.05"
    assert format_p(0.00005, 0.0001) == "<0.0001" and format_p(0.0005, 0.0001) == "0.0005"


def test_constant_groups_are_flagged_and_nan_left_out_of_the_correction():
    def row(method, seed, value):
        cfg = config(task="rte", method=method, seed=seed, lr=1e-3, head_lr=1e-3)
        return {"key": f"{method}{seed}", "status": "ok", "config": cfg, "result": result(cfg, value)}

    rows = [row("lora", s, 0.5) for s in range(2)] + [row("kasa", s, 0.5) for s in range(2)]
    rows += [row("full", s, v) for s, v in enumerate([0.6, 0.7, 0.65])]
    table = build_table(rows, baseline="method=lora")
    cells = {r.label["method"]: r.cells["rte"].comparison for r in table.rows}
    assert cells["kasa"].p != cells["kasa"].p and cells["kasa"].p_adj is None  # nan: same constant
    assert cells["full"].p_adj == pytest.approx(cells["full"].p)  # one defined comparison: BH leaves it
    md = markdown(table)
    assert "50.0 ± 0.0 (2) Δ +0.0 (CI +0.0, +0.0) p=n/a, 2 pairs |" in md  # paired: the rows share seeds
    assert "1 comparison without any spread (of the paired differences)" in md
    assert "n/a left out of the correction" in md
    unpaired = markdown(build_table(rows, baseline="method=lora", test="welch"))
    assert "50.0 ± 0.0 (2) Δ +0.0 (CI +0.0, +0.0) p=n/a |" in unpaired
    assert "1 comparison without any spread (in either group)" in unpaired


# --------------------------------------------------------------------------- the majority-class row


def test_majority_class_row(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE)
    names = [r.name for r in table.display_rows if r.reference]
    assert names == ["before fine-tuning", "majority class"]  # after the before-fine-tuning row
    majority = table.majority
    assert table.display_rows.index(majority) == 1 and not majority.before
    assert majority not in table.rows  # not a group of runs: table.rows stays the runs' groups
    assert majority.cells["rte"].values == [MAJORITY["rte"]] * (3 * 5 + 2)
    md = markdown(table)
    avg = statistics.fmean(MAJORITY.values()) * 100
    assert f"| majority class |  | 0.0 | 68.4 | 52.7 | {avg:.1f} | – |" in md  # CoLA's MCC: 0
    assert "majority class: always predicting the dev set's most frequent class" in md
    assert "the runs' dev sets differ" not in md  # the runs agree
    line = next(r for r in csv_rows(table) if r["method"] == "majority class")
    assert line["before_fine_tuning"] == "0" and line["baseline"] == "0" and line["lr_ratio"] == ""
    assert float(line["mrpc_mean"]) == pytest.approx(68.4) and float(line["cola_mean"]) == 0.0
    assert float(line["rte_std"]) == 0.0 and line["rte_p"] == "" and line["params_total"] == ""
    assert line["rte_n"] == str(3 * 5 + 2)  # every run of the task that reports it
    tex = render_latex(table)
    assert r"majority class &  & 0.0 & 68.4 & 52.7" in tex
    assert tex.count(r"\midrule") == 2  # after the header and after the reference rows


def test_majority_class_runs_that_disagree_and_tasks_without_one():
    def row(task, seed, majority, *, metric_value=0.7):
        cfg = config(task=task, method="lora", seed=seed, model="tiny-llama" if task == "gsm8k" else "tiny-bert")
        return {"key": f"{task}{seed}", "status": "ok", "config": cfg,
                "result": result(cfg, metric_value, majority=majority)}

    rows = [row("rte", 0, 0.52), row("rte", 1, 0.53), row("gsm8k", 0, 0.0), row("gsm8k", 1, 0.0)]
    table = build_table(rows)
    md = markdown(table)
    assert "| majority class | 52.5 (52.0–53.0) | – | – | – |" in md  # gsm8k has no classes: –, not 0.0
    assert "the runs' dev sets differ" in md and "rte 52–53" in md
    # a metric other than the primary one has no majority-class score; instruction tasks alone: no row
    for r in rows:
        r["result"]["best"]["metrics"]["f1"] = 0.6
    assert build_table(rows, metric="f1").majority is None
    assert build_table(rows[2:]).majority is None


# --------------------------------------------------------------------------- run folders


def write_run(folder: Path, cfg: dict, value: float, *, status: str = "ok") -> Path:
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps(checked({
        "status": status, "primary_metric": "accuracy", "config": cfg, "majority_baseline": 0.527,
        "best": {"epoch": 3, "metrics": {"accuracy": value}}, "final": {"metrics": {"accuracy": value}},
        "trainable_params": {"adapter": 1000, "head": 600, "total": 1600}})))
    return folder


def test_run_folders_as_inputs(tmp_path, capsys):
    lora = config(task="rte", method="lora", seed=0, lr_ratio=1.0)
    kasa = dict(lora, method="kasa")
    a = write_run(tmp_path / "runs" / "a", lora, 0.61)
    b = write_run(tmp_path / "runs" / "b", kasa, 0.66)
    rows = load_rows([a, str(b) + "/"])  # a shell glob like runs/*/ passes folders with a slash
    assert [r["key"] for r in rows] == [config_key(lora), config_key(kasa)]
    assert rows[0]["status"] == "ok" and rows[0]["config"] == lora and rows[0]["output_dir"] == str(a)
    assert main(["report", str(a), str(b) + "/"]) == 0
    out = squash(capsys.readouterr().out)
    assert "| method | RTE | Avg | #Param |" in out
    assert "| lora | 61.0 (1) | 61.0 | 1.6K |" in out and "| kasa | 66.0 (1) | 66.0 | 1.6K |" in out
    assert "| majority class | 52.7 | 52.7 | – |" in out

    # a started, unfinished run (config.yaml only) is counted, not averaged; a failed one is counted in its cell
    started = tmp_path / "runs" / "c"
    started.mkdir()
    (started / "config.yaml").write_text(yaml.safe_dump(dict(lora, seed=1)))
    failed = write_run(tmp_path / "runs" / "d", dict(kasa, seed=1), 0.0, status="failed")
    table = build_table(load_rows([a, b, started, failed]))
    assert "not in the table (unfinished): 1 running" in table.notes
    assert "66.0 (1) [left out: 1 failed]" in markdown(table)

    # a store and a run folder together; the same run twice counts once
    store = tmp_path / "sweep" / "results.sqlite"
    with Store(store) as s:
        s.add(dict(lora, seed=2), result=result(dict(lora, seed=2), 0.63, majority=0.527))
        s.add(lora, result=json.loads((a / "result.json").read_text()))
    table = build_table(load_rows([store.parent, a, b]))
    lora_row = next(r for r in table.rows if r.label.get("method") == "lora")
    assert sorted(lora_row.cells["rte"].values) == [0.61, 0.63]


def test_run_folder_errors(tmp_path, capsys):
    empty = tmp_path / "logs"
    empty.mkdir()
    assert main(["report", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is neither a results store nor a run folder" in err and str(empty) in err
    assert "fix: pass a sweep's results.sqlite" in err and "result.json" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "result.json").write_text("{not json")
    with pytest.raises(PeftlabError, match=r"cannot read .*broken/result.json.*fix:"):
        load_rows([broken])
    odd = tmp_path / "odd"  # a status no peftlab writes: a record the schema refuses, read by hand
    odd.mkdir()
    (odd / "result.json").write_text(json.dumps({"status": "weird", "config": {"task": "rte", "method": "lora"}}))
    with pytest.raises(PeftlabError, match="has status 'weird'"):
        load_rows([odd])
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "result.json").write_text(json.dumps({"status": "ok"}))
    with pytest.raises(PeftlabError, match="no run config in"):
        load_rows([no_config])
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "results store not found" in capsys.readouterr().err


# --------------------------------------------------------------------------- --params


def params_rows() -> list[dict]:
    rows = []
    for method, trainable in (("lora", ROBERTA_LORA_QV), ("full", ROBERTA_FULL_QV)):
        cfg = config(model="roberta-base", task="rte", method=method, targets="q,v", seed=0, lr=1e-3, head_lr=1e-3)
        rows.append({"key": method, "status": "ok", "config": cfg, "result": result(cfg, 0.7, params=trainable)})
    return rows


@pytest.mark.parametrize("convention, lora, full, note", [
    ("yao", "1.48M", "14.8M", "Yao et al.'s convention (--params yao): adapter + 2 × classification head"),
    ("total", "887K", "14.8M", "all trainable parameters, the classification head included once"),
    ("adapter", "295K", "14.2M", "the adapter's trainable parameters only, the classification head left out"),
])
def test_params_conventions(convention, lora, full, note):
    table = build_table(params_rows(), params=convention)
    md = markdown(table)
    assert f"| lora | 70.0 (1) | 70.0 | {lora} |" in md
    assert f"| full | 70.0 (1) | 70.0 | {full} |" in md
    assert note in md and f"--params {convention}" in render_latex(table)
    by_method = {r["method"]: r for r in csv_rows(table)}
    if convention == "yao":
        assert by_method["lora"]["params_yao"] == str(294_912 + 2 * 592_130)  # 1,479,172
        assert by_method["full"]["params_yao"] == str(ROBERTA_FULL_QV["total"])  # full FT: the total
    with pytest.raises(PeftlabError, match="--params must be total, adapter, yao"):
        build_table(params_rows(), params="head")


def test_a_glue_subset_task_is_labelled_in_the_header_and_notes(tmp_path):
    path = tmp_path / "results.sqlite"
    with Store(path) as store:
        for seed in range(2):
            cfg = build_run_config(overrides=dict(model="tiny-bert", task="qqp", seed=seed)).to_dict()
            result = {"schema_version": 1, "status": "ok", "status_reason": None, "task": "qqp", "config": cfg,
                      "primary_metric": "accuracy", "best": {"epoch": 1, "metrics": {"accuracy": 0.7 + seed / 100}},
                      "final": {"metrics": {"accuracy": 0.7}}, "dataset": "glue_subsets", "majority_baseline": 0.6,
                      "trainable_params": {"adapter": 10, "head": 2, "total": 12}}
            store.add(cfg, result=result)
    md = markdown(build_table(load_rows([path])))
    assert "| QQP (glue_subsets) |" in md
    assert "qqp: dataset glue_subsets (10k subsets of GLUE train, 90/10 train/dev; not the full task)" in md
