"""What peftlab saves loads with plain transformers + peft and predicts as peftlab's own loader does.

Every adapter method x {encoder, decoder}: a tiny random base rebuilt with plain ``from_config`` (the same
seed gives the same weights as peftlab's), ``PeftModel.from_pretrained(base, <run>/adapter)``, logits within
1e-5 of ``peftlab.training.evaluation.load_run``'s. Full fine-tuning saves a standard transformers folder, loaded with plain ``from_pretrained``. Mean pooling is
peftlab's own, not the architecture's, so these tests use ``--pooling native``; see peftlab.training.export.)
"""

from __future__ import annotations

import pytest
import torch

from peftlab.config import TrainConfig, build_config
from peftlab.methods.table import METHODS
from peftlab.training.loop import train

ADAPTER_METHODS = sorted(m for m in METHODS if m != "full")
ARCHS = {"encoder": dict(task="rte", model="tiny-bert"), "decoder": dict(task="rte", model="tiny-llama")}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_full_fine_tuning_is_saved_as_a_standard_transformers_folder(tmp_path, arch):
    from transformers import AutoModelForSequenceClassification

    from peftlab.training.evaluation import load_run

    cfg = build_config(TrainConfig, overrides=dict(**ARCHS[arch], method="full", targets="q,v", epochs=1,
                                                   batch_size=8, max_length=32, max_train_samples=16,
                                                   max_eval_samples=8, pooling="native", lr=1e-3,
                                                   output_dir=str(tmp_path / "run")))
    result = train(cfg)
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "adapter").eval()
    ours = load_run(tmp_path / "run").model.eval()
    from peftlab.models.registry import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    batch = tokenizer(["a first sentence .", "and a second, longer one ?"], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, ours(**batch).logits, atol=1e-5, rtol=0)
    assert result["status"] == "ok"


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("method", ADAPTER_METHODS)
def test_plain_peft_loading_reproduces_peftlabs_logits(tmp_path, method, arch):
    from peft import PeftModel

    from peftlab.training.evaluation import load_run
    from peftlab.models.registry import load_model

    cfg = build_config(TrainConfig, overrides=dict(**ARCHS[arch], method=method, targets="q,v", rank=4, epochs=1,
                                                   batch_size=8, max_length=32, max_train_samples=16,
                                                   max_eval_samples=8, pooling="native", lr=1e-2,
                                                   output_dir=str(tmp_path / "run"),
                                                   **({"fourierft_n_frequency": 100} if method == "fourierft" else {})))
    train(cfg)
    ours = load_run(tmp_path / "run").model.eval()
    base, tokenizer = load_model(cfg.model, num_labels=2, seed=cfg.seed, pooling="native")
    plain = PeftModel.from_pretrained(base, str(tmp_path / "run" / "adapter")).eval()
    batch = tokenizer(["a first sentence .", "and a second, longer one ?"], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, ours(**batch).logits, atol=1e-5, rtol=0)
