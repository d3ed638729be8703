"""The lean install: ``pip install peftlab`` trains without any extra, and a command whose extra is missing says
which one to install, in one line, exit 2, before any work (:mod:`peftlab.extras`).

A missing extra is simulated in a fresh interpreter whose ``sys.modules`` holds None for its modules, as an
interpreter without them would behave (``tests/lean_site/sitecustomize.py``, when ``PEFTLAB_TEST_BLOCK`` names
modules); at exit it reports which of ``PEFTLAB_TEST_WATCH``'s modules were imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import DATA_DIR, REPO, needs_data
from peftlab import extras

LEAN_SITE = Path(__file__).resolve().parent / "lean_site"
EXTRA_MODULES = tuple(m for name in ("judge", "nlg", "tune", "track") for m in extras.EXTRAS[name])
TINY_RTE = ["train", "--task", "rte", "--model", "tiny-bert", "--method", "lora", "--targets", "q,v", "--rank", "2",
            "--epochs", "1", "--max-train-samples", "8", "--max-eval-samples", "8", "--max-length", "16",
            "--batch-size", "8", "--threads", "1"]


def run_commands(commands: list[list[str]], *, block: tuple[str, ...], cwd: Path) -> tuple[list[dict], list]:
    """Each ``peftlab`` command line in one fresh interpreter with ``block``'s modules refused: its exit code and
    stderr lines; and which of the extras' modules were imported."""
    code = ("import contextlib, io, json, sys\nfrom peftlab.cli.main import main\nout = []\n"
            f"for argv in {commands!r}:\n"
            "    err = io.StringIO()\n"
            "    with contextlib.redirect_stderr(err):\n"
            "        status = main(argv)\n"
            "    out.append({'code': status, 'err': err.getvalue().strip().splitlines()})\n"
            "print('\\nCOMMANDS=' + json.dumps(out))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(LEAN_SITE), str(REPO / "src")]),
           "PEFTLAB_TEST_BLOCK": ",".join(block), "PEFTLAB_TEST_WATCH": ",".join(EXTRA_MODULES),
           "PEFTLAB_DATA_DIR": str(DATA_DIR), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=cwd,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    commands_json = proc.stdout.rpartition("\nCOMMANDS=")[2].splitlines()[0]
    watched = json.loads(proc.stderr.rpartition("\nWATCHED=")[2].splitlines()[0])
    return json.loads(commands_json), watched


@needs_data("glue", "RTE", "train.tsv")
def test_train_with_no_extra_installed_trains_and_imports_none_of_them(tmp_path):
    """As after `pip install .`: every extra's modules refused; the default --report-to auto then tracks nothing."""
    (result,), watched = run_commands([TINY_RTE + ["--output-dir", "run"]], block=EXTRA_MODULES, cwd=tmp_path)
    assert result["code"] == 0, result["err"]
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    assert record["status"] in ("ok", "no_learning") and record["final"]["metrics"]  # 8 examples: trained, evaluated
    assert not (tmp_path / "run" / "tb").exists()
    assert watched == []


@needs_data("glue", "RTE", "train.tsv")
def test_train_imports_no_extra_even_where_they_are_installed(tmp_path):
    (result,), watched = run_commands([TINY_RTE + ["--output-dir", "run", "--report-to", "none"]], block=(),
                                      cwd=tmp_path)
    assert result["code"] == 0, result["err"]
    assert watched == []


def test_the_watch_sees_an_import_and_the_block_refuses_one():
    """The checks above are able to fail: an imported extra is seen; a refused one cannot be imported and is not
    installed for peftlab."""
    def child(code: str, block: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(LEAN_SITE), str(REPO / "src")]),
                                   "PEFTLAB_TEST_BLOCK": block, "PEFTLAB_TEST_WATCH": "optuna,nltk"})

    seen = child("import optuna", "")
    assert seen.returncode == 0 and 'WATCHED=["optuna"]' in seen.stderr
    refused = child("from peftlab.extras import installed\nassert not installed('optuna')\nimport optuna", "optuna")
    assert refused.returncode == 1 and "ModuleNotFoundError: import of optuna halted" in refused.stderr


