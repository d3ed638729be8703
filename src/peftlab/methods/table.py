"""Applying a registered method (:mod:`peftlab.methods.registry`): :func:`apply_method` checks a config against
its row (:func:`check_explicit_options`, the rank / Conv1D / fused-QKV limits), runs the builder and returns an
:class:`AppliedMethod`: the adapted model with everything its init decided that later steps need. Nothing is
stored on the model itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from peftlab.config import MethodConfig  # the schema of a method's options: declared with the config
from peftlab.errors import PeftlabError
from peftlab.methods.registry import METHOD_OPTIONS, METHODS, Built, Method
from peftlab.methods.targets import NO_TARGETS, ResolvedTargets, head_module_names, resolve_targets

if TYPE_CHECKING:  # torch and the SVD/KaSA/CorDA modules load when a model is adapted, not to list the table
    import torch
    from torch import nn

    from peftlab.methods.fused_qkv import FusedSplit


def check_explicit_options(cfg: MethodConfig, explicit) -> None:
    """Refuse an option the user set (flag or --config YAML) that this run would ignore: one line, exit 2.

    Values that come from defaults or from a sweep cell are not checked (a sweep's shared ``base`` may hold
    options for some of its methods only)."""
    method = METHODS[cfg.method]
    for key in sorted(explicit):
        if key in METHOD_OPTIONS and key not in method.options:
            flag = "--" + key.replace("_", "-")
            users = ", ".join(m.name for m in METHODS.values() if key in m.options)
            head_only = "" if method.adapts_projections else " (it trains the task head alone, at --head-lr)"
            raise PeftlabError(f"{flag} is set, but method '{cfg.method}' does not use it (it would be ignored)",
                               fix=f"remove {flag} for --method {cfg.method}{head_only}, or use a method that has "
                                   f"it ({users})")


def _check_rank(model: nn.Module, method: Method, cfg: MethodConfig, targets: ResolvedTargets) -> None:
    from peftlab.methods.fused_qkv import dense_weight

    modules = dict(model.named_modules())
    shapes = [tuple(dense_weight(modules[name]).shape) for name in targets.all_modules]
    smallest = min(min(shape) for shape in shapes)
    if method.svd_init and cfg.rank >= smallest:
        raise PeftlabError(
            f"--rank {cfg.rank} is too large for {method.name}: it must be < min(in, out) = {smallest} of the "
            "adapted weights (the SVD init keeps at least one component)",
            fix=f"use --rank {max(1, smallest // 2)} or smaller",
        )
    if method.check_shapes is not None:  # the method's own limit (FourierFT: its spectrum fits every weight)
        method.check_shapes(cfg, shapes)
    # LoRA-style factors: a rank above min(in, out) adds nothing a full-rank update lacks and costs more
    # parameters than the matrix itself.
    if method.uses_rank and method.rank_within_layer and cfg.rank > smallest:
        raise PeftlabError(
            f"--rank {cfg.rank} is larger than min(in, out) = {smallest} of the adapted weights: the adapter would "
            f"have more parameters than the matrices it adapts",
            fix=f"use --rank {smallest} or smaller (or --method full)",
        )


# Import names whose pip package is called something else.
_PIP_NAMES = {"attr": "attrs", "sklearn": "scikit-learn", "yaml": "pyyaml", "PIL": "pillow"}


def _build(method: Method, *args, **kwargs):
    """The method's builder; a package it imports that is not installed (peft's CorDA imports ``attr``) is one line
    naming it, not a traceback."""
    try:
        return method.build(*args, **kwargs)
    except ImportError as err:
        module = (err.name or "an unnamed module").split(".")[0]
        package = _PIP_NAMES.get(module, module)
        raise PeftlabError(f"method '{method.name}' needs the Python package '{package}' (import {module!r} failed), "
                           "which is not installed",
                           fix=f"pip install {package} (or reinstall peftlab, which declares it)") from None


@dataclass(frozen=True)
class InitStats:
    """What a method's init decided or measured, needed after it (saving, result.json, plots)."""

    calibration_seconds: float | None = None  # CorDA: wall time of the forward passes over calibration inputs
    kasa_plan: dict[str, int] | None = None  # KaSA: {module: components kept} where peft would keep others
    kasa_dropped: dict | None = None  # KaSA with a plan: what it drops, to save the run as plain LoRA
    initial_adapter: dict[str, torch.Tensor] | None = None  # SVD inits: A0, B0, for the conversion to plain LoRA
    kasa_sigma: dict[str, list[float]] | None = None  # KaSA: learned singular values before any step (plots)


