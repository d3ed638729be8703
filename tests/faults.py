"""Fault injection for tests, kept out of the product: the loop has no switch for it.

In a test: ``inject_nan_at_step(monkeypatch, 3)`` wraps :func:`peftlab.training.step.forward_loss` so that the
objective of global step 3 (0-based: the fourth batch) is NaN, exactly what a diverging run produces; the
divergence guard must then stop the run.

In a subprocess (the CLI's exit status): run this file as the program, ``python tests/faults.py --nan-at-step
N train ...``; it installs the same wrapper and runs ``peftlab`` with the remaining arguments.

A worker killed mid-run (the OOM killer, a lost node): pass ``train_fn="faults:fake_train_killed"`` (the tune
tests' fake) or ``"faults:train_killed"`` (peftlab's loop) with :data:`KILL_ENV` set to ``EPOCH:MARKER``: the
first run to end epoch EPOCH SIGKILLs its own process, once (it creates MARKER first). The variable starts with
``PEFTLAB_``, so the Ray backend forwards it to its workers like the rest of peftlab's environment.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path

KILL_ENV = "PEFTLAB_TEST_KILL_AFTER_EPOCH"


def _kill_hook():
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return None
    epoch_text, _, marker = spec.partition(":")
    marker_path = Path(marker)

    def hook(end) -> None:
        if end.epoch != int(epoch_text):
            return None
        marker_path.parent.mkdir(parents=True, exist_ok=True)
        try:  # O_EXCL: of runs reaching the epoch together, exactly one dies
            fd = os.open(marker_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return None
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
        return None

    return hook


def _then_kill(on_epoch_end):
    kill = _kill_hook()
    if kill is None:
        return on_epoch_end

    def hook(end):
        answer = on_epoch_end(end) if on_epoch_end is not None else None  # a tune's pruning answer is kept
        kill(end)
        return answer

    return hook


def fake_train_killed(cfg, on_epoch_end=None) -> dict:
    from test_tune import fake_train

    return fake_train(cfg, on_epoch_end=_then_kill(on_epoch_end))


def train_killed(cfg, on_epoch_end=None) -> dict:
    from peftlab.training.loop import train

    return train(cfg, on_epoch_end=_then_kill(on_epoch_end))


def poisoned_forward(real, step: int):
    """``forward_loss`` whose objective is NaN at global step ``step``."""

    def forward_loss(run, batch):
        objective = real(run, batch)
        if run.state.global_step == step:
            return dataclasses.replace(objective, total=objective.total * float("nan"))
        return objective

    return forward_loss


def inject_nan_at_step(monkeypatch, step: int) -> None:
    import peftlab.training.step as step_module

    monkeypatch.setattr(step_module, "forward_loss", poisoned_forward(step_module.forward_loss, step))


def main(argv: list[str]) -> int:
    import peftlab.training.step as step_module
    from peftlab.cli.main import main as peftlab

    if argv[:1] != ["--nan-at-step"] or len(argv) < 2:
        raise SystemExit("usage: faults.py --nan-at-step N <peftlab arguments>")
    step_module.forward_loss = poisoned_forward(step_module.forward_loss, int(argv[1]))
    return peftlab(argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
