"""The study designs as spec files: the committed stores still plan and report the same (``docs/study/kasa-fair``'s
runs from the shipped specs; ``docs/study/lambda`` and ``docs/study/kasa``, made with the fixed-rate protocol,
rewritten byte for byte by ``python -m studies.fixed_rate`` from their REPORT.md's own command, on copies), a user's
own spec runs through ``--spec``, and a bad spec or an option the design does not take is one line."""

from __future__ import annotations

import json
import shlex
import shutil
import sqlite3
from pathlib import Path

import pytest
import yaml

from peftlab.cli.main import build_parser
from peftlab.errors import PeftlabError
from peftlab.lab import study_protocol as sp
from peftlab.lab.study_cli import design_from_args
from peftlab.lab.study_plan import StudyPaths, keyed, save_fair_plan
from peftlab.lab.study_spec import load_study_spec, shipped
from studies.fixed_rate.cli import main as fixed_rate_main

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "docs" / "study"


def parse(argv: list[str]):
    return design_from_args(build_parser(argv).parse_args(argv))


FINISHED_FAIR_STUDIES = ["kasa-fair", "kasa-fair-sst2", "lambda-fair"]  # KaSA on STS-B and SST-2, lambda on STS-B
UNCOMMITTED = shutil.ignore_patterns("runs", "*.sqlite-wal", "*.sqlite-shm")  # a study's run folders stay local


def reproduce_command(report: Path) -> list[str]:
    """The words of a REPORT.md's "reproduce" line."""
    line = next(line for line in report.read_text().splitlines() if "reproduce: `" in line)
    return shlex.split(line.split("reproduce: `")[1].split("`")[0])


def test_the_running_kasa_study_plans_the_runs_its_store_holds(tmp_path):
    root = tmp_path / "kasa-fair"
    shutil.copytree(STUDY / "kasa-fair", root, ignore=UNCOMMITTED)
    design = parse(["study", "kasa", "--task", "stsb", "--model", "minilm-l6", "--set", "max_length=64",
                    "--output-dir", str(root)])
    assert design.record() == json.loads((root / "plan.json").read_text())["design"]
    save_fair_plan(StudyPaths(root, root / "results.sqlite"), design)  # the resumed study is the same study
    steps = sp.grid_steps(design.protocol, ())
    planned = {key for row in design.rows for _, key in keyed(sp.search_configs(design, "stsb", row, steps))}
    with sqlite3.connect(root / "results.sqlite") as db:
        stored = {key for (key,) in db.execute("select key from runs")}
    # round 0 registered all its 42 runs at its start (2e9e855's code): this code plans exactly those keys; later
    # rounds and the held-out arms add rows as the study goes on
    assert planned <= stored
    spec = yaml.safe_load((root / "specs" / "search-stsb-round0.yaml").read_text())
    assert len(spec["zip"][0]["seed"]) == len(planned) == 42  # 7 rows x 3 rates x 2 selection seeds
    # the 2 x 2's arms at the authors' STS-B settings, as the study has run them from the start
    arms = {arm.name: (arm.rate, arm.keys) for arm in sp.paper_arms(design, "stsb")}
    assert arms == {"lora@paper-rate": (3e-4, {"method": "lora"}),
                    "kasa@paper-settings": (3e-4, {"method": "kasa", "alpha": 16.0, "weight_decay": 0.0,
                                                   "kasa_beta": 1e-4, "kasa_gamma": 1e-5})}


@pytest.mark.parametrize("folder", FINISHED_FAIR_STUDIES)
def test_a_finished_fair_study_reports_byte_for_byte_from_its_own_command(folder, tmp_path, monkeypatch, capsys):
    """A finished fair study's REPORT.md, SECTION.md (RESULTS.md's block) and verdicts.json come from its store
    alone: its REPORT.md's own command rewrites them identically on a copy without the run folders."""
    from peftlab.cli.main import main

    copy = tmp_path / "docs" / "study" / folder
    shutil.copytree(STUDY / folder, copy, ignore=UNCOMMITTED)
    written = ("REPORT.md", "SECTION.md", "verdicts.json")
    for name in written:
        (copy / name).unlink()
    monkeypatch.chdir(tmp_path)  # the command names docs/study/<folder>, as REPORT.md prints it
    argv = reproduce_command(STUDY / folder / "REPORT.md")
    assert argv[:2] == ["peftlab", "study"] and argv[2] in shipped() and argv[-1] == "--report-only"
    assert main(argv[1:]) == 0
    for name in written:
        assert (copy / name).read_bytes() == (STUDY / folder / name).read_bytes(), name


