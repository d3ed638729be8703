"""The lab tests' fake results are held to result.schema.json: the check that completes them also rejects them."""

from __future__ import annotations

import jsonschema
import pytest

from fake_results import checked
from peftlab.resolve import build_run_config


def fake(**changes) -> dict:
    cfg = build_run_config(overrides=dict(model="tiny-bert", task="rte", epochs=1)).to_dict()
    result = {"schema_version": 1, "status": "ok", "status_reason": None, "task": "rte", "seed": cfg["seed"],
              "config": cfg, "primary_metric": "accuracy", "majority_baseline": 0.5,
              "best": {"epoch": 1, "metrics": {"accuracy": 0.6}}, "final": {"metrics": {"accuracy": 0.6}},
              "trainable_params": {"adapter": 10, "head": 2, "total": 12}}
    result.update(changes)
    return result


def test_a_complete_fake_passes_with_placeholders_that_claim_nothing():
    result = checked(fake())
    assert result["code"]["commit"] is None and result["git_commit"] is None
    assert result["train_seconds"] == 0.0 and result["epochs_run"] == 1 and result["curve"] == []
    assert result["method"] == "lora" and result["targets"] == "q,v"


@pytest.mark.parametrize("field", ["majority_baseline", "primary_metric", "best", "trainable_params"])
def test_a_fake_missing_a_required_field_is_rejected(field):
    result = fake()
    del result[field]
    with pytest.raises(jsonschema.ValidationError, match=f"'{field}' is a required property"):
        checked(result)


def test_a_fake_with_a_wrong_value_is_rejected():
    with pytest.raises(jsonschema.ValidationError, match="status"):
        checked(fake(status="finished"))
    with pytest.raises(jsonschema.ValidationError, match="epoch_end"):  # a curve point must say which kind it is
        checked(fake(curve=[{"step": 2, "epoch": 0.5, "metrics": {"accuracy": 0.6}}]))
