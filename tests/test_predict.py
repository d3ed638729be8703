"""`peftlab predict`: a trained run's predictions on a file of texts equal what evaluation computed."""

from __future__ import annotations

import json

import pytest
import torch

from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.training.loop import train


@pytest.fixture(scope="module")
def sst2_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("predict") / "run"
    train(build_run_config(overrides=dict(task="sst2", model="tiny-bert", method="lora", targets="q,v", rank=4,
                                                   epochs=1, batch_size=8, max_length=32, max_train_samples=16,
                                                   max_eval_samples=16, output_dir=str(out))))
    return out


def test_predict_jsonl_matches_the_models_own_logits(sst2_run, tmp_path, capsys):
    from peftlab.training.evaluation import load_run

    texts = ["a moving and wonderful film .", "dull , flat and far too long .", "it is a movie ."]
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"sentence": t}) + "\n" for t in texts))
    out = tmp_path / "pred.jsonl"
    assert main(["predict", str(sst2_run), "--input", str(inputs), "--output", str(out)]) == 0
    assert "wrote 3 predictions" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    run = load_run(sst2_run)
    run.model.eval()
    with torch.no_grad():
        batch = run.tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
        expected = torch.softmax(run.model(**batch).logits, dim=-1)
    for row, probs in zip(rows, expected):
        assert row["probabilities"] == pytest.approx(probs.tolist(), abs=1e-5)
        assert row["label_id"] == int(probs.argmax()) and row["label"] == ("0", "1")[row["label_id"]]


def test_predict_reads_tsv_and_named_fields(sst2_run, tmp_path):
    inputs = tmp_path / "in.tsv"
    inputs.write_text("review\tid\ngreat fun\t1\nterrible\t2\n")
    out = tmp_path / "p.jsonl"
    assert main(["predict", str(sst2_run), "--input", str(inputs), "--fields", "review", "--output", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 2


@pytest.mark.parametrize("content, suffix, args, message", [
    ('{"review": "x"}\n', ".jsonl", [], "none of which give the 1 text field(s) of task 'sst2'"),
    ("x", ".txt", [], "unknown file type '.txt'"),
])
def test_predict_bad_input_is_one_line(sst2_run, tmp_path, capsys, content, suffix, args, message):
    inputs = tmp_path / f"in{suffix}"
    inputs.write_text(content)
    out = tmp_path / "p.jsonl"
    assert main(["predict", str(sst2_run), "--input", str(inputs), "--output", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_predict_of_a_head_only_run_matches_plain_transformers(tmp_path):
    """--method head saves a standard transformers folder: `peftlab predict` gives what plain
    AutoModelForSequenceClassification.from_pretrained(<run>/adapter) computes."""
    from transformers import AutoModelForSequenceClassification

    from peftlab.models.registry import load_tokenizer

    run_dir = tmp_path / "head"
    train(build_run_config(overrides=dict(task="sst2", model="tiny-bert", method="head", epochs=1,
                                                   batch_size=8, max_length=32, max_train_samples=16,
                                                   max_eval_samples=16, head_lr=1e-2, output_dir=str(run_dir))))
    texts = ["a moving and wonderful film .", "dull , flat and far too long ."]
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"sentence": t}) + "\n" for t in texts))
    out = tmp_path / "pred.jsonl"
    assert main(["predict", str(run_dir), "--input", str(inputs), "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    plain = AutoModelForSequenceClassification.from_pretrained(run_dir / "adapter").eval()
    batch = load_tokenizer("tiny-bert")(texts, padding=True, truncation=True, max_length=32, return_tensors="pt")
    with torch.no_grad():
        expected = torch.softmax(plain(**batch).logits, dim=-1)
    for row, probs in zip(rows, expected):
        assert row["probabilities"] == pytest.approx(probs.tolist(), abs=1e-5)
