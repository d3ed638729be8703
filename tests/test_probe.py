"""``peftlab probe``: per-block Hessian eigenvalues against a closed form, the probe's blocks against the optimizer
groups of the run it mirrors (every method), and its one-line refusals (bad input, the missing extra)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import needs_data
from peftlab.cli.main import main
from peftlab.config import TrainConfig, build_config
from peftlab.methods.table import METHODS

pytestmark = pytest.mark.usefixtures("single_thread")


def has_curvlinops() -> bool:
    try:
        import curvlinops  # noqa: F401
    except ImportError:
        return False
    return True


needs_extra = pytest.mark.skipif(not has_curvlinops(), reason="the probe extra (curvlinops) is not installed: "
                                                                "scripts/setup.sh installs it")


# --------------------------------------------------------------------------- a Hessian known in closed form


class TwoBlockLinear(torch.nn.Module):
    """y = a . x_a + b . x_b: with the squared loss its Hessian is (2/N) X^T X, block a on x_a, block b on x_b."""

    def __init__(self, d_a: int, d_b: int):
        super().__init__()
        self.a = torch.nn.Linear(d_a, 1, bias=False)
        self.b = torch.nn.Linear(d_b, 1, bias=False)

    def forward(self, x_a, x_b):
        return (self.a(x_a) + self.b(x_b)).squeeze(-1)


def squared_loss(model, batch):
    return ((model(batch["x_a"], batch["x_b"]) - batch["y"]) ** 2).mean()


def linear_batches(d_a: int, d_b: int, scale_a: float, scale_b: float, n: int = 48, count: int = 3):
    generator = torch.Generator().manual_seed(3)
    return [{"x_a": scale_a * torch.randn(n, d_a, generator=generator),
             "x_b": scale_b * torch.randn(n, d_b, generator=generator),
             "y": torch.randn(n, generator=generator)} for _ in range(count)]


def closed_form_top(batch, which: str, scale: np.ndarray | None = None) -> float:
    x = torch.cat([batch["x_a"], batch["x_b"]], dim=1).double().numpy()
    hessian = 2 / len(x) * x.T @ x
    if scale is not None:
        hessian = scale[:, None] * hessian * scale[None, :]
    d_a = batch["x_a"].shape[1]
    part = {"q": hessian[:d_a, :d_a], "v": hessian[d_a:, d_a:], "all": hessian}[which]
    return float(np.linalg.eigvalsh(part)[-1])


@needs_extra
@pytest.mark.parametrize("scales", [(1.0, 3.0), (2.0, 0.5)])
def test_block_eigenvalues_match_the_closed_form_hessian_and_order_the_blocks(scales):
    from peftlab.training.probe import ProbeOptions, block_results, measure, probe_blocks, suggested_lambda

    d_a, d_b = 6, 9
    model = TwoBlockLinear(d_a, d_b)
    groups = [{"name": "q", "params": [model.a.weight], "param_names": ["a.weight"], "weight_decay": 0.0},
              {"name": "v", "params": [model.b.weight], "param_names": ["b.weight"], "weight_decay": 0.0}]
    params, blocks = probe_blocks(groups)
    assert [b.name for b in blocks] == ["q", "v", "all"]
    batches = linear_batches(d_a, d_b, *scales)
    preconditioner = torch.linspace(0.5, 2.0, d_a + d_b)  # any positive diagonal: S H S
    solves = measure(model, squared_loss, params, blocks, batches, ProbeOptions(), scale=preconditioner,
                     kinds=("raw", "preconditioned"))
    for kind, scale in (("raw", None), ("preconditioned", preconditioner.double().numpy())):
        results = block_results(blocks, solves[kind], "raw_init")
        for name in ("q", "v", "all"):
            expected = np.mean([closed_form_top(b, name, scale) for b in batches])
            assert results[name]["lambda_max"]["mean"] == pytest.approx(expected, rel=0.01), (kind, name)
            assert results[name]["lambda_max"]["std"] > 0  # three batches, three Hessians
        if kind == "raw":  # the larger input scale is the sharper block, and lambda follows it
            sharper = "v" if scales[1] > scales[0] else "q"
            assert max(("q", "v"), key=lambda n: results[n]["lambda_max"]["mean"]) == sharper
            assert suggested_lambda(results) == pytest.approx(
                results["q"]["lambda_max"]["mean"] / results["v"]["lambda_max"]["mean"])
            assert (suggested_lambda(results) < 1) == (sharper == "v")


# --------------------------------------------------------------------------- the run's own groups, every method


def tiny_cfg(tmp_path, method: str) -> TrainConfig:
    return build_config(TrainConfig, overrides=dict(
        task="rte", model="tiny-bert", method=method, targets="q,v", rank=4, epochs=1, batch_size=4,
        max_length=32, max_train_samples=16, max_eval_samples=8, output_dir=str(tmp_path / method),
        fourierft_n_frequency=40, corda_samples=4, kasa_beta=0.01, kasa_gamma=0.01))


def test_the_probe_resolves_its_config_once(tmp_path, monkeypatch):
    import dataclasses

    from peftlab.resolve import resolve_config
    from peftlab.training import probe as probe_module

    cfg = tiny_cfg(tmp_path, "lora")
    cfg = dataclasses.replace(cfg, mixed_precision="bf16", compile="on")
    resolved = resolve_config(cfg)  # `peftlab probe`: resolved at its entry, as train's is
    expected = resolve_config(dataclasses.replace(cfg, mixed_precision="no", compile="off")).to_dict()
    monkeypatch.setattr(probe_module, "resolve_config", lambda *a, **k: pytest.fail("resolved a second time"))
    variant = probe_module.probe_config(resolved)
    assert variant.resolved and variant.to_dict() == expected  # fp32, eager; equal to resolving the copy afresh
    assert (variant.mixed_precision, variant.compile) == ("no", "off")
    assert (resolved.mixed_precision, resolved.compile) == ("bf16", "on")  # the caller's config is untouched
    with pytest.raises(BaseException, match="resolved a second time"):  # an unresolved one is resolved here
        probe_module.probe_config(cfg)


def optimizer_membership(run) -> dict[str, set[str]]:
    """Group name -> parameter names, read off the torch optimizer a training run steps."""
    names = {id(p): n for n, p in run.accelerator.unwrap_model(run.model).named_parameters()}
    membership: dict[str, set[str]] = {}
    for group in run.optimizer.param_groups:
        membership.setdefault(group["name"], set()).update(names[id(p)] for p in group["params"])
    return membership


@needs_extra
@needs_data("glue", "RTE")
@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_probe_measures_the_optimizer_groups_of_the_run_it_mirrors(tmp_path, method):
    from peftlab.training.probe import ProbeOptions, probe
    from peftlab.resolve import resolve_config
    from peftlab.training.setup import setup

    cfg = tiny_cfg(tmp_path, method)
    result = probe(cfg, ProbeOptions(batches=1, adam_steps=1))
    run = setup(resolve_config(cfg), "fresh")  # the training run itself (resolved at its entry): its AdamW
    expected = optimizer_membership(run)
    blocks = {b["name"]: set(b["tensors"]) for b in result["blocks"]}
    assert {name: blocks[name] for name in expected} == expected
    assert blocks["all"] == set().union(*expected.values())
    shapes = dict(run.accelerator.unwrap_model(run.model).named_parameters())
    for name in set(blocks) - set(expected) - {"all"}:  # the vector tensors of an adapted projection's group
        group, _, kind = name.partition(":")
        assert kind == "vectors" and blocks[name] < expected[group]
        assert blocks[name] == {n for n in expected[group] if shapes[n].dim() < 2}
    from peftlab.training.probe_cli import render

    table = render(result)
    assert all(f"  {name} " in table for name in blocks) and "validation (docs/RESULTS.md)" in table
    if method == "kasa":  # KaSA's singular values are the method's own block
        assert all("lora_diag" in n for n in blocks["q:vectors"] | blocks["v:vectors"])
    for kind in ("raw_init", "raw_after_adam", "preconditioned"):
        assert set(result["kinds"][kind]) == set(blocks)
        for row in result["kinds"][kind].values():  # a value, or eigsh said it did not converge (never a guess)
            assert (row["lambda_max"] is None) == (row["converged"] == 0)
            assert row["lambda_max"] is None or np.isfinite(row["lambda_max"]["mean"])
        if kind != "preconditioned":  # raw curvature converges on every block
            assert all(row["converged"] == row["batches"] for row in result["kinds"][kind].values())


# --------------------------------------------------------------------------- the command line


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def exit_status(argv: list[str]) -> int:
    """``peftlab ARGV``'s exit status, whether main returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as done:
        return done.code


