"""`peftlab report` and `peftlab plot` read run records only: on a results store and on run folders they run
without importing torch (or any other training library), as docs/ARCHITECTURE.md promises for lab readers.
Each command runs in a fresh interpreter (this one has torch already), through the CLI's own ``main``.

So do the drivers of `peftlab sweep` and `peftlab tune` when the train function is not peftlab's (runs that
train in workers or on Ray): the runner claims, reads run folders and records without the training libraries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _plot_helpers import config, make_store, result_of

TESTS = Path(__file__).resolve().parent
HEAVY = ("torch", "transformers", "peft", "accelerate", "datasets")
GRID = [dict(lr=lr, lr_ratio=ratio, seed=seed) for lr in (1e-4, 4e-4) for ratio in (1.0, 4.0) for seed in (0, 1)]


def value_of(run: dict) -> float:
    return 0.6 + 100 * run["lr"] + 0.01 * run["lr_ratio"] + 0.001 * run["seed"]


def store_of(tmp_path: Path) -> list[str]:
    make_store(tmp_path / "sweep" / "results.sqlite",
               [dict(run, value=value_of(run), curve=[0.55, 0.6, value_of(run)]) for run in GRID])
    return [str(tmp_path / "sweep")]


def run_folders_of(tmp_path: Path) -> list[str]:
    """Folders as `peftlab train` leaves them: config.yaml first, result.json last."""
    folders = []
    for i, run in enumerate(GRID):
        cfg = config(**run, output_dir=str(tmp_path / "runs" / str(i)))
        folder = Path(cfg["output_dir"])
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(cfg))
        (folder / "result.json").write_text(json.dumps(result_of(cfg, value_of(run), curve=[0.55, 0.6, 0.7])))
        folders.append(str(folder))
    return folders


def commands(paths: list[str], out: Path) -> dict[str, list[str]]:
    return {"report": ["report", *paths, "--format", "md"],
            "plot": ["plot", *paths, "--kind", "lr-grid", "--out", str(out / "grid.png")],
            "plot curves": ["plot", *paths, "--kind", "curves", "--out", str(out / "curves.svg")]}


def heavy_after_cli(argv: list[str], before: str = "") -> tuple[list[str], str]:
    """Run ``before`` then ``peftlab ARGV`` in process in a fresh interpreter; the heavy libraries loaded by then,
    and what it printed."""
    code = (f"import json, sys\n{before}\nfrom peftlab.cli.main import main\n"
            f"status = main({argv!r})\n"
            f"print('\\nAFTER=' + json.dumps([status, [m for m in {HEAVY!r} if m in sys.modules]]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore", "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stderr
    out, _, after = proc.stdout.rpartition("\nAFTER=")
    status, heavy = json.loads(after)
    assert status == 0, proc.stdout + proc.stderr
    return heavy, out


@pytest.mark.parametrize("source", [store_of, run_folders_of], ids=["store", "run folders"])
@pytest.mark.parametrize("command", ["report", "plot", "plot curves"])
def test_readers_leave_torch_unimported(tmp_path, source, command):
    argv = commands(source(tmp_path), tmp_path)[command]
    heavy, out = heavy_after_cli(argv)
    assert heavy == [], f"peftlab {command} imported {heavy}"
    if command == "report":
        assert out.count(" (2) ") == len(GRID) // 2  # it did read the runs: every lr x lr_ratio cell, two seeds
    else:
        assert Path(argv[argv.index("--out") + 1]).stat().st_size > 0


def test_the_check_sees_torch(tmp_path):
    """Able to fail: the same report, in an interpreter that imported torch first."""
    heavy, _ = heavy_after_cli(commands(store_of(tmp_path), tmp_path)["report"], before="import torch")
    assert heavy == ["torch"]



@pytest.mark.parametrize("command", ["sweep", "tune"])
def test_a_driver_whose_runs_train_elsewhere_leaves_torch_unimported(tmp_path, command):
    """The fake train function of test_tune.py stands for the workers: it writes run folders like peftlab's."""
    base = {"model": "tiny-bert", "task": "rte", "epochs": 2}
    spec = tmp_path / f"{command}.yaml"
    if command == "sweep":
        spec.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "runs"), "base": base,
                                        "grid": {"lr_ratio": [1, 2]}}))
    else:
        spec.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "runs"), "base": base,
                                        "search": {"lr_ratio": [1, 2]}, "budget": {"grid_fraction": 1.0},
                                        "seeds": 2, "top_k": 1, "heldout_seeds": 0}))
    before = (f"sys.path.insert(0, {str(TESTS)!r})\nimport peftlab.lab.runner as runner\n"
              "runner.DEFAULT_TRAIN = 'test_tune:fake_train'")
    heavy, out = heavy_after_cli([command, str(spec)], before=before)
    assert heavy == [], f"peftlab {command}'s driver imported {heavy}"
    assert (tmp_path / "runs" / "results.sqlite").is_file() and "ok" in out  # it did run and record them
