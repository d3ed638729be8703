"""Everything a user can get wrong in the core raises PeftlabError with a one-line message naming the bad value."""

from __future__ import annotations

import math

import pytest
import torch

from peftlab.errors import PeftlabError
from peftlab.methods.table import METHODS, MethodConfig, apply_method
from peftlab.models.registry import load_model, resolve_source
from peftlab.methods.optim_groups import OptimConfig
from peftlab.methods.targets import parse_targets


pytestmark = pytest.mark.usefixtures("single_thread")


def message_of(call, *args, **kwargs) -> str:
    with pytest.raises(PeftlabError) as err:
        call(*args, **kwargs)
    message = str(err.value)
    assert message.strip(), "empty error message"
    assert "\n" not in message, f"not one line: {message!r}"
    return message


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize("call", [load_model, resolve_source], ids=["load_model", "resolve_source"])
def test_unknown_model(call):
    message = message_of(call, "no-such-model")
    assert "unknown model 'no-such-model'" in message
    assert "minilm-l6" in message  # says what would work


def test_unknown_model_suggests_closest():
    assert "did you mean 'minilm-l6'" in message_of(resolve_source, "minilm-l7")


def test_unknown_head():
    message = message_of(load_model, "tiny-bert", head="tagging")
    assert "'tagging'" in message and "classification" in message


def test_unknown_method():
    message = message_of(MethodConfig, method="lorra")
    assert "unknown method 'lorra'" in message and "--method" in message
    assert "did you mean 'lora'" in message
    for name in METHODS:
        assert name in message  # lists the choices


@pytest.mark.parametrize("targets", ["q,x", ("q", "x"), "q, X"])
def test_unknown_projection(targets):
    message = message_of(MethodConfig, targets=targets)
    assert "unknown projection 'x'" in message and "--targets" in message


def test_unknown_projection_parse_targets():
    assert "'x'" in message_of(parse_targets, "q,x")


@pytest.mark.parametrize("targets", ["", ",", ()])
def test_no_projection(targets):
    assert "--targets" in message_of(MethodConfig, targets=targets)


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("rank", [0, -1])
def test_rank_not_positive(rank):
    message = message_of(MethodConfig, rank=rank)
    assert f"--rank must be a positive integer, got {rank}" in message


@pytest.mark.parametrize("rank", [2.5, "8", True])
def test_rank_not_integer(rank):
    message = message_of(MethodConfig, rank=rank)
    assert "--rank" in message and str(rank) in message


SVD_METHODS = [name for name, m in METHODS.items() if m.svd_init]


def test_svd_methods_include_pissa_milora_kasa():
    assert {"pissa", "milora", "kasa"} <= set(SVD_METHODS)


def _calibration(model, method: str) -> dict:
    """``calibration=`` a one-example pass, for methods whose init needs one (CorDA)."""
    if not getattr(METHODS[method], "needs_calibration", False):
        return {}
    ids = torch.arange(1, 41).reshape(1, 40) % 127 + 1

    @torch.no_grad()
    def run():
        model.eval()
        model(input_ids=ids, attention_mask=torch.ones_like(ids))

    return {"calibration": run}


@pytest.mark.parametrize("method", SVD_METHODS)
@pytest.mark.parametrize("model_type,targets,limit", [("bert", ("q", "v"), 32), ("llama", ("q", "k"), 16)])
def test_rank_too_large_for_svd_init(method, model_type, targets, limit, tiny_model):
    # tiny BERT's projections are 32 x 32; tiny Llama's k is 32 -> 16 (GQA), so the limit there is 16
    for rank in (limit, limit + 5):
        message = message_of(apply_method, tiny_model(model_type), MethodConfig(method=method, targets=targets, rank=rank))
        assert f"--rank {rank}" in message and method in message and f"= {limit}" in message
    model = tiny_model(model_type)  # the boundary, rank = min - 1, is accepted
    apply_method(model, MethodConfig(method=method, targets=targets, rank=limit - 1), **_calibration(model, method))


def test_rank_above_min_is_fine_for_lora(tiny_model):
    apply_method(tiny_model("llama"), MethodConfig(method="lora", targets=("q", "k"), rank=16))


BAD = [0.0, -1.0, math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("value", BAD, ids=str)
@pytest.mark.parametrize("field,flag", [("lr", "--lr"), ("lr_ratio", "--lr-ratio"), ("head_lr", "--head-lr")])
def test_optim_numbers(field, flag, value):
    message = message_of(OptimConfig, **{field: value})
    assert f"{flag} must be" in message and str(value) in message


@pytest.mark.parametrize("field,flag", [("lr", "--lr"), ("lr_ratio", "--lr-ratio")])
def test_optim_not_a_number(field, flag):
    message = message_of(OptimConfig, **{field: "fast"})
    assert flag in message and "'fast'" in message


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0])
def test_weight_decay(value):
    assert "--weight-decay" in message_of(OptimConfig, weight_decay=value)


@pytest.mark.parametrize("value", BAD, ids=str)
def test_alpha(value):
    message = message_of(MethodConfig, alpha=value)
    assert "--alpha must be" in message and str(value) in message


@pytest.mark.parametrize("field,flag,value", [
    ("dropout", "--dropout", math.nan),
    ("dropout", "--dropout", 1.0),
    ("kasa_beta", "--kasa-beta", -1e-4),
    ("kasa_gamma", "--kasa-gamma", math.inf),
    ("kasa_reduction", "--kasa-reduction", "median"),
    ("fourierft_n_frequency", "--fourierft-n-frequency", 0),
    ("fourierft_scaling", "--fourierft-scaling", math.nan),
])
def test_other_method_numbers(field, flag, value):
    message = message_of(MethodConfig.from_dict, {field: value})  # flat names: kasa_beta is cfg.kasa.beta
    assert flag in message and str(value) in message


def test_valid_configs_pass():
    OptimConfig(lr=2e-4, lr_ratio=8, head_lr=1e-3, weight_decay=0.01)
    MethodConfig(method="KaSA", targets="v,q", rank=1, alpha=1e-3)
    assert MethodConfig(targets="v,q").targets == ("q", "v")
