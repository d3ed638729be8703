"""Logs a person can read: without a terminal (CI, nohup, a sweep's worker) progress is one line per epoch
(train) or per finished run (sweep), never a progress bar redrawn with carriage returns."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import yaml

from conftest import DATA_DIR, needs_data

ENV = {**os.environ, "PEFTLAB_DATA_DIR": str(DATA_DIR), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "OMP_NUM_THREADS": "1"}
TINY = {"model": "tiny-bert", "task": "rte", "max_train_samples": 48, "max_eval_samples": 16, "max_length": 32,
        "batch_size": 8, "rank": 4, "report_to": "none"}


def run_logged(tmp_path, *args: str) -> str:
    """The command's stdout and stderr as a file holds them (neither is a terminal)."""
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        done = subprocess.run([sys.executable, "-m", "peftlab.cli.main", *args], stdout=handle,
                              stderr=subprocess.STDOUT, env=ENV, cwd=tmp_path)
    text = log.read_text()
    assert done.returncode == 0, text[-2000:]
    return text


@needs_data("glue", "RTE", "train.tsv")
def test_a_train_log_holds_one_line_per_epoch_and_no_redrawn_bar(tmp_path):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    text = run_logged(tmp_path, "train", *flags, "--epochs", "3", "--output-dir", str(tmp_path / "run"))
    assert "\r" not in text
    epoch_lines = [line for line in text.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epoch_lines] == ["epoch 1", "epoch 2", "epoch 3"]


@needs_data("glue", "RTE", "train.tsv")
def test_a_sweep_log_holds_one_line_per_finished_run_and_no_redrawn_bar(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"output_dir": "runs/logs", "base": {**TINY, "epochs": 1},
                                    "grid": {"seed": [0, 1, 2]}}))
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        proc = subprocess.Popen([sys.executable, "-m", "peftlab.cli.main", "sweep", str(spec), "--workers", "1"], stdout=handle,
                                stderr=subprocess.STDOUT, env=ENV, cwd=tmp_path)
        deadline = time.monotonic() + 300
        while proc.poll() is None and "\nrun " not in "\n" + log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        # each run's line is written when the run ends: the first one shows alone, not with the others at exit
        seen_first = sum(line.startswith("run ") for line in log.read_text().splitlines())
        assert proc.wait(timeout=300) == 0, log.read_text()[-2000:]
    text = log.read_text()
    assert seen_first == 1, text[-2000:]
    assert "\r" not in text
    finished = [line for line in text.splitlines() if line.startswith("run ")]
    assert len(finished) == 3, text[-2000:]
    assert "sweep:" not in text  # the bar (desc "sweep") is never drawn into a log
