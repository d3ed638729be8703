"""The training loop under `accelerate launch` with 2 CPU processes (DDP over gloo).

One test, three launches (each costs two processes' imports): the uninterrupted run is both the reference of the
resume and the check of a plain DDP run (sharded epochs, one summary, metrics over exactly the eval set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def launch(script_args: list[str], env: dict) -> subprocess.CompletedProcess:
    accelerate = Path(sys.executable).with_name("accelerate")
    worker = Path(__file__).with_name("ddp_worker.py")  # peftlab train, plus what each rank trained
    return subprocess.run(
        [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", str(worker), *script_args],
        capture_output=True, text=True, env=env, timeout=600)


def untimed(result: dict) -> dict:
    """A rank's result without the epochs' wall times (the one thing a resumed run may differ in)."""
    return {**result, "epochs_log": [{k: v for k, v in e.items() if k != "seconds"} for e in result["epochs_log"]]}


@pytest.mark.slow
def test_ddp_resume_from_a_mid_epoch_checkpoint_equals_uninterrupted_on_both_ranks(tmp_path):
    """Killed after the checkpoint at optimizer step 6 (mid-epoch 2 of 2: 4 steps per epoch, 2 ranks of 4
    batches) and resumed: every rank ends with the uninterrupted run's weights, its own train losses and the
    metrics. Each rank's RNG (dropout) and loop state come back from its own files in the checkpoint. KaSA, whose
    regularizer reads the adapted layers through the DDP wrapper."""
    from accelerate.utils import load
    from safetensors.torch import load_file

    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    args = ["--model", "tiny-bert", "--task", "rte", "--method", "kasa", "--dropout", "0.1", "--max-train-samples",
            "64", "--max-eval-samples", "41", "--max-length", "32", "--batch-size", "8", "--epochs", "2",
            "--report-to", "none"]
    reference, out = tmp_path / "reference", tmp_path / "killed"
    done = launch([*args, "--output-dir", str(reference)], env)
    assert done.returncode == 0, done.stderr[-3000:]
    plain = json.loads((reference / "result.json").read_text())
    assert plain["status"] in ("ok", "no_learning") and plain["num_processes"] == 2
    assert plain["train_examples"] == 64 * 2  # each process saw half of every epoch
    assert done.stdout.count(f"status={plain['status']}") == 1  # one summary, from rank 0
    # gather_for_metrics drops the padding duplicates: 41 eval examples give metrics over exactly 41
    accuracy = plain["final"]["metrics"]["accuracy"]
    assert round(accuracy * 41) == pytest.approx(accuracy * 41, abs=1e-9)
    killed = launch(["--exit-after-checkpoint", "6", *args, "--checkpoint-every", "3", "--output-dir", str(out)], env)
    assert killed.returncode != 0 and not (out / "result.json").exists(), killed.stderr[-3000:]
    ckpt = out / "checkpoint"
    states = [json.loads((ckpt / name).read_text()) for name in ("state.json", "state_1.json")]
    assert [(s["epoch"], s["step_in_epoch"], s["optimizer_steps"]) for s in states] == [(1, 2, 6)] * 2
    assert (ckpt / "best.safetensors").is_file()  # epoch 1 was the best so far: --save best keeps it
    # what makes per-process restoring matter: the ranks' random streams (ddp_worker.py) and loss sums differ
    rngs = [load(ckpt / f"random_states_{rank}.pkl")["torch_manual_seed"] for rank in (0, 1)]
    assert not torch.equal(*rngs) and states[0]["epoch_loss_sum"] != states[1]["epoch_loss_sum"]
    resumed = launch([*args, "--checkpoint-every", "3", "--output-dir", str(out), "--resume"], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at epoch 2, step 2" in resumed.stdout
    for rank in (0, 1):
        mine, expected = (untimed(json.loads((run / f"rank{rank}.json").read_text())) for run in (out, reference))
        assert mine == expected, f"rank {rank}: {mine} != {expected}"
        weights = load_file(str(out / f"rank{rank}.safetensors"))
        reference_weights = load_file(str(reference / f"rank{rank}.safetensors"))
        assert weights.keys() == reference_weights.keys()
        assert all(torch.equal(weights[k], reference_weights[k]) for k in weights), f"rank {rank}'s weights differ"
    first = json.loads((out / "rank0.json").read_text())["epochs_log"]
    second = json.loads((out / "rank1.json").read_text())["epochs_log"]
    assert [e["train_loss"] for e in first] != [e["train_loss"] for e in second]  # each rank's own losses
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    expected_adapter = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(adapter[k], expected_adapter[k]) for k in adapter)
    assert json.loads((out / "result.json").read_text())["optimizer_steps"] == 8
