"""Fault injection for tests, kept out of the product: the loop has no switch for it.

In a test: ``inject_nan_at_step(monkeypatch, 3)`` wraps :func:`peftlab.training.step.forward_loss` so that the
objective of global step 3 (0-based: the fourth batch) is NaN, exactly what a diverging run produces; the
divergence guard must then stop the run.

In a subprocess (the CLI's exit status): run this file as the program, ``python tests/faults.py --nan-at-step
N train ...``; it installs the same wrapper and runs ``peftlab`` with the remaining arguments.
"""

from __future__ import annotations

import dataclasses
import sys


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