@dataclass(frozen=True)
class AppliedMethod:
    """The result of :func:`apply_method`: the trainable model and what its init decided."""

    model: nn.Module
    targets: ResolvedTargets
    heads: list[str]  # task-head modules trained in full (empty for causal LMs)
    method: MethodConfig  # the options it was built with (the extra-loss hook and the savers read them)
    init_stats: InitStats = field(default_factory=InitStats)
    split: FusedSplit | None = None  # fused QKV projections split into q/k/v layers (save, merge, export fuse back)

    def extra_loss(self, model: nn.Module | None = None) -> torch.Tensor | None:
        """The method's auxiliary loss on ``model`` (default: the adapted model; pass the unwrapped one)."""
        return extra_loss(self.model if model is None else model, self.method)


def apply_method(model: nn.Module, cfg: MethodConfig, *, train_head: bool = True, task_type: str | None = None,
                 calibration: Callable[[], None] | None = None) -> AppliedMethod:
    """Adapt ``model`` as ``cfg`` says; returns an :class:`AppliedMethod`.

    ``train_head``: train the task head in full (new classification/regression heads); False for causal LM.
    ``task_type``: peft task type (``SEQ_CLS``/``CAUSAL_LM``), so that generation works through the wrapper.
    ``calibration``: a zero-argument callable that runs ``model`` over calibration inputs (e.g.
    :func:`peftlab.methods.corda.calibration_runner`); used only by methods that need it (CorDA), which record its
    wall time in ``init_stats.calibration_seconds``.
    """
    method = METHODS[cfg.method]
    split = _split_fused_qkv(model, method, cfg)
    # head-only adapts no projection: nothing to resolve (its config holds no targets)
    targets = resolve_targets(model, cfg.targets, layers=getattr(cfg, "layers", None)) \
        if method.adapts_projections else NO_TARGETS
    if targets.conv1d and not method.conv1d:
        raise PeftlabError(f"{cfg.method} cannot adapt Conv1D layers such as {targets.conv1d[0]} (weights stored "
                           "(in, out))", fix=f"drop the projections on them from --targets, or use another method "
                                             f"({', '.join(n for n, m in METHODS.items() if m.conv1d and m.adapts_projections)})")
    if method.adapts_projections:
        _check_rank(model, method, cfg, targets)
    heads = head_module_names(model) if train_head else []
    if not method.adapts_projections and not heads:  # nothing would train
        raise PeftlabError(f"--method {cfg.method} trains only the task head, and this model has none to train"
                           + ("" if train_head else " (a causal LM is scored through its language-model head)"),
                           fix="use an adapter method (e.g. --method lora)")
    calibration_seconds: list[float] = []  # CorDA: the wall time of its calibration passes
    extra = {}
    if method.needs_calibration:
        if calibration is None:
            raise PeftlabError(f"{cfg.method} needs calibration inputs to build its init",
                               fix="run it through `peftlab train` (which passes --corda-samples training inputs), "
                                   "or pass apply_method(..., calibration=peftlab.methods.corda.calibration_runner(...))")

        def timed() -> None:
            start = time.perf_counter()
            calibration()
            calibration_seconds.append(time.perf_counter() - start)

        extra["calibration"] = timed
    built = _build(method, model, cfg, targets, list(heads), task_type, **extra)  # a copy: peft extends its list
    if not isinstance(built, Built):
        built = Built(built)
    model = built.model
    from peftlab.methods import kasa
    from peftlab.methods import svd_lora as svd_init

    stats = InitStats(
        calibration_seconds=sum(calibration_seconds) if method.needs_calibration else None,
        kasa_plan=built.kasa_plan,
        kasa_dropped=built.kasa_dropped,
        # A0, B0 (in memory, tiny): an SVD init's adapter is saved converted to plain LoRA on the original base
        initial_adapter=svd_init.initial_adapter_state(model) if method.converts_to_lora else None,
        kasa_sigma=kasa.singular_values(model),
    )
    return AppliedMethod(model, targets, heads, cfg, stats, split)


def _split_fused_qkv(model: nn.Module, method: Method, cfg: MethodConfig) -> FusedSplit | None:
    """A fused QKV matrix split into linear q, k, v layers (in place) when --targets names any of them, so each
    trains in its own group (k frozen when not named); None when nothing was split."""
    if not method.adapts_projections or not {"q", "k", "v"} & set(cfg.targets):
        return None
    from peftlab.methods.fused_qkv import fused_modules, split_fused_qkv

    if not method.fused_qkv and fused_modules(model):
        raise PeftlabError(f"{cfg.method} cannot adapt the q/k/v of a fused QKV matrix ({fused_modules(model)[0]})",
                           fix="use " + ", ".join(n for n, m in METHODS.items() if m.fused_qkv and m.adapts_projections)
                               + " on this model, or a model with separate q/k/v")
    return split_fused_qkv(model) or None


def extra_loss(model: nn.Module, cfg: MethodConfig | None) -> torch.Tensor | None:
    """The auxiliary loss of ``cfg``'s method on ``model`` (KaSA's regulariser), or None: the training loop adds
    it to the task loss."""
    if cfg is None or METHODS[cfg.method].extra_loss is None:
        return None
    return METHODS[cfg.method].extra_loss(model, cfg)
