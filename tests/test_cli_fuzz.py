"""Every option of every subcommand, fed hostile values: one line and exit 2, never a traceback, nothing written.

The options are read from the parsers the CLI builds (``build_parser``), not listed here, so an option added
later is fuzzed too. Each option's bad values follow from its declaration: a ``TrainConfig`` field's type, choices
and range (:mod:`peftlab.config_roles`), else the argparse action's type, choices and metavar. Every case runs
``main(argv)`` in process, in an empty working folder, with the other arguments valid, and with the heavy entry
points (model and tokenizer loading, training, serving) replaced by a trip wire: a bad value must
be refused while the arguments are checked, before any of that starts.
"""

from __future__ import annotations

import argparse
import os
import typing
from pathlib import Path

import pytest
import yaml

from conftest import DATA_DIR
from peftlab.cli.main import SUBCOMMANDS, build_parser, main
from peftlab.config import TrainConfig
from peftlab.config_roles import File, Folder, Range, Text, choices_of, hints, kind_of, options

# The subcommands issue 25 names: each must be fuzzed (the others are too, when they have options).
REQUIRED = ("train", "evaluate", "predict", "export", "sweep", "tune", "report", "plot", "serve-judge")

# Options for which no value is wrong, and why (a switch takes no value; free text is any text).
NO_BAD_VALUE = {
    ("plot", "--title"): "free text: any title, the empty one included, is a title",
    ("bench", "words"): "moved to benchmarks/: any words get the one line pointing there (tests/test_bench.py)",
}


