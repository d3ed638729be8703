"""`peftlab export RUN --merged OUT`: plain `from_pretrained` of the export predicts as peftlab does."""

from __future__ import annotations

import pytest
import torch

from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.training.loop import train


def _run(tmp_path, **overrides):
    values = dict(task="rte", model="tiny-bert", method="lora", targets="q,v", rank=4, epochs=1, batch_size=8,
                  max_length=32, max_train_samples=16, max_eval_samples=16, output_dir=str(tmp_path / "run"))
    values.update(overrides)
    train(build_run_config(overrides=values))
    return tmp_path / "run"


@pytest.mark.parametrize("method", ["lora", "dora", "pissa", "kasa", "vera", "full", "head"])
def test_export_merged_loads_with_plain_transformers_and_predicts_the_same(tmp_path, method):
    from transformers import AutoModelForSequenceClassification

    from peftlab.training.evaluation import load_run
    from peftlab.training.export import export_merged

    run_dir = _run(tmp_path, method=method)
    done = export_merged(run_dir, tmp_path / "merged")
    assert done["max_abs_diff"] <= 1e-5
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged").eval()
    run = load_run(run_dir)
    run.model.eval()
    batch = run.tokenizer(["a first sentence .", "another one"], ["is it so ?", "yes"], padding=True,
                          return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, run.model(**batch).logits, atol=1e-5, rtol=0)
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()


def test_export_refuses_mean_pooling_and_an_existing_folder(tmp_path, capsys):
    run_dir = _run(tmp_path, pooling="mean")
    capsys.readouterr()
    code = main(["export", str(run_dir), "--merged", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "mean pooling, which plain transformers would not apply" in err[-1]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out-*"))
    (tmp_path / "taken").mkdir()
    assert main(["export", str(run_dir), "--merged", str(tmp_path / "taken")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_export_a_decoder_run(tmp_path):
    from transformers import AutoModelForCausalLM

    from peftlab.training.export import export_merged

    run_dir = _run(tmp_path, task="alpaca", model="tiny-llama", max_length=64, max_train_samples=8,
                   max_eval_samples=4)
    done = export_merged(run_dir, tmp_path / "merged")
    assert done["max_abs_diff"] <= 1e-5
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged") is not None
