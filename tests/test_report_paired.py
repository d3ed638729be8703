"""`peftlab report` as a reviewer reasons: paired tests over shared seeds (the default when rows share them), the
difference to the baseline with its 95 % CI, TOST equivalence, Holm, power from scipy's noncentral t, checked
against scipy calls, numpy and simulation written here, on a fake store of 2 configs x 3 seeds (x 3 tasks)."""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import pytest
from scipy import stats

from _report_helpers import markdown
from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.lab.records import load_rows
from peftlab.lab.report import build_table
from peftlab.lab.stats import holm, seeds_needed, t_power
from peftlab.lab.store import Store
from peftlab.lab.tables import render_csv, render_latex
from fake_results import checked  # noqa: E402 - tests/ is on sys.path

BASELINE = "lr_ratio=1"
# task -> per-seed accuracy of seeds 0, 1, 2. The seeds move both rows together (the pairing), so the paired test
# sees what Welch cannot: on RTE every seed gains about 2 points, hidden in a 5-point spread between seeds.
MAJORITY = {"rte": 0.527, "mrpc": 0.684, "qnli": 0.505}  # each dev set's most frequent class
BASE = {"rte": [0.60, 0.70, 0.65], "mrpc": [0.80, 0.82, 0.78], "qnli": [0.85, 0.87, 0.86]}
OTHER = {"rte": [0.62, 0.725, 0.672], "mrpc": [0.84, 0.79, 0.84], "qnli": [0.852, 0.869, 0.8605]}
TASKS = ["mrpc", "qnli", "rte"]  # the table's (GLUE) order


def config(**overrides) -> dict:
    values = dict(model="tiny-bert", epochs=3, rank=8, method="lora")
    values.update(overrides)
    return build_run_config(overrides=values).to_dict()


def result(cfg: dict, value: float, **extra) -> dict:
    return checked({"schema_version": 1, "status": "ok", "status_reason": None, "config": cfg, "primary_metric": "accuracy",
                    "majority_baseline": MAJORITY[cfg["task"]],
                    "best": {"epoch": 3, "metrics": {"accuracy": value}}, "final": {"metrics": {"accuracy": value}},
                    "trainable_params": {"adapter": 1000, "head": 600, "total": 1600}, **extra})


def make_store(path, *, other_seeds=(0, 1, 2), other=OTHER, extra=None):
    """Baseline (lr_ratio 1) at seeds 0-2 and lr_ratio 2 at ``other_seeds``, inserted in reverse seed order so
    that pairing by position instead of by seed would pair the wrong runs."""
    with Store(path) as store:
        for task, values in BASE.items():
            for seed, value in enumerate(values):
                cfg = config(task=task, lr_ratio=1.0, seed=seed)
                store.add(cfg, result=result(cfg, value, **(extra or {})))
        for task, values in other.items():
            for seed, value in reversed(list(zip(other_seeds, values))):
                cfg = config(task=task, lr_ratio=2.0, seed=seed)
                store.add(cfg, result=result(cfg, value, **(extra or {})))
    return path


@pytest.fixture
def store_path(tmp_path):
    return make_store(tmp_path / "results.sqlite")


def other_cells(table) -> dict:
    row = next(r for r in table.rows if r.label.get("lr_ratio") == 2.0)
    return row.cells


def csv_line(table) -> dict:
    return next(line for line in csv.DictReader(io.StringIO(render_csv(table))) if line["lr_ratio"] == "2")


# --------------------------------------------------------------------------- the paired test and its CI


