"""Fake results stores for the `peftlab plot` tests: runs with chosen values, statuses, step-level curves and
KaSA sigmas, written through the real Store (so records, keys and statuses are what a sweep writes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peftlab.resolve import build_run_config
from peftlab.lab.records import load_rows
from peftlab.lab.store import Store

STEPS_PER_EPOCH = 4


def config(**overrides) -> dict:
    base = dict(model="tiny-bert", task="rte", method="lora", epochs=2)
    return build_run_config(overrides={**base, **overrides}).to_dict()


def curve_of(points: list[float], metric: str, *, evals_per_epoch: int = 2) -> list[dict]:
    """result.json "curve": ``points`` evaluated every STEPS_PER_EPOCH / evals_per_epoch optimizer steps."""
    every = STEPS_PER_EPOCH // evals_per_epoch
    return [{"step": every * (i + 1), "epoch": (i + 1) / evals_per_epoch, "metrics": {metric: value}}
            for i, value in enumerate(points)]


def result_of(cfg: dict, value: float, *, status: str = "ok", metric: str = "accuracy",
              curve: list[float] | None = None, epoch_values: list[float] | None = None, **extra) -> dict:
    """A result.json: ``value`` at the best epoch; ``epoch_values`` (default: ramps up to ``value``) in
    epochs_log; ``curve`` (values at each half epoch) as the step-level curve, when given."""
    epochs = int(cfg["epochs"])
    epoch_values = epoch_values or [value - 0.03 * (epochs - e) for e in range(1, epochs + 1)]
    result = {
        "schema_version": 1, "status": status, "status_reason": None if status == "ok" else status,
        "task": cfg["task"], "method": cfg["method"], "seed": cfg["seed"], "config": cfg, "primary_metric": metric,
        "epochs_log": [{"epoch": e, "train_loss": 0.7 - 0.1 * e, "metrics": {metric: v}, "seconds": 1.0}
                       for e, v in zip(range(1, epochs + 1), epoch_values)],
        "best": {"epoch": epochs, "metrics": {metric: value}}, "final": {"metrics": {metric: value}},
        "before": None, "epochs_run": epochs,
        "trainable_params": {"adapter": 100 * cfg["rank"], "head": 66, "total": 100 * cfg["rank"] + 66},
    }
    if curve is not None:
        result["curve"] = curve_of(curve, metric)
    result.update(extra)
    return result


def make_store(path: Path, runs: list[dict]) -> list[dict]:
    """A store of ``runs`` (each: config overrides, ``value``, optional ``status``, ``metric``, ``curve``,
    ``epoch_values``, ``result``: extra result.json keys); returns its rows as `peftlab plot` loads them."""
    with Store(path) as store:
        for run in runs:
            run = dict(run)
            value, status = run.pop("value"), run.pop("status", "ok")
            metric, curve = run.pop("metric", "accuracy"), run.pop("curve", None)
            epoch_values, extra = run.pop("epoch_values", None), run.pop("result", {})
            cfg = config(**run)
            if status == "failed":
                store.add(cfg, status="failed", error="RuntimeError: boom")
                continue
            store.add(cfg, result=result_of(cfg, value, status=status, metric=metric, curve=curve,
                                            epoch_values=epoch_values, **extra))
    return load_rows([path])


@pytest.fixture(autouse=True)
def close_figures():
    """Every figure a test draws is closed after it, whatever its assertions did (pyplot keeps them otherwise)."""
    yield
    import matplotlib.pyplot as plt

    plt.close("all")