@pytest.mark.parametrize("argv", [
    ["--task", "sstt2"],
    ["--task", "stsb", "--rank", "-1"],
    ["--task", "stsb", "--lr", "fast"],
    ["--task", "stsb", "--method", "lora", "--kasa-beta", "0.1"],
    ["--task", "stsb", "--targets", "q,x"],
    ["--task", "stsb", "--config", "missing.yaml"],
])
def test_bad_run_input_is_trains_one_line_refusal(argv, capsys):
    assert main(["train", *argv]) == 2
    train_lines = error_lines(capsys)
    assert main(["probe", *argv]) == 2
    probe_lines = error_lines(capsys)
    assert len(probe_lines) == 1 and probe_lines[0].startswith("peftlab: error: ")
    assert probe_lines == train_lines


@pytest.mark.parametrize("argv", [
    ["--task", "stsb", "--probe-batches", "0"],
    ["--task", "stsb", "--probe-adam-steps", "-2"],
    ["--task", "stsb", "--probe-batchez", "2"],
])
def test_bad_probe_options_are_one_line(argv, capsys):
    assert exit_status(["probe", *argv]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("peftlab: error: ")


def test_without_the_extra_the_probe_says_which_extra_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "curvlinops", None)  # `import curvlinops` raises ImportError
    assert main(["probe", "--task", "stsb", "--model", "tiny-bert"]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1
    assert "'probe'" in lines[0] and "curvlinops-for-pytorch" in lines[0] and "--no-deps" in lines[0]


# --------------------------------------------------------------------------- the validation's reader


def test_the_grid_check_fits_the_constant_and_places_lambda_against_the_grid():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # research code beside the package
    from probe_check import Cell, best_region, fit_constant, placement

    assert fit_constant([(1e-3, 40.0), (4e-3, 10.0)]) == pytest.approx(0.04)  # both pairs say c = 0.04
    assert fit_constant([(1e-3, 10.0), (1e-2, 10.0)]) == pytest.approx(10 ** -1.5)  # least squares in log rate
    cells = {(lr, r): Cell(lr, r, [score, score + 2], failed) for lr, r, score, failed in [
        (1e-3, 1.0, 30.0, 0), (5e-4, 2.0, 29.0, 0), (1e-3, 4.0, 40.0, 1), (5e-4, 4.0, 10.0, 0), (1e-3, 8.0, 5.0, 0)]}
    region, profile, threshold = best_region(cells)  # best trained cell 31 ± 1.4; a failed seed never counts
    assert region == [1.0, 2.0] and threshold == pytest.approx(31 - np.std([30, 32], ddof=1))
    grid = [1.0, 2.0, 4.0, 8.0]
    assert placement(1.2, region, grid) == "yes" and placement(0.75, region, grid) == "yes"  # half a step
    assert placement(4.0, region, grid) == "no"
    assert placement(0.5, region, grid).startswith("no: below the grid")
    assert placement(20.0, region, grid) == "no: above the grid"
