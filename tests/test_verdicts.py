"""A study's comparisons keep every finished run (a no_learning seed is paired at its value, its label counted, and
the comparison is shown again without it), and REPORT.md's sentences are written from verdicts.json's data by
:mod:`peftlab.lab.verdicts`: a number changed in the data changes the sentence, and the report's lines are what
the written verdicts.json renders to. The stores are built here from fake result.json records (no training)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fake_results import checked
from peftlab.lab import verdicts as vt
from peftlab.lab.store import Store
from peftlab.lab.study_plan import StudyPaths
from peftlab.lab.table_model import Cell
from peftlab.resolve import build_run_config
from studies.fixed_rate import design as sd
from studies.fixed_rate.arms import Arm, describe_arm
from studies.fixed_rate.report import Slot, sensitivity_verdict, write_report

BASE = {"model": "tiny-bert", "method": "lora", "targets": "q,v", "epochs": 2, "max_train_samples": 64,
        "report_to": "none"}
SEEDS = [100, 101, 102, 103, 104]
SEED_EFFECT = dict(zip(SEEDS, (0.00, 0.02, -0.01, 0.03, 0.01)))  # moves every row together: what pairing sees
LEVEL = {"head": 0.60, "lora": 0.70, "kasa": 0.69}
NOISE = {"head": (0, 3, 1, 4, 2), "lora": (2, 0, 4, 1, 3), "kasa": (1, 4, 0, 2, 3)}  # spread in the differences
NO_LEARNING = {("head", 101): 0.41, ("head", 103): 0.44}  # the head never learns on two seeds: at chance, labelled


def value(row: str, seed: int) -> float:
    if (row, seed) in NO_LEARNING:
        return NO_LEARNING[(row, seed)]
    return round(LEVEL[row] + SEED_EFFECT[seed] + 0.004 * NOISE[row][SEEDS.index(seed)], 6)


def fake_result(cfg: dict, accuracy: float, status: str) -> dict:
    return checked({"schema_version": 1, "status": status, "status_reason": None if status == "ok" else f"{status}: x",
                    "config": cfg, "primary_metric": "accuracy", "majority_baseline": 0.527,
                    "best": {"epoch": 2, "metrics": {"accuracy": accuracy}}, "final": {"metrics": {"accuracy": accuracy}},
                    "before": {"metrics": {"accuracy": 0.5}} if cfg["epochs"] == 0 else None,
                    "trainable_params": {"adapter": 10, "head": 2, "total": 12},
                    "code": {"commit": "f" * 40, "dirty": False, "version": "0", "source_digest": "d" * 64}})


def kasa_design() -> sd.Design:
    return sd.Design("kasa", tasks=("rte",), base=dict(BASE), selection_seeds=0, heldout_seeds=len(SEEDS),
                     heldout_seed_start=SEEDS[0], plateau_epochs=0, plateau_seeds=0, rows=("head", "lora", "kasa"))


def row_name(config: dict) -> str:
    return "head" if config["method"] == "head" else config["method"]


@pytest.fixture
def kasa_study(tmp_path) -> Path:
    """A KaSA study's store (head, LoRA, KaSA, before fine-tuning on 5 seeds), then its report."""
    design, root = kasa_design(), tmp_path / "kasa"
    paths = StudyPaths(root, root / "results.sqlite")
    root.mkdir()
    with Store(paths.store) as store:
        for overrides in sd.kasa_configs(design, "rte"):
            cfg = build_run_config(overrides=overrides).to_dict()
            if cfg["epochs"] == 0:
                store.add(cfg, result=fake_result(cfg, 0.5, "ok"))
                continue
            name = row_name(cfg)
            status = "no_learning" if (name, cfg["seed"]) in NO_LEARNING else "ok"
            store.add(cfg, result=fake_result(cfg, value(name, cfg["seed"]), status))
    write_report(paths, design)
    return root


def report_lines(root: Path) -> list[str]:
    return (root / "REPORT.md").read_text().splitlines()


# --------------------------------------------------------------------------- nothing dropped for its outcome


