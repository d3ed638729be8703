"""The training loop under `accelerate launch` with 2 CPU processes (DDP over gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_two_process_ddp_on_cpu(tmp_path):
    out = tmp_path / "ddp"
    # ACCELERATE_USE_CPU makes Accelerate set up MULTI_CPU (gloo) for the processes its launcher starts.
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    accelerate = Path(sys.executable).with_name("accelerate")
    proc = subprocess.run(
        [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "peftlab.cli.main", "train",
         "--model", "tiny-bert", "--task", "mrpc", "--method", "kasa", "--max-train-samples", "64",
         "--max-eval-samples", "41", "--max-length", "32", "--batch-size", "8", "--epochs", "2",
         "--output-dir", str(out)],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["status"] in ("ok", "no_learning")  # trained to its end (a tiny model need not learn)
    assert result["num_processes"] == 2
    assert result["train_examples"] == 64 * 2  # each process saw half of every epoch
    assert proc.stdout.count(f"status={result['status']}") == 1  # one summary, from rank 0
    # gather_for_metrics drops the padding duplicates: 41 eval examples give metrics over exactly 41
    accuracy = result["final"]["metrics"]["accuracy"]
    assert round(accuracy * 41) == pytest.approx(accuracy * 41, abs=1e-9)