def test_paired_is_the_default_and_equals_ttest_rel_with_a_numpy_t_interval(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE)
    assert table.test_requested == "auto" and table.test == "paired"
    cells, line = other_cells(table), csv_line(table)
    for task in TASKS:
        comparison = cells[task].comparison
        assert comparison.p == pytest.approx(stats.ttest_rel(OTHER[task], BASE[task]).pvalue, rel=1e-12)
        differences = np.subtract(OTHER[task], BASE[task])
        half = stats.t.ppf(0.975, 2) * differences.std(ddof=1) / math.sqrt(3)
        assert comparison.diff == pytest.approx(differences.mean(), rel=1e-12)
        assert (comparison.ci_low, comparison.ci_high) == pytest.approx(
            (differences.mean() - half, differences.mean() + half), rel=1e-9)
        assert comparison.n_pairs == 3
        # the CSV, unrounded and in the table's scale (x100)
        assert float(line[f"{task}_diff"]) == pytest.approx(differences.mean() * 100, rel=1e-12)
        assert float(line[f"{task}_ci_low"]) == pytest.approx((differences.mean() - half) * 100, rel=1e-9)
        assert float(line[f"{task}_ci_high"]) == pytest.approx((differences.mean() + half) * 100, rel=1e-9)
        assert line[f"{task}_n_pairs"] == "3" and float(line[f"{task}_p"]) == comparison.p
    # the pairing is what finds RTE's gain: Welch on the same runs does not
    welch = stats.ttest_ind(OTHER["rte"], BASE["rte"], equal_var=False).pvalue
    assert cells["rte"].comparison.p < 0.05 < welch and cells["rte"].comparison.marked
    md = markdown(table)
    assert "paired t-test over the seeds both cells ran, matched by seed (scipy.stats.ttest_rel)" in md
    assert "--test auto chose it: the compared rows share seeds" in md
    assert "each cell states its number of pairs" in md
    rte = next(text for text in md.splitlines() if text.startswith("| 2 |")).split(" | ")[3]  # lr_ratio, 3 tasks
    d = np.subtract(OTHER["rte"], BASE["rte"])
    half = stats.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
    assert rte == (f"{np.mean(OTHER['rte']) * 100:.1f} ± {np.std(OTHER['rte'], ddof=1) * 100:.1f} (3)† "
                   f"Δ {d.mean() * 100:+.1f} (CI {(d.mean() - half) * 100:+.1f}, {(d.mean() + half) * 100:+.1f}) "
                   f"p={cells['rte'].comparison.p:.2g} (adj {cells['rte'].comparison.p_adj:.2g}), 3 pairs")


def test_default_is_welch_when_the_rows_share_no_seeds(tmp_path):
    path = make_store(tmp_path / "results.sqlite", other_seeds=(10, 11, 12))
    table = build_table(load_rows([path]), baseline=BASELINE)
    assert table.test == "welch"
    for task in TASKS:
        comparison = other_cells(table)[task].comparison
        assert comparison.p == pytest.approx(stats.ttest_ind(OTHER[task], BASE[task], equal_var=False).pvalue,
                                             rel=1e-12)
        assert comparison.n_pairs is None
        low, high = stats.ttest_ind(OTHER[task], BASE[task], equal_var=False).confidence_interval(0.95)
        assert (comparison.ci_low, comparison.ci_high) == pytest.approx((low, high), rel=1e-12)
    md = markdown(table)
    assert "--test auto chose Welch's: 3 of 3 comparisons share fewer than 2 seeds with the baseline" in md
    assert " pairs" not in md.split("\n\n")[0]  # no cell claims pairs
    # asked for explicitly, paired finds no pairs: no p, and the footnote says why
    paired = build_table(load_rows([path]), baseline=BASELINE, test="paired")
    assert not paired.comparisons and paired.untested == {"fewer than 2 seeds in common with the baseline's cell": 3}
    assert "3 cells without p: fewer than 2 seeds in common with the baseline's cell" in markdown(paired)


def test_mismatched_seeds_pair_only_the_common_ones_and_say_how_many(tmp_path):
    # lr_ratio 2 ran seeds 1, 2, 3: seed 0 of the baseline and seed 3 of the other row have no partner
    path = make_store(tmp_path / "results.sqlite", other_seeds=(1, 2, 3))
    table = build_table(load_rows([path]), baseline=BASELINE)
    assert table.test == "paired"
    for task in TASKS:
        cell = other_cells(table)[task]
        by_seed = dict(zip((1, 2, 3), OTHER[task]))
        expected = stats.ttest_rel([by_seed[1], by_seed[2]], BASE[task][1:]).pvalue
        assert cell.n == 3 and cell.comparison.n_pairs == 2
        assert cell.comparison.p == pytest.approx(expected, rel=1e-12)
        assert cell.comparison.diff == pytest.approx(np.mean(np.subtract([by_seed[1], by_seed[2]], BASE[task][1:])))
    line = next(text for text in markdown(table).splitlines() if text.startswith("| 2 |"))
    assert line.count("(3) Δ") == 3 and line.count(", 2 pairs") == 3