def test_a_no_learning_seed_is_paired_at_its_value(kasa_study):
    data = json.loads((kasa_study / "verdicts.json").read_text())["tasks"]["rte"]["comparisons"]
    versus_head = data["kasa − head"]
    assert versus_head["n_pairs"] == len(SEEDS)  # every seed both arms finished, the head's two no_learning too
    differences = [value("kasa", s) - value("head", s) for s in SEEDS]
    assert versus_head["diff"] == pytest.approx(100 * np.mean(differences))
    assert versus_head["p"] == pytest.approx(stats.ttest_rel([value("kasa", s) for s in SEEDS],
                                                             [value("head", s) for s in SEEDS]).pvalue, rel=1e-9)
    assert versus_head["labels"] == {"a": {}, "b": {"no_learning": 2}}
    # the sensitivity: the same paired test on the three seeds the head learned on
    learned = [s for s in SEEDS if ("head", s) not in NO_LEARNING]
    without = versus_head["without_labels"]
    assert without["n_pairs"] == 3
    assert without["p"] == pytest.approx(stats.ttest_rel([value("kasa", s) for s in learned],
                                                         [value("head", s) for s in learned]).pvalue, rel=1e-9)
    assert data["kasa − lora"]["without_labels"] is None  # no labelled run in it: nothing to restate


def test_the_labels_are_shown_beside_the_arm_and_the_comparison(kasa_study):
    lines = report_lines(kasa_study)
    head = [line for line in lines if line.startswith("| head |")]
    values = [value("head", s) * 100 for s in SEEDS]
    assert head == [f"| head | {np.mean(values):.1f} ± {np.std(values, ddof=1):.1f} (n=5; 2 no_learning; median "
                    f"{np.median(values):.1f}, range {min(values):.1f}–{max(values):.1f}) |"]
    versus_head = next(line for line in lines if line.startswith("- kasa − head: "))
    assert versus_head.endswith("; labelled runs, paired at their value: head 2 no_learning")
    assert "on 5 pairs" in versus_head
    assert "  - without the labelled runs: " in lines[lines.index(versus_head) + 1]


def test_describe_arm_gives_the_median_of_an_even_count():
    cell = Cell(values=[0.01, 0.02, 0.03, 0.10], seeds=[0, 1, 2, 3], statuses=["no_learning", "ok", "ok", "ok"])
    assert describe_arm(Arm("a", cell, 0), 100) == "4.0 ± 4.1 (n=4; 1 no_learning; median 2.5, range 1.0–10.0)"


# --------------------------------------------------------------------------- sentences from the data


def test_a_changed_number_changes_the_sentence(kasa_study):
    data = json.loads((kasa_study / "verdicts.json").read_text())["tasks"]["rte"]["comparisons"]
    versus_lora = data["kasa − lora"]
    sentence = vt.comparison_text(versus_lora)
    assert f"on {versus_lora['n_pairs']} pairs" in sentence
    changed = copy.deepcopy(versus_lora)
    changed.update(diff=-9.5, ci=[-12.1, -6.9], n_pairs=10, p_holm=0.0004, significant=True)
    assert vt.comparison_text(changed).startswith("−9.50 [95 % CI −12.10, −6.90] on 10 pairs, paired t ")
    assert ", Holm p < 0.001: significantly worse" in vt.comparison_text(changed)
    changed.update(significant=False, p_holm=0.4, detectable_80=3.1, tost_p_holm=0.4, equivalent=False)
    assert ": no significant difference; 80 % power to detect |Δ| ≥ 3.10; not shown equivalent within ±1 " \
           "(TOST Holm p = 0.40)" in vt.comparison_text(changed)
    # the verdict follows the data too
    family = copy.deepcopy(data)
    assert vt.kasa_verdict(family) == vt.kasa_verdict(data)
    family["kasa − lora"].update(diff=2.0, significant=True)
    assert "significantly better in: kasa − lora" in vt.kasa_verdict(family)
    family["kasa − head"]["without_labels"].update(significant=not data["kasa − head"]["significant"], diff=1.0)
    assert "Without the labelled runs the verdict changes for: kasa − head" in sensitivity_verdict(family)


def test_the_lambda_verdict_follows_the_directions():
    better = {"diff": 1.0, "significant": True}
    worse = {"diff": -1.0, "significant": True}
    level = {"diff": 0.3, "significant": False}
    assert "**the ratio**" in vt.lambda_verdict({"off_vs_diag": better})
    assert "**a larger learning rate**: the best lambda-1" in vt.lambda_verdict({"off_vs_diag": worse})
    assert "but not the best" in vt.lambda_verdict({"off_vs_diag": level, "off_vs_same_eta_qk": better})
    assert "**neither**" in vt.lambda_verdict({"off_vs_diag": level, "off_vs_same_eta_qk": level})