# --------------------------------------------------------------------------- inputs the valid arguments use


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Valid inputs for the arguments that are not fuzzed, outside the working folder (and checked unchanged)."""
    root = tmp_path_factory.mktemp("inputs")
    run = root / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"model": "tiny-bert", "task": "rte", "method": "lora"}))
    texts = root / "texts.jsonl"
    texts.write_text('{"sentence1": "a", "sentence2": "b"}\n')
    spec = {"description": "fuzz", "base": {"model": "tiny-bert", "task": "rte", "epochs": 1}, "grid": {"seed": [0]}}
    (root / "sweep.yaml").write_text(yaml.safe_dump(spec))
    tune = {"description": "fuzz", "base": {"model": "tiny-bert", "task": "rte", "epochs": 1},
            "search": {"lr_ratio": [1, 2]}, "budget": {"epochs": 40}}
    (root / "tune.yaml").write_text(yaml.safe_dump(tune))
    from peftlab.lab.store import Store
    from peftlab.resolve import build_run_config

    with Store(root / "store" / "results.sqlite") as store:
        for seed, lr, lr_ratio in [(s, lr, r) for s in (0, 1) for lr in (1e-3, 2e-3) for r in (1.0, 2.0)]:
            cfg = build_run_config(overrides={"model": "tiny-bert", "task": "rte", "seed": seed, "lr": lr,
                                              "lr_ratio": lr_ratio}).to_dict()
            store.add(cfg, result={"schema_version": 1, "status": "ok", "status_reason": None, "task": "rte",
                                   "method": "lora", "seed": seed, "config": cfg, "primary_metric": "accuracy",
                                   "best": {"epoch": 1, "metrics": {"accuracy": 0.6}},
                                   "final": {"metrics": {"accuracy": 0.6}}, "before": None,
                                   "trainable_params": {"adapter": 10, "head": 2, "total": 12}})
    (root / "refs.txt").write_text("a b c\n")
    (root / "hyps.txt").write_text("a b c\n")
    (root / "not-text.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")  # a file of the wrong format
    (root / "a-folder").mkdir()
    (root / "read-only").mkdir()
    (root / "read-only").chmod(0o555)  # a folder nobody but root may write in
    return {"root": root, "run": run, "texts": texts, "sweep": root / "sweep.yaml", "tune": root / "tune.yaml",
            "store": root / "store" / "results.sqlite", "refs": root / "refs.txt", "hyps": root / "hyps.txt"}


def valid_arguments(command: tuple[str, ...], inputs: dict[str, Path]) -> list[str]:
    """The argv of ``command`` with every required argument valid (the fuzzed option is appended to it)."""
    i = {k: str(v) for k, v in inputs.items()}
    return {
        ("train",): ["train", "--model", "tiny-bert", "--task", "rte"],
        ("probe",): ["probe", "--model", "tiny-bert", "--task", "rte"],
        ("evaluate",): ["evaluate", i["run"]],
        ("predict",): ["predict", i["run"], "--input", i["texts"], "--output", "out.jsonl"],
        ("export",): ["export", i["run"], "--merged", "merged"],
        ("sweep",): ["sweep", i["sweep"], "--dry-run", "--output-dir", "sweep-out"],
        ("tune",): ["tune", i["tune"], "--dry-run", "--output-dir", "tune-out"],
        ("study",): ["study", "kasa", "--task", "rte", "--dry-run", "--output-dir", "study-out"],
        ("store", "check"): ["store", "check", i["store"]],
        ("report",): ["report", i["store"]],
        ("plot",): ["plot", i["store"], "--kind", "heatmap", "--out", "figure.png"],
        ("serve-judge",): ["serve-judge", "--model", "tiny-bert"],
        ("nlg-score",): ["nlg-score", "--refs", i["refs"], "--hyps", i["hyps"]],
    }[command]


# --------------------------------------------------------------------------- the options, from the parsers


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield path, action


def every_option() -> list[tuple[tuple[str, ...], argparse.Action]]:
    """(subcommand path, action) of every argument of every subcommand, from the parsers ``main`` builds."""
    found = []
    for entry in SUBCOMMANDS:
        found += [(path, action) for path, action in _walk(build_parser([entry.name]), ()) if path[:1] == (entry.name,)]
    return found


def name_of(action: argparse.Action) -> str:
    return action.option_strings[0] if action.option_strings else action.dest


def switch(action: argparse.Action) -> bool:
    return action.nargs == 0  # store_true, --x/--no-x: the flag is the value


# --------------------------------------------------------------------------- bad values, from the declarations

# Paths are written under INPUTS, the folder of valid inputs (the `inputs` fixture), filled in when a case runs.
INPUTS = "<inputs>"
MISSING_FILE, MISSING_FOLDER = f"{INPUTS}/missing.txt", f"{INPUTS}/missing"
A_FILE, A_FOLDER, NOT_TEXT = f"{INPUTS}/texts.jsonl", f"{INPUTS}/a-folder", f"{INPUTS}/not-text.bin"
# Path-shaped values (issue 38): below a regular file, a name longer than any Linux filesystem allows (255 bytes),
# and (for what is written) inside a read-only folder. An OSError from any of them is one line too.
UNDER_A_FILE, TOO_LONG = f"{A_FILE}/below.txt", f"{INPUTS}/{'n' * 300}.txt"
READ_ONLY = f"{INPUTS}/read-only/new"
IN_PATH = [UNDER_A_FILE, TOO_LONG]
OUT_PATH = [UNDER_A_FILE, TOO_LONG, READ_ONLY]
BEYOND_INT64 = [str(2**63), str(2**64)]  # no count, size or seed of torch, numpy or the tokenizers takes these
BLANK = ["", " "]


def _range_values(check: Range, integer: bool) -> list[str]:
    """Just outside each declared bound (the bound itself when it is open)."""
    out = []
    for bound, is_open, step in ((check.low, check.low_open, -1), (check.high, check.high_open, 1)):
        if bound is not None:
            bound = int(bound) if integer else bound
            out.append(str(bound if is_open else bound + step * (1 if integer else 0.5)))
    return out


def declared_values(flat: str) -> list[str]:
    """Bad values of TrainConfig option ``flat`` (its flag), from its type, choices and declared check."""
    where = options(TrainConfig)[flat]
    spec = where.owner.__dataclass_fields__[where.name]
    hint = hints(where.owner)[where.name]
    check, kind, choices = spec.metadata.get("check"), kind_of(hint), choices_of(hint)
    if choices is not None:
        return ["nope", *BLANK]
    if kind is tuple:  # a comma list of choices: one unknown among known ones, nothing but commas
        first = typing.get_args(typing.get_args(hint)[0])[0]
        return [f"{first},nope", ",", "nope"]
    if kind is int:
        return ["abc", "1.5", "nan", "½", *BLANK, *_range_values(check or Range(), True), *BEYOND_INT64]
    if kind is float:
        return ["abc", "nan", "inf", "-inf", "1e", *BLANK, *_range_values(check or Range(), False)]
    if isinstance(check, File):
        return [MISSING_FILE, A_FOLDER, *IN_PATH]
    if isinstance(check, Folder):  # missing; a file where a folder goes
        return [*([MISSING_FOLDER] if check.exists else []), A_FILE, *(IN_PATH if check.exists else OUT_PATH)]
    if isinstance(check, Text):
        return [*BLANK, *(["not-it"] if check.pattern else [])]
    if flat == "layers":
        return ["x", "3-1", "-1", str(2**64)]
    raise AssertionError(f"--{flat}: no bad values for its type {hint}; add them to declared_values")


# argparse options that name files or folders, by what they must be (their type is plain text).
PATHS = {
    "in-file": {"--config", "--input", "--render", "spec", "--spec", "store", "stores"},
    "in-folder": {"run_dir", "--adapter", "--data-dir"},
    "out-file": {"--out", "--output", "--store", "--probe-out"},
    "out-folder": {"--merged", "--output-dir", "--out-dir"},
}


# argparse ``type=`` functions (peftlab.argtypes and the builtins) by the numbers they read
# (report's `decimals`, 0-15, and `nonnegative_float`, e.g. --gpus-per-run 0, refuse all of these values too)
INTEGER_TYPES = {"int", "positive_int", "nonnegative_int", "seed", "_threads", "decimals"}
FLOAT_TYPES = {"float", "positive_float", "nonnegative_float"}


def argparse_values(action: argparse.Action) -> list[str]:
    """Bad values of a plain argparse option, from its type, choices, metavar and the kind of path it names."""
    name = name_of(action)
    if action.choices:
        return ["nope", ""]
    kind = getattr(action.type, "__name__", None)
    if kind in INTEGER_TYPES:
        return ["abc", "", "1.5", "-1", *BEYOND_INT64]
    if kind in FLOAT_TYPES:
        return ["abc", "", "nan", "inf", "-inf", "-1"]
    if kind == "Path" or name in PATHS["in-file"]:
        return [MISSING_FILE, A_FOLDER, NOT_TEXT, *IN_PATH]
    if name in PATHS["in-folder"]:
        return [MISSING_FOLDER, A_FILE, *IN_PATH]
    if name in PATHS["out-file"]:
        return [A_FOLDER, "", *OUT_PATH]
    if name in PATHS["out-folder"]:
        return [A_FILE, "", *OUT_PATH]
    if action.metavar == "K=V,...":
        return ["novalue", "=x", "nope=1", ","]
    if action.metavar == "A-B,C":
        return ["x", "5-2", "-1", ","]
    return BLANK  # text: empty or whitespace


def _cases() -> list[tuple[tuple[str, ...], str, str, bool]]:
    """(subcommand path, option name, bad value, positional?) for every option that has bad values."""
    out = []
    for path, action in every_option():
        name = name_of(action)
        if switch(action) or (path[0], name) in NO_BAD_VALUE:
            continue
        # probe takes train's flags through train's parsing, study its chosen ones typed by their declarations
        # (add_dataclass_flags with `only`: the type is named after the option): the same declared bad values
        from_declaration = action.dest in options(TrainConfig) and (
            path in (("train",), ("probe",)) or getattr(action.type, "__name__", None) == action.dest)
        for value in declared_values(action.dest) if from_declaration else argparse_values(action):
            out.append((path, name, value, not action.option_strings))
    return out


CASES = _cases()


def argv_of(path: tuple[str, ...], name: str, value: str, positional: bool, inputs: dict[str, Path]) -> list[str]:
    value = value.replace(INPUTS, str(inputs["root"]))
    argv = valid_arguments(path, inputs)
    if positional:  # in place of the valid one
        valid = {"run_dir": inputs["run"], "spec": inputs["sweep" if path == ("sweep",) else "tune"],
                 "store": inputs["store"], "stores": inputs["store"], "study_kind": "kasa"}[name]
        return [value if arg == str(valid) else arg for arg in argv]
    return [*argv, f"{name}={value}"]  # `=`: a value that starts with '-' is still the option's value


# --------------------------------------------------------------------------- the trip wire


class HeavyWorkStarted(BaseException):  # not an Exception: no handler of the product's may swallow it
    pass


HEAVY = ("peftlab.models.registry:load_model", "peftlab.models.registry:load_model_with_pooling",
         "peftlab.models.registry:load_tokenizer", "peftlab.training.loop:train", "peftlab.training.probe:probe",
         "peftlab.tasks.judge_server:start_judge_server")


@pytest.fixture
def trip_wire(monkeypatch):
    import importlib

    def wire(target):
        def tripped(*args, **kwargs):
            raise HeavyWorkStarted(target)
        return tripped

    for target in HEAVY:
        module, attr = target.split(":")
        monkeypatch.setattr(importlib.import_module(module), attr, wire(target))


def _snapshot(folder: Path) -> dict[str, int | None]:
    """Every path under ``folder`` and each file's modification time (a store's: None, reading one opens it)."""
    return {str(p.relative_to(folder)): None if p.is_dir() or ".sqlite" in p.name else p.stat().st_mtime_ns
            for p in sorted(folder.rglob("*")) if not p.name.endswith(("-wal", "-shm"))}


# --------------------------------------------------------------------------- the tests


def test_the_options_are_found_from_the_parsers():
    found = {(path[0], name) for path, name, _, _ in CASES}
    commands = {command for command, _ in found}
    assert set(REQUIRED) <= commands, set(REQUIRED) - commands
    assert len(found) >= 200, len(found)  # 268 arguments in all, of which 58 are switches
    assert len(CASES) >= 800, len(CASES)
    print(f"\n{len(CASES)} (subcommand, option, value) cases over {len(found)} options of {len(commands)} "
          "subcommands")


@pytest.mark.parametrize(("path", "name", "value", "positional"), CASES,
                         ids=[f"{' '.join(p)} {n}={(v if len(v) < 80 else v[:60] + '...')!r}"
                              for p, n, v, _ in CASES])
def test_a_bad_value_is_one_line_exit_2_before_anything_runs(path, name, value, positional, inputs, tmp_path,
                                                            monkeypatch, capsys, trip_wire):
    if value == READ_ONLY and os.geteuid() == 0:
        pytest.skip("running as root, which may write in a read-only folder: this case needs a non-root user (the "
                    "below-a-file and name-too-long cases of the same option run as root too)")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PEFTLAB_DATA_DIR", str(DATA_DIR))  # the preflight finds the valid runs' data from anywhere
    before = _snapshot(inputs["root"])
    argv = argv_of(path, name, value, positional, inputs)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own errors
        code = stop.code
    except HeavyWorkStarted as tripped:
        pytest.fail(f"{argv}: accepted, and {tripped} started")
    err = capsys.readouterr().err.strip()
    assert code == 2, (code, err[-2000:])
    assert len(err.splitlines()) == 1 and err.startswith("peftlab"), err[-2000:]
    assert "Traceback" not in err
    shown = value.replace(INPUTS, str(inputs["root"])).strip()
    assert any(flag in err for flag in (name, name.replace("_", "-"))) or (shown and shown in err), \
        f"the line names neither {name} nor the value: {err}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "written in the working folder"
    assert _snapshot(inputs["root"]) == before, "an input changed"
