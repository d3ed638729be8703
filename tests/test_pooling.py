"""--pooling: the checkpoint's sentence-transformers mean pooling for minilm-l6, masked so padding cannot
leak in, carried through save/evaluate, refused where it cannot apply; per-task length/batch defaults."""

from __future__ import annotations

import json

import pytest
import torch

from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.models.registry import load_model, load_model_with_pooling
from peftlab.models.pooling import declared_pooling


def _encoded(model, tokenizer, texts):
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model.bert(**batch), batch["attention_mask"]


def test_minilm_declares_mean_pooling_and_auto_uses_it():
    loaded = load_model_with_pooling("minilm-l6")
    model = loaded.model
    assert loaded.pooling == "mean"
    loaded_native = load_model_with_pooling("minilm-l6", pooling="native")
    native = loaded_native.model
    assert loaded_native.pooling == "native"
    # same weights, same names: heads and adapters are unchanged by the switch
    assert set(model.state_dict()) == set(native.state_dict())
    texts = ["a short one.", "a much longer sentence with many more words than the first one"]
    out, mask = _encoded(model, loaded.tokenizer, texts)
    pooler = model.bert.pooler
    weights = mask.unsqueeze(-1).float()
    mean = (out.last_hidden_state * weights).sum(1) / weights.sum(1)  # the non-padding tokens' mean
    torch.testing.assert_close(out.pooler_output, pooler.activation(pooler.dense(mean)))
    out, _ = _encoded(native, loaded_native.tokenizer, texts)
    torch.testing.assert_close(out.pooler_output, native.bert.pooler(out.last_hidden_state))  # BERT's [CLS]


def test_random_models_have_no_declared_pooling(tmp_path):
    assert declared_pooling(tmp_path) is None
    assert declared_pooling(None) is None
    assert load_model_with_pooling("tiny-bert").pooling == "native"