def test_a_comparison_without_pairs_is_not_testable_never_a_verdict():
    """A study part-way through (or a row that never finished): nothing to judge is said so, not read as "no
    difference" or "better in none"."""
    untested = {"diff": None, "n_pairs": 0, "significant": False}
    assert vt.kasa_verdict({"kasa − lora": untested, "kasa − head": untested}) == (
        "Verdict: not testable yet (no KaSA comparison has two seeds with a value on both sides).")
    partly = vt.kasa_verdict({"kasa − lora": untested, "kasa − head": {"diff": 2.0, "significant": True}})
    assert partly == "Verdict: KaSA is significantly better in: kasa − head (1 of 2 not testable yet)."
    assert vt.lambda_verdict({"off_vs_diag": untested}).startswith("Verdict: not testable yet")
    assert vt.key_verdict(untested).startswith("not testable yet")
    assert "absence of evidence" in vt.key_verdict({"diff": 0.1, "significant": False, "margin": 2.0})


def rendered_from(verdicts: dict) -> set[str]:
    """Every sentence verdicts.py (and the fixed-rate report's slots) write from the data of a verdicts.json."""
    lines: set[str] = set()
    for task in verdicts["tasks"].values():
        comparisons = {k: d for k, d in (task.get("comparisons") or {}).items() if d}
        for data in list(comparisons.values()) + list((task.get("plateau") or {}).values()):
            lines.update(Slot("comparison", ()).render(data))
        if task.get("freeze_wk"):
            lines.update(Slot("key", ()).render(task["freeze_wk"]))
        verdict = vt.kasa_verdict if verdicts["kind"] == "kasa" else vt.lambda_verdict
        lines.add(verdict(comparisons))
        lines.add(sensitivity_verdict(comparisons) or "")
    return lines - {""}


def sentences_of(lines: list[str]) -> list[str]:
    """REPORT.md's lines that state a comparison or a verdict."""
    return [line for line in lines if " pairs, paired t " in line or line.startswith(("Verdict:", "Without the "))
            or "- without the labelled runs:" in line]


def test_kasa_report_lines_are_what_its_verdicts_json_renders_to(kasa_study):
    verdicts = json.loads((kasa_study / "verdicts.json").read_text())
    lines = report_lines(kasa_study)
    expected = rendered_from(verdicts)
    assert sentences_of(lines) and set(sentences_of(lines)) == expected
    comparisons = verdicts["tasks"]["rte"]["comparisons"]
    heading = vt.family_heading(comparisons, "Comparisons")
    assert heading in lines and "Holm over the 3 comparisons of rte below" in heading
    assert not any("this task's family" in line for line in lines)


def test_lambda_report_lines_are_what_its_verdicts_json_renders_to(tmp_path):
    from test_study import FAKE, small_design  # the fake world of the study tests: nothing trains

    from studies.fixed_rate.run import run_study

    paths = StudyPaths(tmp_path / "lambda", tmp_path / "lambda" / "results.sqlite")
    run_study(small_design(), paths, workers=0, train_fn=FAKE, progress=False, report=True, say=lambda *a: None)
    verdicts = json.loads((paths.root / "verdicts.json").read_text())
    lines = report_lines(paths.root)
    assert set(sentences_of(lines)) == rendered_from(verdicts)
    task = verdicts["tasks"]["rte"]
    assert set(task) >= {"comparisons", "freeze_wk", "plateau"}
    assert vt.family_heading(task["plateau"], "Plateau comparisons") in lines


def test_a_p_value_is_never_rounded_across_alpha():
    assert vt.p_text(0.0496) == "p = 0.0496"  # 2 digits would read 0.05 beside "significantly"
    assert vt.p_text(0.043) == "p = 0.043" and vt.p_text(0.44) == "p = 0.44" and vt.p_text(0.0004) == "p < 0.001"
    assert vt.p_text(float("nan")) == "p n/a" and vt.p_text(None) == "p n/a"
