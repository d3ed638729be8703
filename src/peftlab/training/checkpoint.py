"""Checkpoints through Accelerate's ``save_state`` / ``load_state``: the trainable tensors only (the frozen base is
rebuilt by setup), optimizer, scheduler, grad scaler and every process's RNG; peftlab adds the loop state
(``state.json``, ``state_<rank>.json``), ``--save best``'s weights and the atomic swap: every process writes into
``.checkpoint-new/``, which process 0 then swaps in, so a kill at any moment leaves a complete checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from peftlab.errors import PeftlabError
from peftlab.io_utils import json_default
from peftlab.training import run_folder as runfiles
from peftlab.training.state import LoopState

TRAINABLE_FILE = "trainable.safetensors"
BEST_WEIGHTS = "best.safetensors"


def state_file(process_index: int) -> str:
    """The loop state's file of one process: state.json for process 0 (the marker of a complete checkpoint)."""
    return runfiles.CHECKPOINT_MARKER if process_index == 0 else f"state_{process_index}.json"


def trainable_tensors(model, *, copy: bool = False) -> dict:
    """The tensors that train, on the CPU; ``copy``: never sharing memory with the live parameters."""
    return {n: (p.detach().cpu().clone() if copy else p.detach().cpu()).contiguous()
            for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model, path: Path) -> None:
    """Copy a checkpoint's trainable tensors into ``model``; refused when they are another model's."""
    from safetensors.torch import load_file

    unknown = model.load_state_dict(load_file(str(path)), strict=False).unexpected_keys  # the trainable tensors
    if unknown:
        raise PeftlabError(f"checkpoint in {path.parent} does not match this run's model ({unknown[0]} missing)",
                           fix="resume with the same config, or pass --overwrite to start over")


def save_only_trainable(accelerator) -> None:
    """Make ``save_state`` / ``load_state`` write and read the trainable tensors in place of the whole state
    dict (the frozen base is most of a model's bytes, and setup rebuilds it)."""
    from safetensors.torch import save_file

    def save(models, weights, output_dir):
        if accelerator.is_main_process:
            tensors = {}
            for model in models:
                tensors.update(trainable_tensors(accelerator.unwrap_model(model)))
            save_file(tensors, str(Path(output_dir) / TRAINABLE_FILE))
        weights.clear()  # Accelerate writes no model file of its own ...

    def load(models, input_dir):
        for model in models:
            load_trainable(accelerator.unwrap_model(model), Path(input_dir) / TRAINABLE_FILE)
        models.clear()  # ... and reads none

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def save_checkpoint(run) -> None:
    """Write the run's checkpoint (every process takes part: each saves its RNG and loop state)."""
    from safetensors.torch import save_file

    accelerator, staging = run.accelerator, run.out / runfiles.CHECKPOINT_NEW
    if run.main:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))
    loop_state = json.dumps(run.state.to_dict(), default=json_default)
    (staging / state_file(accelerator.process_index)).write_text(loop_state)
    if run.main and run.best_weights:
        save_file({n: t.contiguous() for n, t in run.best_weights.items()}, str(staging / BEST_WEIGHTS))
    accelerator.wait_for_everyone()
    if run.main:
        swap_in(run.out)
    accelerator.wait_for_everyone()


def swap_in(output_dir: Path) -> None:
    """``.checkpoint-new`` becomes ``checkpoint``; at every moment a complete ``checkpoint`` or
    ``.checkpoint-old`` exists (:func:`peftlab.training.run_folder.checkpoint_dir` takes it)."""
    new, final, old = (output_dir / name for name in
                       (runfiles.CHECKPOINT_NEW, runfiles.CHECKPOINT, runfiles.CHECKPOINT_OLD))
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


@dataclass(frozen=True)
class Restored:
    """What a checkpoint gives back beyond the accelerator's objects (restored in place)."""

    state: LoopState  # this process's loop state
    best_weights: dict | None  # --save best: the best epoch's trainable tensors


def load_checkpoint(run) -> Restored:
    """Restore model, optimizer, scheduler, scaler and this process's RNG in place; return its loop state."""
    from safetensors.torch import load_file

    ckpt, accelerator = runfiles.checkpoint_dir(run.out), run.accelerator
    check_process_count(ckpt, accelerator.num_processes)
    accelerator.load_state(str(ckpt))
    check_rng_restored(ckpt, accelerator.process_index)
    name = state_file(accelerator.process_index)
    state = LoopState.from_dict(json.loads((ckpt / name).read_text()), where=str(ckpt / name))
    best = ckpt / BEST_WEIGHTS
    return Restored(state, load_file(str(best)) if best.is_file() else None)


def check_process_count(ckpt: Path, num_processes: int) -> None:
    """A checkpoint resumes with the processes that wrote it: each has its RNG, loop state and data shard."""
    from accelerate.utils import RNG_STATE_NAME

    written = len(list(ckpt.glob(f"{RNG_STATE_NAME}_*.pkl")))
    if not written:  # an older peftlab's checkpoint, or one cut short: nothing to restore the random streams from
        raise PeftlabError(f"the checkpoint in {ckpt} has no random state (not one written by Accelerate's "
                           "save_state)", fix="pass --overwrite to start over")
    if written != num_processes:
        raise PeftlabError(f"the checkpoint in {ckpt} was written by {written} process(es), this run has "
                           f"{num_processes}", fix="resume with the same accelerate launch --num_processes, "
                           "or pass --overwrite to start over")


def check_rng_restored(ckpt: Path, process_index: int) -> None:
    """Accelerate's load_state only logs a random state it could not restore: a resumed run would then train
    on another random stream (dropout) without a word. Refused instead."""
    from accelerate.utils import RNG_STATE_NAME, load

    saved = load(ckpt / f"{RNG_STATE_NAME}_{process_index}.pkl")
    if not torch.equal(saved["torch_manual_seed"], torch.get_rng_state()):
        raise PeftlabError(f"the random state of process {process_index} in {ckpt} was not restored",
                           fix="resume with the accelerate version that wrote it, or pass --overwrite")