def one_line_naming(result: dict, extra: str) -> str:
    assert result["code"] == 2 and len(result["err"]) == 1, result
    line = result["err"][0]
    assert f'pip install "peftlab[{extra}]"' in line, line
    return line


@needs_data("glue", "RTE", "train.tsv")
@needs_data("e2e", "devset.csv")
def test_each_command_without_its_extra_names_it_in_one_line(tmp_path):
    (tmp_path / "refs.txt").write_text("a cheap cafe\n")
    (tmp_path / "hyps.txt").write_text("a cheap cafe\n")
    (tmp_path / "tune.yaml").write_text("base: {model: tiny-bert, task: rte}\n")
    commands = {
        "judge": ["serve-judge", "--model", "tiny-llama", "--port", "0"],
        "nlg": ["nlg-score", "--refs", "refs.txt", "--hyps", "hyps.txt"],
        "tune": ["tune", "tune.yaml"],
        "track": TINY_RTE + ["--report-to", "tensorboard", "--output-dir", "tb-run"],
        "e2e": ["train", "--task", "e2e", "--model", "tiny-llama", "--max-train-samples", "4",
                "--max-eval-samples", "2", "--output-dir", "e2e-run"],
    }
    results, watched = run_commands(list(commands.values()), block=EXTRA_MODULES, cwd=tmp_path)
    lines = {name: one_line_naming(result, "nlg" if name == "e2e" else name)
             for name, result in zip(commands, results)}
    assert lines["judge"].startswith("peftlab: error: peftlab serve-judge needs the 'judge' extra (fastapi, uvicorn)")
    assert "peftlab nlg-score needs the 'nlg' extra (sacrebleu, nltk, pycocoevalcap)" in lines["nlg"]
    assert "peftlab tune needs the 'tune' extra (optuna)" in lines["tune"]
    assert "preflight extra: --report-to tensorboard needs the 'track' extra (tensorboard)" in lines["track"]
    assert "preflight extra: --task e2e" in lines["e2e"]
    assert not any((tmp_path / run).exists() for run in ("tb-run", "e2e-run"))  # refused before any work
    assert watched == []


@needs_data("mt_bench", "question.jsonl")
@needs_data("alpaca", "alpaca_data_1k.json")
def test_mt_bench_judging_without_the_judge_extra_is_one_line(tmp_path):
    command = ["train", "--task", "mt-bench", "--model", "tiny-llama", "--judge-url", "http://127.0.0.1:9/v1",
               "--judge-model", "judge", "--judge-api-key-env", "HOME", "--output-dir", "run"]
    (result,), _ = run_commands([command], block=("openai",), cwd=tmp_path)
    assert "preflight extra: MT-Bench judging (--judge-url) needs the 'judge' extra (openai)" in \
        one_line_naming(result, "judge")


def test_every_extra_named_by_the_table_is_declared_and_the_test_extra_holds_tools_only():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(declared)
    assert {dep.split(">")[0].split("=")[0].split("<")[0] for dep in declared["test"]} == \
        {"pytest", "pytest-xdist", "jsonschema"}
    core = " ".join(project["dependencies"])
    for module in EXTRA_MODULES:
        assert module not in core, f"{module} is an extra's, not a core dependency"
    assert extras.tracker("none") == "none" and extras.tracker("wandb") == "wandb"


def test_installed_treats_a_refusing_finder_as_missing(monkeypatch):
    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name == "json":
                raise ModuleNotFoundError(name)
            return None

    monkeypatch.setitem(sys.modules, "json", None)  # as a module removed from the interpreter
    assert not extras.installed("json")
    monkeypatch.delitem(sys.modules, "json")
    monkeypatch.setattr(sys, "meta_path", [Refuse(), *sys.meta_path])
    assert not extras.installed("json") and extras.installed("csv")
    with pytest.raises(extras.PeftlabError, match=r'--report-to tensorboard needs the .track. extra'):
        monkeypatch.setattr(extras, "installed", lambda module: module != "tensorboard")
        extras.require("--report-to tensorboard")
