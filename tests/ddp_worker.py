"""Test-only program for `accelerate launch`: ``peftlab train`` in each process, plus what a test of every rank
needs (tests/test_ddp.py).

    accelerate launch ... tests/ddp_worker.py [--exit-after-checkpoint N] <peftlab train arguments>

Each process writes ``rank<k>.safetensors`` (its trainable tensors after the last step, before ``--save best``
puts the best epoch's back) and ``rank<k>.json`` (its own result: epochs_log with its own train losses, final
metrics) into the run folder. ``--exit-after-checkpoint N``: every process ends (``os._exit``, no cleanup, like a
kill) right after the mid-epoch checkpoint at optimizer step N is complete.

Every rank draws its own random stream once setup is done (a fresh run only; a resumed one gets its streams
from the checkpoint). peftlab seeds all ranks alike, and on a CPU dropout takes one seed per call whatever the
tensor's size, so the ranks' streams would otherwise stay equal, and a resume that gave every rank process 0's
RNG state (as peftlab's checkpoints did before Accelerate's save_state) could not be told from a right one.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    import torch

    from peftlab.cli.main import main as peftlab
    from peftlab.training import fit, loop
    from peftlab.training.checkpoint import trainable_tensors

    if argv[:1] == ["--exit-after-checkpoint"]:
        exit_at, argv = int(argv[1]), argv[2:]
        real_checkpoint = fit.checkpoint

        def checkpoint(run):
            real_checkpoint(run)
            if run.state.optimizer_steps == exit_at and run.state.step_in_epoch:
                os._exit(3)

        fit.checkpoint = checkpoint
    real_setup, real_finish = loop.setup, loop.finish

    def setup(cfg, mode):
        run = real_setup(cfg, mode)
        if mode != "resume":  # from here on each rank draws its own dropout masks (see the module doc)
            torch.manual_seed(1000 + run.accelerator.process_index)
        return run

    def finish(run):
        from safetensors.torch import save_file

        weights = trainable_tensors(run.accelerator.unwrap_model(run.model), copy=True)
        result = real_finish(run)
        rank = run.accelerator.process_index
        save_file(weights, str(run.out / f"rank{rank}.safetensors"))
        mine = {key: result[key] for key in ("epochs_log", "final", "best", "optimizer_steps", "train_examples")}
        (run.out / f"rank{rank}.json").write_text(json.dumps(mine, default=str))
        return result

    loop.setup, loop.finish = setup, finish
    return peftlab(["train", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
