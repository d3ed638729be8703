"""`peftlab nlg-score` and the E2E metrics equal the official E2E NLG Challenge script's numbers on a fixed file.

The pinned values were computed once with tuetschek/e2e-metrics at OFFICIAL_COMMIT (`measure_scores.py -p
tests/data/e2e_metrics/references.txt tests/data/e2e_metrics/outputs.txt`, Python 3.11, Java 17; see
tests/data/e2e_metrics/README.md). PRINTED is what the script prints (``%.4f``): peftlab's value rounded to 4
places must be the same string ("within rounding"). UNROUNDED is the same run's values before printing (its
``run_pymteval`` and ``COCOEvalCap.eval`` results): peftlab's must agree to 1e-9 relative, which allows only
float summation order (NIST sums in another order: 4e-16 apart here) and would catch any real difference.

METEOR 1.5 and the PTB tokenizer are Java: the tests that need them are skipped, with a reason starting
"java:", only where no ``java`` is on PATH (CI and these machines have Java 17). BLEU and NIST need no Java and
are checked against the official values in every case, also by the no-Java tests.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from peftlab.cli.main import main
from peftlab.errors import PeftlabError
from peftlab.tasks import nlg_metrics
from peftlab.tasks.nlg_score import read_outputs, read_references, score_files

FIXTURE = Path(__file__).resolve().parent / "data" / "e2e_metrics"
REFS, HYPS = FIXTURE / "references.txt", FIXTURE / "outputs.txt"
OFFICIAL_COMMIT = "1b9c4d87fd0bbb171ea966741cdc012588581ed4"  # tuetschek/e2e-metrics, measure_scores.py -p
PRINTED = {"bleu": "0.3004", "nist": "2.9825", "meteor": "0.3255", "rouge_l": "0.4954", "cider": "1.4815"}
UNROUNDED = {"bleu": 0.30038130207554836, "nist": 2.9825286061930054, "meteor": 0.32553714806264283,
             "rouge_l": 0.49540149159777114, "cider": 1.4815315002798075}
NO_JAVA_METRICS = ("bleu", "nist")  # computed the official way without Java

needs_java = pytest.mark.skipif(
    shutil.which("java") is None,
    reason="java: no `java` on PATH; METEOR 1.5 and the PTB tokenizer (pycocoevalcap's jars) need it")


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["nlg-score", *argv])
    return status, out.getvalue()


@pytest.fixture(scope="module")
def official_json():
    """`peftlab nlg-score --json` on the fixture, once for the module (three JVM starts)."""
    status, out = run_cli("--refs", str(REFS), "--hyps", str(HYPS), "--json")
    assert status == 0
    return json.loads(out)


@pytest.fixture
def no_java(tmp_path, monkeypatch):
    """A PATH without `java` (the jars find it on PATH, as java_runtime does)."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert nlg_metrics.java_runtime().path is None


def test_the_pinned_values_name_the_script_that_produced_them():
    assert OFFICIAL_COMMIT in nlg_metrics.OFFICIAL and "measure_scores.py -p" in nlg_metrics.OFFICIAL
    assert all(f"{UNROUNDED[name]:.4f}" == PRINTED[name] for name in PRINTED)


@needs_java
def test_nlg_score_json_equals_the_official_script(official_json):
    metrics = official_json["metrics"]
    assert list(metrics) == list(nlg_metrics.METRICS)  # all five, METEOR included
    for name, printed in PRINTED.items():
        assert f"{metrics[name]:.4f}" == printed, name
        assert metrics[name] == pytest.approx(UNROUNDED[name], rel=1e-9), name
    assert official_json["unavailable"] == {} and official_json["notes"] == []
    assert official_json["outputs"] == 12 and official_json["references"] == 44
    assert official_json["official"] == nlg_metrics.OFFICIAL and official_json["java"]
    described = official_json["implementations"]
    assert "METEOR 1.5" in described["meteor"] and "PTBTokenizer" in described["rouge_l"]
    assert "beta 1.2" in described["rouge_l"] and "CIDEr-D" in described["cider"]


@needs_java
def test_nlg_score_prints_the_official_scripts_lines():
    status, out = run_cli("--refs", str(REFS), "--hyps", str(HYPS))
    assert status == 0
    lines = out.splitlines()
    assert lines[1:] == ["SCORES:", "==============", f"BLEU: {PRINTED['bleu']}", f"NIST: {PRINTED['nist']}",
                         f"METEOR: {PRINTED['meteor']}", f"ROUGE_L: {PRINTED['rouge_l']}", f"CIDEr: {PRINTED['cider']}"]
    assert lines[0].startswith("12 outputs, 44 references") and OFFICIAL_COMMIT in lines[0]


def test_the_libraries_defaults_would_not_give_the_official_numbers():
    """Why peftlab supplies the BLEU totals and its own NIST: the packaged defaults differ on this file."""
    import sacrebleu
    from nltk.translate.nist_score import corpus_nist

    refs, hyps = read_references(REFS), read_outputs(HYPS)
    streams = [[group[k] if k < len(group) else None for group in refs] for k in range(6)]
    plain = sacrebleu.corpus_bleu(hyps, streams, lowercase=True).score / 100  # 2- and 0-token outputs counted apart
    assert f"{plain:.4f}" != PRINTED["bleu"]
    tokens = [nlg_metrics.mteval_tokens(h) for h in hyps]
    ref_tokens = [[nlg_metrics.mteval_tokens(r) for r in group] for group in refs]
    assert f"{corpus_nist(ref_tokens, tokens, n=5):.4f}" != PRINTED["nist"]  # one best reference, its length
    assert nlg_metrics.mteval_bleu(hyps, refs) == pytest.approx(UNROUNDED["bleu"], rel=1e-9)
    assert nlg_metrics.mteval_nist(tokens, ref_tokens) == pytest.approx(UNROUNDED["nist"], rel=1e-9)


