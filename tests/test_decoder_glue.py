"""Decoder LLMs on GLUE as sequence classification: a random 2-layer Llama (with SmolLM2's tokenizer, pad = eos)
through the real training loop, on a classification, a single-sentence and the regression task, with the
LoRA family and KaSA on all four attention projections and Yao et al.'s lr ratio 2."""

from __future__ import annotations

import json
import math
from importlib import resources

import jsonschema
import pytest
import torch

from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.training.loop import train

SCHEMA = json.loads(resources.files("peftlab").joinpath("schemas/result.schema.json").read_text())
LR = 5e-4


def decoder_cfg(tmp_path, **overrides) -> TrainConfig:
    values = dict(task="rte", model="tiny-llama", method="lora", targets="q,k,v,o", rank=4, lr=LR, lr_ratio=2,
                  epochs=1, batch_size=8, max_length=32, max_train_samples=16, max_eval_samples=16,
                  output_dir=str(tmp_path / "run"), log_every=1)
    values.update(overrides)
    return build_run_config(overrides=values)


@pytest.mark.parametrize("task", ["rte", "sst2", "stsb"])
@pytest.mark.parametrize("method", ["lora", "kasa", "dora"])
def test_tiny_llama_glue(tmp_path, task, method):
    result = train(decoder_cfg(tmp_path, task=task, method=method))
    jsonschema.validate(result, SCHEMA)
    assert result["status"] in ("ok", "no_learning")  # trained to its end (a tiny model need not learn)
    # Yao et al.: eta_V = lambda * eta_QK; k and o train at the base rate; the new score head is trained too.
    lrs = result["group_lrs"]
    assert lrs["q"] == pytest.approx(LR) and lrs["k"] == pytest.approx(LR) and lrs["o"] == pytest.approx(LR)
    assert lrs["v"] == pytest.approx(2 * LR)
    assert "head" in lrs and result["trainable_params"]["head"] > 0
    metrics = result["final"]["metrics"]
    assert result["primary_metric"] in metrics
    assert all(math.isfinite(v) for v in metrics.values())
    if task == "stsb":
        assert {"pearson", "spearman"} <= set(metrics)
    else:
        assert 0.0 <= metrics["accuracy"] <= 1.0
    assert (tmp_path / "run" / "adapter").is_dir()
    if method == "kasa":  # 2 layers x 4 projections, r singular values each
        assert len(result["kasa_sigma"]) == 8 and all(len(v) == 4 for v in result["kasa_sigma"].values())


def test_decoder_classifier_pools_the_last_real_token():
    """Right padding with pad = eos must not change a decoder classifier's prediction."""
    from peftlab.models.registry import load_model

    model, tokenizer = load_model("tiny-llama", head="classification", num_labels=2)
    model.eval()
    assert model.config.pad_token_id == tokenizer.pad_token_id == tokenizer.eos_token_id
    short = tokenizer(["A cat sat."], return_tensors="pt")
    padded = tokenizer(["A cat sat.", "A much longer sentence about a dog that ran away."], padding=True,
                       return_tensors="pt")
    with torch.no_grad():
        alone = model(**short).logits[0]
        batched = model(**padded).logits[0]
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=1e-4)