def test_declared_pooling_reads_sentence_transformers_config(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    assert declared_pooling(tmp_path) == "cls"
    (tmp_path / "1_Pooling" / "config.json").write_text("{not json")
    assert declared_pooling(tmp_path) is None


def _logits(model, tokenizer, texts):
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.parametrize("pooling", ["mean", "native"])
def test_padding_does_not_change_an_example(pooling):
    model, tokenizer = load_model("tiny-bert", pooling=pooling)
    model.eval()
    short = "a short one."
    alone = _logits(model, tokenizer, [short])
    padded = _logits(model, tokenizer, [short, "a much longer sentence with many more words than the first one"])
    torch.testing.assert_close(padded[:1], alone, atol=1e-5, rtol=1e-5)


def test_mean_pooler_is_the_masked_mean_through_dense_and_tanh():
    model, tokenizer = load_model("tiny-bert", pooling="mean")
    model.eval()
    batch = tokenizer(["one two", "one two three four five"], padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.bert(**batch)  # the encoder's hook pools, with the mask the pooler itself never sees
        hidden, pooled = out.last_hidden_state, out.pooler_output
        mask = batch["attention_mask"].float().unsqueeze(-1)
        expected = torch.tanh(model.bert.pooler.dense((hidden * mask).sum(1) / mask.sum(1)))
        first_token = torch.tanh(model.bert.pooler.dense(hidden[:, 0]))
    torch.testing.assert_close(pooled, expected)
    assert not torch.allclose(pooled, first_token)


def test_pooling_is_recorded_and_evaluate_rebuilds_it(tmp_path):
    from peftlab.training.evaluation import evaluate_run
    from peftlab.training.loop import train

    cfg = build_run_config(overrides=dict(
        task="rte", model="tiny-bert", method="lora", targets="q,v", rank=4, epochs=1, batch_size=8, max_length=32,
        max_train_samples=16, max_eval_samples=32, pooling="mean", lr=1e-2, output_dir=str(tmp_path / "run")))
    result = train(cfg)
    assert result["status"] in ("ok", "no_learning") and result["pooling"] == "mean"  # trained to its end
    assert evaluate_run(tmp_path / "run") == pytest.approx(result["final"]["metrics"])
    assert evaluate_run(tmp_path / "run", merge=True) == pytest.approx(result["final"]["metrics"])


@pytest.mark.parametrize("argv, message", [
    (["--pooling", "max"], "unknown pooling 'max'"),
    (["--model", "tiny-llama", "--pooling", "mean"], "--pooling mean needs a BERT-style pooler"),
    (["--task", "gsm8k", "--model", "tiny-llama", "--pooling", "mean"], "not to causal-LM tasks"),
])
def test_bad_pooling_is_one_line(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    code = main(["train", "--model", "tiny-bert", "--epochs", "1", "--max-train-samples", "8",
                 "--max-eval-samples", "8", "--output-dir", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


@pytest.mark.parametrize("task, max_length, batch_size", [("rte", 128, 16), ("gsm8k", 512, 8), ("alpaca", 512, 8)])
def test_task_defaults_for_length_and_batch(task, max_length, batch_size):
    cfg = build_run_config(overrides={"task": task})
    assert (cfg.max_length, cfg.batch_size) == (max_length, batch_size)
    given = build_run_config(overrides={"task": task, "max_length": 64, "batch_size": 4})
    assert (given.max_length, given.batch_size) == (64, 4)


# --------------------------------------------------------------------------- RoBERTa-style heads (MPNet)


def test_first_token_heads_get_the_masked_mean_in_token_0():
    from conftest import build_tiny

    from peftlab.models.pooling import supports_mean, use_mean_pooling

    model = build_tiny("mpnet")
    native = build_tiny("mpnet")  # same seed: same weights
    assert supports_mean(model)
    use_mean_pooling(model)
    ids = torch.tensor([[5, 6, 7, 1, 1], [5, 6, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        hidden = native.mpnet(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.float().unsqueeze(-1)
        mean = (hidden * m).sum(1) / m.sum(1)
        expected = native.classifier(mean.unsqueeze(1))
        first_token = native(input_ids=ids, attention_mask=mask).logits
        alone = model(input_ids=ids[:1, :3], attention_mask=mask[:1, :3]).logits
    torch.testing.assert_close(logits, expected)
    assert not torch.allclose(logits, first_token)
    torch.testing.assert_close(logits[:1], alone, atol=1e-5, rtol=1e-5)  # padding cannot leak in
    assert set(model.state_dict()) == set(native.state_dict())  # names unchanged: adapters and heads too


@pytest.mark.slow
def test_mpnet_base_declares_mean_pooling_and_trains(tmp_path):
    """The paper-scale encoder: assembled from its five part-wheels (README setup), mean pooling, q/v adapted."""
    from peftlab.models.registry import MODELS
    from peftlab.training.loop import train

    assert MODELS["mpnet-base"].available(), "install the parts: " + MODELS["mpnet-base"].install_hint
    loaded = load_model_with_pooling("mpnet-base")
    model = loaded.model
    assert type(model).__name__ == "MPNetForSequenceClassification" and loaded.pooling == "mean"
    # 109.5M with the sentence-transformers pooler (590,592), which the sequence classifier does not load
    assert sum(p.numel() for n, p in model.named_parameters() if not n.startswith("classifier")) == 108_895_872
    cfg = build_run_config(overrides=dict(
        task="sst2", model="mpnet-base", pooling="auto", method="lora", targets="q,v", rank=4, epochs=1, batch_size=8,
        max_length=32, max_train_samples=16, max_eval_samples=16, output_dir=str(tmp_path / "run")))
    result = train(cfg)
    assert result["status"] in ("ok", "no_learning") and result["pooling"] == "mean"  # trained to its end
    from peftlab.training.devices import cpu_has_native_bf16

    assert result["mixed_precision"] == ("bf16" if cpu_has_native_bf16() else "no")  # auto: a 109M model
    assert result["trainable_params"]["adapter"] == 12 * 2 * 4 * (768 + 768)  # r x (in + out), q and v, 12 layers
    assert 0.0 <= result["final"]["metrics"]["accuracy"] <= 1.0 and result["train_examples"] == 16
