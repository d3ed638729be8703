"""What peftlab saves loads with plain transformers + peft and predicts as peftlab's own loader does.

Every adapter method x {encoder, decoder, fused}: a tiny random base rebuilt with plain ``from_config`` (the same
seed gives the same weights as peftlab's), ``PeftModel.from_pretrained(base, <run>/adapter)``, logits within
1e-5 of ``peftlab.training.evaluation.load_run``'s. ``fused`` is Phi-3, whose ``qkv_proj`` peftlab splits into
q/k/v layers: its adapter folder says so (``fused_qkv.json``, README.md), and the documented helper
``peftlab.methods.fused_qkv.split_for_adapter(base, adapter)`` splits the plain base before plain peft loads it (a
no-op for the others). Full fine-tuning and head-only (no adapter) save a standard
transformers folder, loaded with plain ``from_pretrained`` (a fused model's split q/k/v saved fused back). Mean pooling is
peftlab's own, not the architecture's, so these tests use ``--pooling native``; see peftlab.training.export.)
"""

from __future__ import annotations

import pytest
import torch

from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.methods.table import METHODS
from peftlab.training.loop import train

PEFT_FREE = ("full", "head")  # saved as a standard transformers folder: no adapter to load with peft
ADAPTER_METHODS = sorted(m for m in METHODS if m not in PEFT_FREE)
ARCHS = {"encoder": dict(task="rte", model="tiny-bert"), "decoder": dict(task="rte", model="tiny-llama"),
         "fused": dict(task="rte", model="tiny-phi3")}
FUSED_ARCHS = {"fused": "qkv_proj"}  # arch -> its fused QKV module, split for training


def test_every_method_is_in_one_of_the_two_portability_tests():
    assert set(PEFT_FREE) <= set(METHODS) and set(ADAPTER_METHODS) | set(PEFT_FREE) == set(METHODS)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("method", PEFT_FREE)
def test_peft_free_methods_are_saved_as_a_standard_transformers_folder(tmp_path, arch, method):
    from transformers import AutoModelForSequenceClassification

    from peftlab.training.evaluation import load_run

    options = dict(targets="q,v", lr=1e-3) if method == "full" else {}
    cfg = build_run_config(overrides=dict(**ARCHS[arch], method=method, epochs=1, batch_size=8,
                                                   max_length=32, max_train_samples=16, max_eval_samples=8,
                                                   pooling="native", head_lr=1e-2, output_dir=str(tmp_path / "run"),
                                                   **options))
    result = train(cfg)
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "adapter").eval()
    ours = load_run(tmp_path / "run").model.eval()
    from peftlab.models.registry import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    batch = tokenizer(["a first sentence .", "and a second, longer one ?"], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, ours(**batch).logits, atol=1e-5, rtol=0)
    assert result["status"] in ("ok", "no_learning")  # trained to its end (tiny random models rarely learn RTE)
    assert not (tmp_path / "run" / "adapter" / "adapter_config.json").exists()
    if arch in FUSED_ARCHS:  # saved in the original layout: the fused matrix, no split layers
        from safetensors import safe_open

        with safe_open(str(tmp_path / "run" / "adapter" / "model.safetensors"), "pt") as handle:
            keys = list(handle.keys())
        assert any(k.endswith(f".{FUSED_ARCHS[arch]}.weight") for k in keys)
        assert not any("_proj.q_proj" in k or ".k_proj." in k for k in keys)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("method", ADAPTER_METHODS)