def test_without_java_meteor_is_left_out_and_rouge_and_cider_say_what_stood_in(no_java, capsys):
    scored = score_files(REFS, HYPS)
    metrics = scored.scores.metrics
    assert set(metrics) == {"bleu", "nist", "rouge_l", "cider"}
    for name in NO_JAVA_METRICS:
        assert metrics[name] == pytest.approx(UNROUNDED[name], rel=1e-9)
    # nltk's tokens stand in for the PTB tokenizer's: close to the official numbers, and labelled as such.
    for name in ("rouge_l", "cider"):
        assert metrics[name] == pytest.approx(UNROUNDED[name], rel=0.03)
        assert "INSTEAD of coco-caption's PTBTokenizer (no `java` on PATH)" in scored.scores.implementations[name]
    assert scored.scores.unavailable["meteor"] == "METEOR 1.5 needs Java: no `java` on PATH"
    assert len(scored.scores.notes) == 1 and "ROUGE-L and CIDEr on nltk's tokens" in scored.scores.notes[0]

    assert main(["nlg-score", "--refs", str(REFS), "--hyps", str(HYPS)]) == 0
    out = capsys.readouterr().out
    assert f"BLEU: {PRINTED['bleu']}" in out and f"NIST: {PRINTED['nist']}" in out
    assert "METEOR: not computed (METEOR 1.5 needs Java: no `java` on PATH)" in out
    assert "note: Java unavailable (no `java` on PATH)" in out
    assert main(["nlg-score", "--refs", str(REFS), "--hyps", str(HYPS), "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["java"] is None and "meteor" not in payload["metrics"] and "meteor" in payload["unavailable"]


def test_a_java_that_does_not_run_counts_as_none(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "java"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Error: could not create the Java Virtual Machine.' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    java = nlg_metrics.java_runtime()
    assert not java.available and java.path == str(fake)
    assert "exited 1" in java.reason and "could not create the Java Virtual Machine" in java.reason


@needs_java
def test_java_is_found_with_its_version():
    java = nlg_metrics.java_runtime()
    assert java.available and java.path == shutil.which("java") and "version" in java.version


# --------------------------------------------------------------------------- the script's file formats

def test_references_are_grouped_by_blank_lines_as_the_script_reads_them(tmp_path):
    refs = read_references(REFS)
    assert [len(group) for group in refs] == [6, 1, 3, 4, 2, 5, 3, 6, 4, 2, 5, 3]
    outputs = read_outputs(HYPS)
    assert len(outputs) == 12 and outputs[9] == "" and outputs[8] == "Cocum coffee"  # a blank line: empty output
    path = tmp_path / "refs.txt"
    path.write_text("  A b.  \nC d.\n\nE f.\n\n\n")  # stripped lines; blank lines at the end ignored
    assert read_references(path) == [["A b.", "C d."], ["E f."]]
    path.write_text("A b.\nC d.\nE f.\n")  # no blank line at all: one reference per instance (the script's rule)
    assert read_references(path) == [["A b."], ["C d."], ["E f."]]
    hyps = tmp_path / "hyps.txt"
    hyps.write_text("one\n\nthree\n\n")  # the last blank line is an output too, as in the script
    assert read_outputs(hyps) == ["one", "", "three", ""]


def test_an_e2e_csv_of_references_groups_consecutive_mrs(tmp_path):
    path = tmp_path / "refs.csv"
    path.write_text('mr,ref\n"name[A]","A costs Â£20."\n"name[A]","Cheap A."\n"name[B]","B, a cafÃ©."\n'
                    '"name[A]","A again."\n', encoding="utf-8")
    # Consecutive rows with one MR are one instance (a later repeat is another), mis-encoded £/é repaired.
    assert read_references(path) == [["A costs £20.", "Cheap A."], ["B, a café."], ["A again."]]


@pytest.mark.parametrize("refs_text,hyps_text,message", [
    ("A.\n\nB.\n", "a\nb\nc\n", "3 outputs but 2 instances of references"),
    ("", "a\n", "references file is empty"),
    ("A.\n", "", "outputs file is empty"),
    ("\n\n", "a\n", "references file holds only blank lines"),
    ("A.\n\n\nB.\n", "a\nb\n", "instance 2 has no reference"),
    ("\nA.\n\nB.\n", "a\nb\n", "instance 1 has no reference"),
    (b"A.\xff\n", "a\n", "references file is not valid UTF-8"),
    (None, "a\n", "references file not found"),
    ("A.\n", None, "outputs file not found"),
])
def test_bad_files_exit_2_with_one_line(tmp_path, capsys, refs_text, hyps_text, message):
    refs, hyps = tmp_path / "refs.txt", tmp_path / "hyps.txt"
    for path, text in ((refs, refs_text), (hyps, hyps_text)):
        if isinstance(text, bytes):
            path.write_bytes(text)
        elif text is not None:
            path.write_text(text)
    assert main(["nlg-score", "--refs", str(refs), "--hyps", str(hyps)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("peftlab: error: ") and message in captured.err
    named = hyps if "outputs file" in message else refs
    assert str(named) in captured.err


def test_a_folder_is_not_a_file(tmp_path):
    with pytest.raises(PeftlabError, match="is a folder"):
        read_outputs(tmp_path)


def test_nlg_score_is_listed_and_needs_both_files(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["nlg-score", "--refs", str(REFS)])
    assert exit_info.value.code == 2 and "--hyps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "nlg-score" in capsys.readouterr().out
