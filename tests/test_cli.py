"""The `peftlab` entry point: subcommands are imported only when they run, so `peftlab --help`, `peftlab models`
and `peftlab methods` start without torch; every row of the subcommand table registers the parser it names."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys

import pytest

from peftlab.cli.main import SUBCOMMANDS, build_parser, chosen_command

HEAVY = ("torch", "transformers", "peft", "accelerate", "datasets")


def heavy_modules_after(statement: str) -> tuple[list[str], str]:
    """Run ``statement`` in a fresh interpreter; the heavy libraries it imported, and what it printed."""
    code = (f"import sys, json\n{statement}\n"
            f"print('\\nHEAVY=' + json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    out, _, heavy = proc.stdout.rpartition("\nHEAVY=")
    return json.loads(heavy), out


def test_building_the_top_level_parser_imports_no_torch():
    heavy, out = heavy_modules_after("from peftlab.cli.main import build_parser\n"
                                     "print(build_parser([]).format_help())")
    assert heavy == []
    for entry in SUBCOMMANDS:
        assert entry.name in out  # listed with its help line, without importing its module


def test_peftlab_help_exits_0_without_torch():
    heavy, out = heavy_modules_after("from peftlab.cli.main import main\n"
                                     "try:\n    main(['--help'])\nexcept SystemExit as stop:\n"
                                     "    assert stop.code == 0, stop.code")
    assert heavy == [] and "usage: peftlab" in out


def test_peftlab_models_imports_no_torch():
    heavy, out = heavy_modules_after("from peftlab.cli.main import main\nassert main(['models', '--json']) == 0")
    assert heavy == []
    names = [row["name"] for row in json.loads(out)]
    assert "minilm-l6" in names and "tiny-bert" in names


def test_peftlab_methods_imports_no_torch():
    heavy, out = heavy_modules_after("from peftlab.cli.main import main\nassert main(['methods']) == 0")
    assert heavy == []
    assert "lora" in out and "kasa" in out


def test_only_the_chosen_subcommand_is_imported():
    # the assertions run in the child: report's module is loaded, no other subcommand's
    heavy_modules_after("from peftlab.cli.main import build_parser\nbuild_parser(['report', 'x.sqlite'])\n"
                        "assert 'peftlab.lab.report' in sys.modules\n"
                        "assert not any(m in sys.modules for m in ('peftlab.training.loop', 'peftlab.lab.sweep', "
                        "'peftlab.lab.plot', 'peftlab.cli.bench_moved'))")


def test_subcommand_names_are_unique():
    names = [entry.name for entry in SUBCOMMANDS]
    assert len(names) == len(set(names))


def test_chosen_command_is_the_first_word_that_is_not_a_flag():
    assert chosen_command(["--version"]) is None
    assert chosen_command(["train", "--lr", "1e-4"]) == "train"
    assert chosen_command(["-h", "report", "x.sqlite"]) == "report"


@pytest.mark.parametrize("entry", SUBCOMMANDS, ids=lambda e: e.name)  # a row whose module is missing fails here
def test_every_subcommand_registers_the_parser_its_row_names(entry):
    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    getattr(importlib.import_module(entry.module), entry.register)(sub)
    assert entry.name in sub.choices
    parser = sub.choices[entry.name]
    assert parser.get_default("func") is not None  # running it does something
    full = build_parser([entry.name])  # the entry point gives the chosen command its full parser
    chosen = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction)).choices[entry.name]
    assert chosen.get_default("func") is not None


@pytest.mark.parametrize("argv, fix", [
    # a value its declaration refuses while parsing: that check's own fix, once
    (["study", "kasa", "--task", "stsb", "--targets", "q,x", "--dry-run"],
     "fix: use one of: down, gate, k, o, q, up, v"),
    # argparse's own refusal (no fix of its own): the subcommand's --help
    (["sweep", "--workers", "x"], "fix: see `peftlab sweep --help`"),
])
def test_a_parse_error_is_one_line_with_one_fix(argv, fix, capsys):
    from peftlab.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.count("fix:") == 1 and err.endswith(fix), err