@pytest.mark.parametrize("study", ["lambda", "kasa"])
def test_a_committed_fixed_rate_study_reports_byte_for_byte_from_its_own_command(study, tmp_path, monkeypatch,
                                                                                capsys):
    copy = tmp_path / "docs" / "study" / study
    shutil.copytree(STUDY / study, copy)
    for name in ("REPORT.md", "verdicts.json"):
        (copy / name).unlink()
    monkeypatch.chdir(tmp_path)  # the command names docs/study/<study>, as REPORT.md prints it
    argv = reproduce_command(STUDY / study / "REPORT.md")
    assert argv[:3] == ["python", "-m", "studies.fixed_rate"] and "--report-only" in argv
    assert fixed_rate_main(argv[3:]) == 0
    for name in ("REPORT.md", "verdicts.json"):
        assert (copy / name).read_bytes() == (STUDY / study / name).read_bytes(), name


def own_spec(tmp_path: Path) -> Path:
    """A user's design: two rows of their own, a family of one comparison, no paper arms."""
    spec = {"name": "mine", "help": "LoRA against DoRA", "fair": {
        "title": "LoRA against DoRA, each at its own rate", "options": {"rows": "lora,head"},
        "rows": {"lora": {"method": "lora"}, "head": {"method": "head"}},
        "families": [{"name": "adapter", "intro": "What the adapter adds", "family": "the adapter",
                      "pairs": [["lora", "head"]]}]}}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_a_users_spec_runs_as_a_study_and_its_command_gives_it_back(tmp_path):
    from peftlab.lab.study import run_fair_study
    from peftlab.lab.study_fair_report import study_command
    from test_study import FAKE

    path = own_spec(tmp_path)
    design = parse(["study", "--spec", str(path), "--task", "rte", "--model", "tiny-bert", "--max-train-samples",
                    "64", "--epochs", "2", "--selection-samples", "8", "--max-extensions", "0", "--heldout-seeds",
                    "2", "--rate-centre", "1e-3"])
    assert design.kind == "mine" and [r.name for r in design.rows] == ["lora", "head"]
    command = study_command(design, tmp_path / "out")
    assert command.startswith(f"peftlab study --spec {path} ")
    assert parse(shlex.split(command)[1:]) == design
    paths = StudyPaths(tmp_path / "out", tmp_path / "out" / "results.sqlite")
    run_fair_study(design, paths, workers=0, train_fn=FAKE, progress=False, say=lambda *a: None)
    verdicts = json.loads((paths.root / "verdicts.json").read_text())["tasks"]["rte"]
    assert list(verdicts["families"]) == ["adapter"]
    assert verdicts["families"]["adapter"]["lora − head"]["n_pairs"] == 2
    report = (paths.root / "REPORT.md").read_text()
    assert report.startswith("# Study: LoRA against DoRA, each at its own rate") and "What the adapter adds" in report


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(colour="red"), "unknown key of the study spec 'colour'"),
    (lambda s: s["fair"]["families"][0]["pairs"].append(["lora", "dora"]), "compares 'dora', which is no row"),
    (lambda s: s["fair"].pop("rows"), "needs either rows"),
    (lambda s: s["fair"]["families"][0].update(compare="all"), "unknown compare of family adapter 'all'"),
])
def test_a_bad_spec_is_one_line(change, message, tmp_path):
    path = own_spec(tmp_path)
    spec = yaml.safe_load(path.read_text())
    change(spec)
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(PeftlabError, match=message) as info:
        load_study_spec(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("argv, message", [
    (["study", "kasa", "--ratios", "2"], "--ratios is not an option of study kasa"),
    (["study", "lambda", "--rows", "lora"], "--rows is not an option of study lambda"),
    (["study", "lambda", "--lr", "1e-3"], "--lr is an option of the fixed-rate protocol"),
    (["study", "kasa", "--protocol", "fixed-rate"], "moved out of the installed package.*studies.fixed_rate"),
    (["study"], "name a study"),
])
def test_an_option_the_design_does_not_take_is_refused(argv, message, tmp_path):
    argv = argv + ["--task", "rte", "--model", "tiny-bert"]
    with pytest.raises(PeftlabError, match=message):
        parse(argv)


def spec_with_options(tmp_path: Path, options: dict) -> Path:
    path = own_spec(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec["fair"]["options"].update(options)
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_specs_options_set_the_protocols_knobs_and_a_flag_beats_them(tmp_path):
    path = spec_with_options(tmp_path, {"patience": 5, "grid_factor": 3, "heldout_seeds": 4})
    argv = ["study", "--spec", str(path), "--task", "rte", "--model", "tiny-bert"]
    design = parse(argv)
    assert (design.protocol.patience, design.protocol.grid_factor, design.heldout_seeds) == (5, 3.0, 4)
    assert design.protocol.min_delta == 0.002  # the spec is silent: the default
    assert parse(argv + ["--patience", "2"]).protocol.patience == 2


@pytest.mark.parametrize("options, message", [
    ({"colour": "red"}, "options: 'colour' is not an option a study spec can set"),
    ({"patience": 0}, "options: patience: expected a positive integer"),
])
def test_a_specs_option_is_applied_or_refused_never_ignored(options, message, tmp_path):
    path = spec_with_options(tmp_path, options)
    with pytest.raises(PeftlabError, match=message) as info:
        parse(["study", "--spec", str(path), "--task", "rte", "--model", "tiny-bert"])
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_the_shipped_specs_are_package_data():
    assert set(shipped()) == {"lambda", "kasa"}
    assert "lab/studies/*.yaml" in (ROOT / "pyproject.toml").read_text()
    for path in shipped().values():
        spec = load_study_spec(path)
        assert spec.command() == f"peftlab study {spec.name}" and spec.section.families


def test_the_lambda_spec_sweeps_lr_ratio_with_its_controls_and_the_wk_ablation(tmp_path):
    """The fair lambda study from its spec: a row per lambda, lambda 1 at the best lambda > 1 row's eta_QK and
    eta_V (one of them is lambda 1's own pick here: not run twice), the baseline family and W_k on --key-seeds."""
    from peftlab.lab.study import run_fair_study
    from test_study import FAKE, calls

    design = parse(["study", "lambda", "--ratios", "4,8", "--key-seeds", "4", "--task", "rte", "--model", "tiny-bert",
                    "--max-train-samples", "64", "--epochs", "2", "--selection-samples", "8", "--max-extensions", "1",
                    "--heldout-seeds", "3", "--rate-centre", "1e-3"])
    assert [(r.name, r.keys) for r in design.rows] == [("lambda 1", {"lr_ratio": 1.0}), ("lambda 4", {"lr_ratio": 4.0}),
                                                      ("lambda 8", {"lr_ratio": 8.0})]
    paths = StudyPaths(tmp_path / "l", tmp_path / "l" / "results.sqlite")
    run_fair_study(design, paths, workers=0, train_fn=FAKE, progress=False, say=lambda *a: None)
    data = json.loads((paths.root / "verdicts.json").read_text())["tasks"]["rte"]
    # the fake world peaks at eta_V 3e-3 and gives lambda 4 one point more: lambda 4 at 1e-3 is the best swept row;
    # its eta_V control (4e-3) is lambda 1's own pick, so only the eta_QK control is a row of its own
    assert {name: row["rate"] for name, row in data["rows"].items()} == {
        "lambda 1": 4e-3, "lambda 4": 1e-3, "lambda 8": 5e-4, "lambda 1 at the same eta_QK": 1e-3}
    lam = data["families"]["lambda"]
    assert lam["off_vs_diag: lambda 4 (best lambda > 1) − lambda 1"]["diff"] == pytest.approx(1.0)
    assert set(lam) == {"lambda 8 − lambda 1", "off_vs_diag: lambda 4 (best lambda > 1) − lambda 1",
                        "off_vs_same_eta_qk: lambda 4 − lambda 1 at the same eta_QK"}
    assert data["families"]["key"]["W_k frozen (lambda 1) − W_k trained"]["n_pairs"] == 4
    key_runs = [c for c in calls(paths.root) if c["targets"] == "q,k,v"]
    assert {(c["lr"], c["seed"]) for c in key_runs} == {(4e-3, s) for s in range(100, 104)}
    report = (paths.root / "REPORT.md").read_text()
    assert "Each lambda against lambda 1" in report and "The W_k ablation" in report


@pytest.mark.parametrize("argv", [
    ["study", "lambda", "--task", "stsb", "--model", "tiny-bert", "--ratios", "1.5,2,4", "--rate-centre", "7e-4",
     "--patience", "2", "--min-delta", "0.001", "--max-extensions", "2", "--key-seeds", "12", "--set", "rank=4"],
    ["study", "kasa", "--task", "stsb,mrpc", "--model", "tiny-bert", "--rows", "head,lora,kasa-reference",
     "--selection-samples", "64", "--epochs", "5", "--grid-width", "2", "--no-paper-arms"],
])
def test_the_reports_command_gives_the_design_back(argv, tmp_path):
    """REPORT.md's "reproduce" command, parsed again, is the same design: the command beside the numbers works."""
    from peftlab.lab.study_fair_report import study_command

    design = parse(argv)
    command = study_command(design, tmp_path / "study")
    words = shlex.split(command)
    assert words[0] == "peftlab" and parse(words[1:]) == design
    assert f"--output-dir {tmp_path / 'study'}" in command


def test_a_row_whose_pick_is_the_papers_setting_is_one_arm_not_a_comparison_of_a_run_with_itself(tmp_path):
    """On SST-2 the KaSA authors' settings are the shipped defaults at 5e-4: a row whose search picks 5e-4 and the
    paper arm are the same runs. The 2 x 2 says so instead of a paired test of identical values (p = nan)."""
    from peftlab.lab import verdicts as vt
    from peftlab.lab.study import run_fair_study
    from test_study import FAKE

    spec = yaml.safe_load(own_spec(tmp_path).read_text())
    spec["paper_settings"] = {"rte": {"lr": 4e-3}}  # the fake world's pick (its peak is at 3e-3)
    spec["fair"]["paper_arms"] = [{"name": "lora@paper-rate", "keys": {"method": "lora"}}]
    spec["fair"]["families"].append({"name": "paper", "intro": "The 2 x 2", "family": "the 2 x 2",
                                     "pairs": [["lora", "lora@paper-rate", "lora − lora@paper-rate (the rate)"]]})
    path = tmp_path / "paper.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    design = parse(["study", "--spec", str(path), "--task", "rte", "--model", "tiny-bert", "--max-train-samples",
                    "64", "--epochs", "2", "--selection-samples", "8", "--heldout-seeds", "2", "--rate-centre", "1e-3"])
    paths = StudyPaths(tmp_path / "out", tmp_path / "out" / "results.sqlite")
    run_fair_study(design, paths, workers=0, train_fn=FAKE, progress=False, say=lambda *a: None)
    verdicts = json.loads((paths.root / "verdicts.json").read_text())["tasks"]["rte"]
    assert verdicts["rows"]["lora"]["chosen_rate"] == verdicts["rows"]["lora@paper-rate"]["rate"] == 4e-3
    same = verdicts["families"]["paper"]["lora − lora@paper-rate (the rate)"]
    assert same["same_runs"] is True and same["diff"] is None and same["n_pairs"] == 2 and "p_holm" not in same
    text = vt.comparison_text(same)
    assert text == "the same runs: lora's chosen rate and settings are lora@paper-rate's, so nothing to compare"
    assert text in (paths.root / "REPORT.md").read_text()
    assert verdicts["families"]["adapter"]["lora − head"]["p"] is not None  # the other families are tested as ever