def test_wilcoxon_on_the_same_pairs(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE, test="wilcoxon")
    for task in TASKS:
        comparison = other_cells(table)[task].comparison
        assert comparison.p == pytest.approx(stats.wilcoxon(OTHER[task], BASE[task]).pvalue, rel=1e-12)
        assert comparison.n_pairs == 3
    md = markdown(table)
    assert "Wilcoxon signed-rank test over the seeds both cells ran" in md and "--test auto" not in md


def test_bootstrap_ci_of_the_paired_differences_is_seeded(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE, ci="bootstrap")
    again = build_table(load_rows([store_path]), baseline=BASELINE, ci="bootstrap")
    differences = np.subtract(OTHER["mrpc"], BASE["mrpc"])
    expected = stats.bootstrap((differences,), np.mean, n_resamples=9999, confidence_level=0.95,
                               rng=np.random.default_rng(0)).confidence_interval
    comparison = other_cells(table)["mrpc"].comparison
    assert (comparison.ci_low, comparison.ci_high) == pytest.approx((expected.low, expected.high), rel=1e-12)
    assert (comparison.ci_low, comparison.ci_high) == (other_cells(again)["mrpc"].comparison.ci_low,
                                                       other_cells(again)["mrpc"].comparison.ci_high)
    t_interval = other_cells(build_table(load_rows([store_path]), baseline=BASELINE))["mrpc"].comparison
    assert (comparison.ci_low, comparison.ci_high) != (t_interval.ci_low, t_interval.ci_high)
    assert "BCa bootstrap (scipy.stats.bootstrap, 9,999 resamples, seed 0)" in markdown(table)


# --------------------------------------------------------------------------- equivalence (TOST)


def tost_by_hand(task: str, margin: float) -> tuple[float, float]:
    """The two one-sided paired tests against the baseline shifted by -margin and +margin."""
    other, base = np.array(OTHER[task]), np.array(BASE[task])
    greater = stats.ttest_rel(other, base - margin, alternative="greater").pvalue
    less = stats.ttest_rel(other, base + margin, alternative="less").pvalue
    return greater, less


def test_tost_verdict_equals_two_one_sided_ttest_rel(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE, equivalence_margin=5, correction="none")
    verdicts = {}
    for task in TASKS:
        greater, less = tost_by_hand(task, 0.05)  # 5 points at x100
        comparison = other_cells(table)[task].comparison
        assert comparison.tost_p == pytest.approx(max(greater, less), rel=1e-12)
        assert comparison.equivalent == (greater < 0.05 and less < 0.05)
        verdicts[task] = comparison.equivalent
    assert verdicts == {"mrpc": False, "qnli": True, "rte": True}  # the data give both outcomes
    line = next(text for text in markdown(table).splitlines() if text.startswith("| 2 |"))
    assert line.count("equivalent within 5") == 2
    mrpc = line.split(" | ")[1]
    assert "equivalent" not in mrpc and other_cells(table)["mrpc"].comparison.p > 0.05  # not different, still not equivalent
    csv = csv_line(table)
    assert csv["qnli_equivalent"] == "1" and csv["mrpc_equivalent"] == "0"
    assert float(csv["mrpc_tost_p"]) == pytest.approx(max(tost_by_hand("mrpc", 0.05)), rel=1e-12)
    md = markdown(table)
    assert "TOST, two one-sided paired t-tests" in md and "(2 of 3 cells)" in md
    assert "a difference that is not significant is not evidence of no difference" in md
    # a margin too tight for three seeds: nothing is called equivalent
    tight = build_table(load_rows([store_path]), baseline=BASELINE, equivalence_margin=0.01)
    assert not any(c.comparison.equivalent for c in other_cells(tight).values())
    assert "equivalent within" not in markdown(tight).split("\n\n")[0]