def test_plain_peft_loading_reproduces_peftlabs_logits(tmp_path, method, arch):
    import json

    from peft import PeftModel

    from peftlab.methods.fused_qkv import split_for_adapter
    from peftlab.training.evaluation import load_run
    from peftlab.models.registry import load_model

    cfg = build_run_config(overrides=dict(**ARCHS[arch], method=method, targets="q,v", rank=4, epochs=1,
                                                   batch_size=8, max_length=32, max_train_samples=16,
                                                   max_eval_samples=8, pooling="native", lr=1e-2,
                                                   output_dir=str(tmp_path / "run"),
                                                   **({"fourierft_n_frequency": 100} if method == "fourierft" else {})))
    train(cfg)
    adapter = tmp_path / "run" / "adapter"
    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    if arch in FUSED_ARCHS:  # the adapter targets the split layers, and its folder says how to rebuild them
        fused = FUSED_ARCHS[arch]
        assert targets and all(f".{fused}.q_proj" in t or f".{fused}.v_proj" in t for t in targets), targets
        note = json.loads((adapter / "fused_qkv.json").read_text())
        assert note["model_type"] == "phi3" and "split_for_adapter" in note["note"]
        assert "split_for_adapter" in (adapter / "README.md").read_text()
    else:
        assert not (adapter / "fused_qkv.json").exists()
    ours = load_run(tmp_path / "run").model.eval()
    base, tokenizer = load_model(cfg.model, num_labels=2, seed=cfg.seed, pooling="native")
    split_for_adapter(base, adapter)  # the documented helper; a no-op without fused_qkv.json
    plain = PeftModel.from_pretrained(base, str(adapter)).eval()
    batch = tokenizer(["a first sentence .", "and a second, longer one ?"], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, ours(**batch).logits, atol=1e-5, rtol=0)


# (options, rank of the saved LoRA per q/v module of a 32-wide tiny model at r=4: dropped components + r)
KASA_NON_PEFT = {"truncate-rank-2": (dict(kasa_truncate_rank=2), 2 + 4), "truncate-rank-6": (dict(kasa_truncate_rank=6), 6 + 4),
                 # the MLP's down projection is wide (in > out): the authors' rule keeps more there than peft's
                 "reference-mode": (dict(kasa_mode="reference", targets="q,v,down"), None)}


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("variant", sorted(KASA_NON_PEFT))
def test_kasa_with_a_truncation_peft_would_not_redo_is_saved_as_plain_lora(tmp_path, variant, arch):
    """k != r or reference mode: plain peft would re-truncate r components (and differ); the run is saved as a
    plain LoRA of rank dropped + r on the original base instead, and reproduces the run's own model."""
    import json

    from peft import PeftModel

    from peftlab.methods.fused_qkv import split_for_adapter
    from peftlab.methods.table import apply_method
    from peftlab.models.registry import load_model
    from peftlab.training.evaluation import load_run

    options, saved_rank = KASA_NON_PEFT[variant]
    overrides = {**ARCHS[arch], **dict(method="kasa", targets="q,v", rank=4, epochs=1, batch_size=8, max_length=32,
                                       max_train_samples=16, max_eval_samples=8, pooling="native", lr=1e-2,
                                       output_dir=str(tmp_path / "run")), **options}
    cfg = build_run_config(overrides=overrides)
    base, tokenizer = load_model(cfg.model, num_labels=2, seed=cfg.seed, pooling="native")
    if variant == "reference-mode" and not apply_method(base, cfg).init_stats.kasa_plan:
        pytest.fail("reference mode should truncate otherwise than peft on this model (wide layers)")
    train(cfg)
    adapter = tmp_path / "run" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config.get("kasa_config") is None and config["rank_pattern"], "expected a plain LoRA with per-module ranks"
    assert config["alpha_pattern"] == config["rank_pattern"]  # scaling 1: B'A' is the whole update
    if saved_rank is not None and arch == "encoder":
        assert set(config["rank_pattern"].values()) == {saved_rank}
    ours = load_run(tmp_path / "run").model.eval()
    base, _ = load_model(cfg.model, num_labels=2, seed=cfg.seed, pooling="native")
    split_for_adapter(base, adapter)
    plain = PeftModel.from_pretrained(base, str(adapter)).eval()
    batch = tokenizer(["a first sentence .", "and a second, longer one ?"], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(plain(**batch).logits, ours(**batch).logits, atol=1e-5, rtol=0)
