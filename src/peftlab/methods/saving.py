"""Save, load and merge what a run trained. safetensors only; pickles are refused unless asked for.

Adapters go through ``PeftModel.save_pretrained``, PiSSA, MiLoRA, CorDA and KaSA's non-peft truncations converted
to plain LoRA on the original base; full fine-tuning is a standard transformers folder (fused QKV fused back). A
sequence classifier's head config goes to ``labels.json``; split q/k/v to ``fused_qkv.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from peftlab.methods import kasa
from peftlab.errors import PeftlabError

def is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _record_base(out_dir: Path, base_model: str) -> None:
    """peftlab_base.json: the registry model a run trained, its public Hub id and, for an adapter, the local path
    its adapter_config.json named, which is rewritten to the Hub id (so the adapter loads elsewhere)."""
    from peftlab.models.registry import hub_id

    public = hub_id(base_model) if base_model else None
    config_file = out_dir / "adapter_config.json"
    record = {"model": base_model, "hub_id": public}
    if config_file.is_file():
        if public is None:
            return
        config = json.loads(config_file.read_text())
        record["local_path"] = config.get("base_model_name_or_path")
        config["base_model_name_or_path"] = public
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    elif not base_model:
        return
    (out_dir / "peftlab_base.json").write_text(json.dumps(record, indent=2) + "\n")


LABELS_FILE = "labels.json"  # a sequence classifier's head: num_labels, id2label, label2id, problem_type


def write_head_labels(model: nn.Module, out_dir: Path) -> None:
    """A sequence classifier's ``labels.json``: the config values its head needs, which an adapter folder has no
    config.json to carry (``from_pretrained(base, **labels)`` names the classes; evaluate, predict, export read it)."""
    config = getattr(model, "config", None)
    if getattr(config, "problem_type", None) not in ("single_label_classification", "regression"):
        return
    values = {"num_labels": int(config.num_labels), "problem_type": config.problem_type,
              "id2label": {str(i): str(name) for i, name in sorted(config.id2label.items())},
              "label2id": {str(name): int(i) for name, i in config.label2id.items()}}
    (out_dir / LABELS_FILE).write_text(json.dumps(values, indent=2) + "\n")


def saved_head_labels(adapter_dir: str | Path) -> dict | None:
    """What :func:`write_head_labels` wrote into ``adapter_dir`` (a run folder's ``adapter/`` is found too), or
    None (a causal LM, or an adapter saved before labels.json existed)."""
    adapter_dir = Path(adapter_dir)
    for folder in (adapter_dir / "adapter", adapter_dir):
        try:
            return json.loads((folder / LABELS_FILE).read_text())
        except (OSError, ValueError):
            continue
    return None


def save_trained(model: nn.Module, out_dir: str | Path, *, base_model: str = "", applied=None) -> Path:
    """Write the trained part of ``model`` to ``out_dir`` (created). ``applied``: the
    :class:`~peftlab.methods.table.AppliedMethod` that made ``model``: what to convert to plain LoRA and the split
    q/k/v; without it the adapter is saved as peft holds it."""
    from peftlab.methods import fused_qkv
    from peftlab.methods.registry import METHODS

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_head_labels(model, out_dir)
    stats = applied.init_stats if applied is not None else None
    split = applied.split if applied is not None else None
    if split is None and any(isinstance(m, fused_qkv.SplitQKV) for m in model.modules()):
        raise PeftlabError("this model's fused QKV projections are split, but save_trained was not told how",
                           fix="pass applied= (what apply_method returned: it records the split)")
    if is_peft(model):
        if applied is not None and METHODS[applied.method.method].converts_to_lora:
            from peftlab.methods.svd_lora import save_converted

            save_converted(model, out_dir, stats.initial_adapter)
        elif stats is not None and stats.kasa_dropped:
            # KaSA truncated otherwise than peft's loader would: a plain LoRA on the original base instead
            kasa.save_as_lora(model, out_dir, stats.kasa_dropped)
        else:
            model.save_pretrained(out_dir, safe_serialization=True)
        _record_base(out_dir, base_model)
        if split:  # the adapter names q/k/v layers that only a split base has
            fused_qkv.write_note(out_dir, split)
        return out_dir
    # Full fine-tuning: a standard transformers folder (config.json + model.safetensors) that
    # AutoModelFor*.from_pretrained loads as it is (split q/k/v saved fused back into the original layout);
    # peftlab_base.json says which registry model it came from.
    model.save_pretrained(out_dir, safe_serialization=True,
                          **({"state_dict": fused_qkv.fused_state_dict(model, split)} if split else {}))
    _record_base(out_dir, base_model)
    return out_dir


# an earlier peftlab's KaSA truncation plan (a non-peft truncation) and its full fine-tuning weights
OLDER_FORMATS = ("peftlab_kasa_truncation.json", "trained_weights.safetensors")


def load_trained(base: nn.Module, adapter_dir: str | Path, *, allow_pickle: bool = False,
                 base_model: str | None = None) -> nn.Module:
    """Attach a saved adapter (or full-FT weights) to ``base``; clear one-line errors for bad files."""
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise PeftlabError(f"adapter folder not found: {adapter_dir}", fix="pass the run's adapter/ folder")
    older = [name for name in OLDER_FORMATS if (adapter_dir / name).is_file()]
    if older:  # loading them as today's formats would give other weights without a word
        raise PeftlabError(f"{adapter_dir} holds {older[0]}, a format of an earlier peftlab that this one no longer "
                           "reads", fix="retrain the run, or load it with the peftlab version that wrote it")
    config_file = adapter_dir / "adapter_config.json"
    if (adapter_dir / "model.safetensors").is_file() and not config_file.is_file():
        return _load_full(base, adapter_dir / "model.safetensors", base_model)  # full fine-tuning's folder
    if not config_file.is_file():
        raise PeftlabError(f"no adapter_config.json or model.safetensors in {adapter_dir}",
                           fix="pass a folder written by peftlab train or PeftModel.save_pretrained")
    safe, pickled = adapter_dir / "adapter_model.safetensors", adapter_dir / "adapter_model.bin"
    if safe.is_file():
        _check_safetensors(safe)
    elif not pickled.is_file():
        raise PeftlabError(f"no adapter weights in {adapter_dir}", fix="expected adapter_model.safetensors")
    elif not allow_pickle:
        raise PeftlabError(f"{pickled} is a pickle, which can run code when loaded",
                           fix="convert it to safetensors, or pass --allow-pickle if you trust its source")
    try:
        json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PeftlabError(f"corrupt adapter config {config_file}: {err}", fix="re-save the adapter") from None
    from peft import PeftModel

    from peftlab.methods.fused_qkv import split_for_adapter

    split_for_adapter(base, adapter_dir)  # an adapter of split q/k/v: the same split first (fused_qkv.json)
    try:
        return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=False)
    except (RuntimeError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PeftlabError(f"adapter {adapter_dir} does not fit this base model: {first[:300]}",
                           fix="load it on the model it was trained from (see its adapter_config.json)") from None


def _check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():
                handle.get_slice(key)
    except Exception as err:  # safetensors raises its own error types for truncation/corruption
        raise PeftlabError(f"corrupt or truncated safetensors file {path}: {err}",
                           fix="re-save the adapter; the file is unreadable") from None


def _load_full(base: nn.Module, path: Path, base_model: str | None) -> nn.Module:
    from safetensors.torch import load_file

    _check_safetensors(path)
    marker = path.parent / "peftlab_base.json"
    saved_base = json.loads(marker.read_text()).get("model", "") if marker.is_file() else ""
    if base_model and saved_base and saved_base != base_model:
        raise PeftlabError(f"{path} was trained on '{saved_base}', not '{base_model}'",
                           fix=f"load it on {saved_base}")
    try:  # parameters and persistent buffers, as save_pretrained writes them; a tied output layer is left out
        unexpected = base.load_state_dict(load_file(str(path)), strict=False).unexpected_keys
    except RuntimeError as err:  # a tensor of another shape
        unexpected = [str(err).strip().splitlines()[-1].strip()]
    if unexpected:
        raise PeftlabError(f"{path} does not fit this base model: {unexpected[0][:300]}",
                           fix="load it on the model it was trained from")
    return base


def merged(model: nn.Module, split=None) -> nn.Module:
    """A plain model with the adapter folded into the weights, in place (``model`` is consumed); ``split`` (a
    :class:`~peftlab.methods.fused_qkv.FusedSplit`): the split q/k/v fused back into the original layout.

    The trained head (``modules_to_save``) is unwrapped first, by peft's own ``unload_and_optionally_merge_module``:
    ``merge_and_unload`` alone fails for VeRA and FourierFT when the head has no ``.weight`` (RoBERTa's
    classification head, DeBERTa-v2's pooler; peft 0.21.2's ``BaseTuner._replace_module``, huggingface/peft PR #3213).
    """
    if is_peft(model):
        _unwrap_saved_modules(model)
        model = model.merge_and_unload()
    if split:
        from peftlab.methods.fused_qkv import fuse_qkv

        model = fuse_qkv(model, split)
    return model


def _unwrap_saved_modules(model: nn.Module) -> None:
    """Replace each ``ModulesToSaveWrapper`` by the module it would unload to (the active trained copy)."""
    from peft.utils.other import ModulesToSaveWrapper

    inner = model.base_model.model
    for name, module in list(inner.named_modules()):
        if isinstance(module, ModulesToSaveWrapper):
            parent_name, _, child = name.rpartition(".")
            parent = inner.get_submodule(parent_name) if parent_name else inner
            setattr(parent, child, module.unload_and_optionally_merge_module(merge=True, safe_merge=False,
                                                                             adapter_names=None))