def test_a_cell_alike_on_every_pair_gets_no_equivalence_test(tmp_path):
    """RTE's other row equals its baseline on every seed (two rows that learned nothing, say): no spread, so neither
    the t-test nor the TOST is defined; the cell is not called equivalent and the footnote counts only the tests
    that ran."""
    same = {**OTHER, "rte": BASE["rte"]}
    table = build_table(load_rows([make_store(tmp_path / "r.sqlite", other=same)]), baseline=BASELINE,
                        equivalence_margin=5, correction="none")
    rte = other_cells(table)["rte"].comparison
    assert rte.constant and rte.tost_p is None and not rte.equivalent
    assert other_cells(table)["qnli"].comparison.equivalent
    line = next(text for text in markdown(table).splitlines() if text.startswith("| 2 |"))
    assert "equivalent within 5" not in line.split(" | ")[3]
    assert "(1 of 2 cells)" in markdown(table) and csv_line(table)["rte_tost_p"] == ""


def test_tost_after_the_holm_correction(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE, equivalence_margin=5, correction="holm")
    raw = {task: max(tost_by_hand(task, 0.05)) for task in TASKS}
    adjusted = holm_by_hand(raw)
    for task in TASKS:
        comparison = other_cells(table)[task].comparison
        assert comparison.tost_p_adj == pytest.approx(adjusted[task], rel=1e-12)
        assert comparison.equivalent == (adjusted[task] < 0.05)


# --------------------------------------------------------------------------- Holm


def holm_by_hand(p: dict[str, float]) -> dict[str, float]:
    """Holm for three p-values, written out: the smallest x3, the middle x2 (never below the first), the largest
    x1 (never below the second), capped at 1."""
    (a, pa), (b, pb), (c, pc) = sorted(p.items(), key=lambda item: item[1])
    first = min(1.0, 3 * pa)
    second = min(1.0, max(first, 2 * pb))
    third = min(1.0, max(second, pc))
    return {a: first, b: second, c: third}


def test_holm_equals_a_hand_computation(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE, correction="holm")
    cells = {task: cell.comparison for task, cell in other_cells(table).items()}
    expected = holm_by_hand({task: cells[task].p for task in TASKS})
    for task in TASKS:
        assert cells[task].p_adj == pytest.approx(expected[task], rel=1e-12)
        assert cells[task].marked == (expected[task] < 0.05)
    bh = other_cells(build_table(load_rows([store_path]), baseline=BASELINE, correction="bh"))
    assert any(bh[t].comparison.p_adj != pytest.approx(cells[t].p_adj) for t in TASKS)  # a different correction
    md = markdown(table)
    assert "† Holm-adjusted p < 0.05" in md and "Holm's step-down (family-wise error rate) over the 3" in md
    # a textbook case, ties and the cap included
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.5, 0.9]) == pytest.approx([1.0, 1.0, 1.0])


# --------------------------------------------------------------------------- power


def simulated_power(difference: float, sd: float, n: int, *, alpha: float = 0.05, draws: int = 40_000) -> float:
    """The share of simulated paired studies (n normal differences) a two-sided paired t-test rejects."""
    rng = np.random.default_rng(1)
    samples = rng.normal(difference, sd, size=(draws, n))
    t = samples.mean(axis=1) / (samples.std(axis=1, ddof=1) / math.sqrt(n))
    return float(np.mean(np.abs(t) > stats.t.ppf(1 - alpha / 2, n - 1)))


def test_power_matches_simulation_and_an_independent_formula(store_path):
    table = build_table(load_rows([store_path]), baseline=BASELINE, power=True, power_diff=0.2)
    approximated = 0
    for task in TASKS:
        power = other_cells(table)[task].comparison.power
        differences = np.subtract(OTHER[task], BASE[task])
        assert power.design == "paired" and power.n == 3
        assert power.sd == pytest.approx(differences.std(ddof=1), rel=1e-12)
        # at the smallest detectable difference, 80 % of simulated studies of 3 pairs reject
        assert simulated_power(power.detectable, power.sd, 3) == pytest.approx(0.80, abs=0.01)
        # the seeds needed for 0.2 points: Guenther's approximation (normal quantiles + z^2/2; good from about
        # 10 seeds) within one seed, and by simulation enough at that n but not at one fewer
        assert power.target == pytest.approx(0.002)
        z = stats.norm.ppf(0.975) + stats.norm.ppf(0.80)
        approx = (z * power.sd / 0.002) ** 2 + stats.norm.ppf(0.975) ** 2 / 2
        if power.seeds_needed >= 10:
            assert abs(power.seeds_needed - approx) <= 1.0
            approximated += 1
        if power.seeds_needed <= 100:
            assert simulated_power(0.002, power.sd, power.seeds_needed) >= 0.80 - 0.01
            assert simulated_power(0.002, power.sd, power.seeds_needed - 1) < 0.80 + 0.01
    needed = sorted(other_cells(table)[task].comparison.power.seeds_needed for task in TASKS)
    assert approximated == 2 and needed[0] <= 100 < needed[-1]  # small and large n both checked
    # default: the seeds for each comparison's own observed difference
    observed = build_table(load_rows([store_path]), baseline=BASELINE, power=True)
    rte = other_cells(observed)["rte"].comparison
    assert rte.power.target == pytest.approx(abs(rte.diff))
    assert t_power(rte.power.target, rte.power.sd, rte.power.seeds_needed, None, 0.05) >= 0.8
    assert t_power(rte.power.target, rte.power.sd, rte.power.seeds_needed - 1, None, 0.05) < 0.8


def test_power_cli_prints_a_line_per_comparison(store_path, capsys):
    assert main(["report", str(store_path), "--baseline", BASELINE, "--power-diff", "0.3"]) == 0
    out = capsys.readouterr().out
    table = build_table(load_rows([store_path]), baseline=BASELINE, power_diff=0.3)
    assert table.power  # --power-diff implies --power
    assert "Power (--power):" in out and "scipy.stats.nct" in out
    power_lines = [line for line in out.split("Power (--power):")[1].splitlines() if line.startswith("| 2 ")]
    assert len(power_lines) == 3
    for task in TASKS:
        power = other_cells(table)[task].comparison.power
        line = next(text for text in power_lines if f" {task} " in text)
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[-3:] == [f"{power.detectable * 100:.1f}", "0.3", str(power.seeds_needed)]
    csv_out = csv_line(table)
    assert int(csv_out["rte_seeds_needed"]) == other_cells(table)["rte"].comparison.power.seeds_needed
    tex = render_latex(table)
    assert "% Power (--power)" in tex and r"detectable $\Delta$ (80\% power)" in tex and tex.count(r"\toprule") == 2


def test_seeds_needed_edges():
    assert seeds_needed(1.0, 0.01, paired=True, alpha=0.05) == 2  # a huge effect: as few as a t-test allows
    assert seeds_needed(1e-6, 1.0, paired=True, alpha=0.05) is None  # beyond the search's cap
    two_sample = seeds_needed(0.5, 1.0, paired=False, alpha=0.05)
    assert 60 <= two_sample <= 66  # the textbook 64 per group for d = 0.5 (normal approximation 63)


# --------------------------------------------------------------------------- options


def test_options_that_need_a_baseline_and_bad_values(store_path):
    rows = load_rows([store_path])
    with pytest.raises(PeftlabError, match="--equivalence-margin and --power compare rows with a baseline"):
        build_table(rows, equivalence_margin=1, power=True)
    with pytest.raises(PeftlabError, match="--equivalence-margin must be a positive number"):
        build_table(rows, baseline=BASELINE, equivalence_margin=0)
    with pytest.raises(PeftlabError, match="--power-diff must be a positive number"):
        build_table(rows, baseline=BASELINE, power_diff=-1)


def test_help_shows_every_statistics_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["report", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for needle in ("--test {auto,paired,wilcoxon,welch,student}", "matched by seed", "each cell states its number "
                   "of pairs", "Wilcoxon signed-rank", "--ci {t,bootstrap}", "95% CI", "--equivalence-margin M",
                   "TOST", "--correction {bh,holm,none}", "Holm's step-down", "--power ", "80% power",
                   "scipy.stats.nct", "--power-diff D", "--allow-mixed-code", "median and range"):
        assert needle in text, needle
