"""The method table: every fine-tuning method peftlab offers, selected by name.

Each :class:`Method` knows how to turn a base model plus a :class:`MethodConfig` into a trainable model
(``build``), which extra loss the training loop must add (``extra_loss``, e.g. KaSA's regulariser), whether
its init is an SVD of the base weight (``svd_init``: rank must stay below min(in, out)), whether it works on
fused-QKV models (``fused_qkv``: GPT-2, Phi-3, Falcon, ModernBERT, whose fused matrix ``apply_method`` splits into
linear q, k, v layers, :mod:`peftlab.methods.fused_qkv`) and whether it can adapt a Conv1D layer (``conv1d``:
GPT-2's ``c_proj``, ``c_fc``).

``head`` trains the task head alone (no adapter, every base weight frozen): the baseline that says what an
adapter adds. Everything but ``full``, ``head`` and MiLoRA's init is peft: LoRA, DoRA, PiSSA, KaSA
(``LoraConfig(kasa_config=...)``), CorDA (``init_lora_weights="corda"``; its calibration runs through
``apply_method(..., calibration=...)``), VeRA and FourierFT. To add a method, write a builder and add one row
to ``METHODS``; the test matrix in ``tests/test_methods.py`` then checks it on every architecture and target set.

:func:`apply_method` returns an :class:`AppliedMethod`: the adapted model together with everything its init
decided that later steps need (resolved targets, head modules, KaSA's truncation plan, the initial adapter of
SVD inits, CorDA's calibration time). Nothing is stored on the model itself.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from peftlab.config import MethodConfig  # the schema of a method's options: declared with the config
from peftlab.errors import PeftlabError
from peftlab.methods.options import corda_peft_config, kasa_peft_config
from peftlab.methods.targets import NO_TARGETS, ResolvedTargets, head_module_names, resolve_targets

if TYPE_CHECKING:  # torch and the SVD/KaSA/CorDA modules load when a model is adapted, not to list the table
    import torch
    from torch import nn

    from peftlab.methods.fused_qkv import FusedSplit


# --------------------------------------------------------------------------- builders


def _lora_config(cfg: MethodConfig, targets: ResolvedTargets, heads: list[str], task_type: str | None, **extra):
    from peft import LoraConfig

    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets.all_modules,
        modules_to_save=heads or None,
        task_type=task_type,
        fan_in_fan_out=bool(targets.conv1d),  # GPT-2's Conv1D stores (in, out); peft flips it per layer type
        **extra,
    )


def _peft(model, config):
    from peft import get_peft_model

    return get_peft_model(model, config)


def build_full(model, cfg, targets, heads, task_type):
    """Full fine-tuning of the selected projections (weights and biases) and the head; nothing else."""
    model.requires_grad_(False)
    for name, module in model.named_modules():
        if name in targets.all_modules or name in heads:
            module.requires_grad_(True)
    return model


def build_head(model, cfg, targets, heads, task_type):
    """Head-only fine-tuning: the task head trains, every base weight stays frozen, no adapter is added (``targets``
    is empty). Saved like ``full``, as a standard transformers folder."""
    return build_full(model, cfg, targets, heads, task_type)


def build_lora(model, cfg, targets, heads, task_type):
    return _peft(model, _lora_config(cfg, targets, heads, task_type))


def build_dora(model, cfg, targets, heads, task_type):
    return _peft(model, _lora_config(cfg, targets, heads, task_type, use_dora=True))


def build_pissa(model, cfg, targets, heads, task_type):
    # "pissa" is the exact (full) SVD; "pissa_niter_k" would be faster but randomised.
    return _peft(model, _lora_config(cfg, targets, heads, task_type, init_lora_weights="pissa"))


def build_milora(model, cfg, targets, heads, task_type):
    model = _peft(model, _lora_config(cfg, targets, heads, task_type, init_lora_weights=True))
    from peftlab.methods import svd_lora as svd_init

    svd_init.milora_init(model)
    return model


def build_kasa(model, cfg, targets, heads, task_type):
    """peft's KaSA + --kasa-truncate-rank/--kasa-mode; returns ``Built`` with the truncation plan."""
    from peftlab.methods import kasa

    config = _lora_config(cfg, targets, heads, task_type, kasa_config=kasa_peft_config(cfg.kasa))
    model, plan, dropped = kasa.build(model, cfg, config, targets.all_modules)
    return Built(model, kasa_plan=plan, kasa_dropped=dropped)


def build_corda(model, cfg, targets, heads, task_type, calibration):
    from peftlab.methods import corda

    config = _lora_config(cfg, targets, heads, task_type, init_lora_weights="corda",
                          corda_config=corda_peft_config(cfg.corda))
    return corda.build(model, config, cfg, calibration)


def build_vera(model, cfg, targets, heads, task_type):
    from peft import VeraConfig

    config = VeraConfig(
        r=cfg.rank,
        target_modules=targets.all_modules,
        modules_to_save=heads or None,
        vera_dropout=cfg.dropout,
        d_initial=cfg.vera.d_initial,
        save_projection=True,  # the frozen random A/B travel with the adapter: loading needs no PRNG replay
        task_type=task_type,
        fan_in_fan_out=bool(targets.conv1d),
    )
    return _peft(model, config)


def build_fourierft(model, cfg, targets, heads, task_type):
    from peft import FourierFTConfig

    config = FourierFTConfig(
        n_frequency=cfg.fourierft.n_frequency,
        scaling=cfg.fourierft.scaling,
        target_modules=targets.all_modules,
        modules_to_save=heads or None,
        task_type=task_type,
        fan_in_fan_out=bool(targets.conv1d),
    )
    return _peft(model, config)


@dataclass(frozen=True)
class Built:
    """What a builder returns when its init decides something the run needs later (else it returns the model)."""

    model: nn.Module
    kasa_plan: dict[str, int] | None = None  # KaSA: {module: components kept} where it differs from peft's
    kasa_dropped: dict | None = None  # KaSA with a plan: {module: (U_d S_d, Vh_d)} of the original weights


# What a method that adapts attention/MLP projections reads: which ones (--targets, --layers) and their learning
# rates (eta_QK = --lr, eta_V = --lr-ratio x --lr).
PROJECTION_OPTIONS = frozenset({"targets", "layers", "lr", "lr_ratio"})


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    build: Callable
    svd_init: bool = False  # rank must be < min(in_features, out_features) of every target
    fused_qkv: bool = True  # works on a fused-QKV model: its q/k/v split into nn.Linear layers (methods.fused_qkv)
    conv1d: bool = True  # can adapt a Conv1D layer (GPT-2's c_proj, c_fc: weights stored (in, out))
    extra_loss: Callable[[nn.Module, MethodConfig], torch.Tensor] | None = None
    converts_to_lora: bool = False  # saved adapter is converted to plain LoRA on the original base weights
    needs_calibration: bool = False  # build(..., calibration=callable): runs the model over task inputs (CorDA)
    # Learning rates used when --lr / --head-lr are not given: methods differ by orders of magnitude
    # (FourierFT's spectrum trains at ~5e-2, full fine-tuning at ~5e-5), so one global default would be
    # wrong for most of them. Values follow each method's paper for RoBERTa-base on GLUE.
    default_lr: float = 5e-4
    # The head's learning rate unless --head-lr is given; it does not follow --lr (one rule for every method,
    # shown by `peftlab methods` and recorded in result.json's group_lrs).
    default_head_lr: float = 5e-4
    # The config options this method reads; setting any other one explicitly is an error, never silence.
    # Flat names, as users type them: kasa_beta is cfg.kasa.beta. Every method that adapts projections reads
    # PROJECTION_OPTIONS (--targets, --layers, their --lr and V's --lr-ratio); head-only reads none of them.
    options: frozenset = frozenset({"rank", "alpha", "dropout"}) | PROJECTION_OPTIONS

    @property
    def uses_rank(self) -> bool:
        return "rank" in self.options

    @property
    def adapts_projections(self) -> bool:
        """Trains something on the --targets projections (every method but head-only)."""
        return "targets" in self.options


def _kasa_regulariser(model: nn.Module, cfg: MethodConfig) -> torch.Tensor:
    from peftlab.methods import kasa

    return kasa.regulariser(model, cfg)


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("full", "full fine-tuning of the selected projections and the head", build_full,
               default_lr=5e-5, default_head_lr=5e-4, options=PROJECTION_OPTIONS),
        Method("lora", "LoRA (Hu et al.)", build_lora),
        Method("dora", "DoRA: weight-decomposed LoRA (Liu et al.)", build_dora),
        Method("pissa", "PiSSA: LoRA initialised from the r largest singular components", build_pissa,
               svd_init=True, converts_to_lora=True),
        Method("milora", "MiLoRA: LoRA initialised from the r smallest singular components", build_milora,
               svd_init=True, converts_to_lora=True),
        Method("kasa", "KaSA: SVD truncation + learned singular values, regularised (Wang et al.)", build_kasa,
               svd_init=True, conv1d=False, extra_loss=_kasa_regulariser,  # peft's KaSA refuses fan_in_fan_out
               options=frozenset({"rank", "alpha", "dropout", "kasa_beta", "kasa_gamma", "kasa_reduction",
                                  "kasa_truncate_rank", "kasa_mode"}) | PROJECTION_OPTIONS),
        Method("corda", "CorDA: LoRA from a covariance-oriented SVD over task inputs (Yang et al.)", build_corda,
               svd_init=True, converts_to_lora=True, needs_calibration=True,
               options=frozenset({"rank", "alpha", "dropout", "corda_mode", "corda_samples"}) | PROJECTION_OPTIONS),
        Method("vera", "VeRA: frozen shared random A/B, learned scaling vectors", build_vera,
               default_lr=4e-3, default_head_lr=4e-3,
               options=frozenset({"rank", "dropout", "vera_d_initial"}) | PROJECTION_OPTIONS),
        Method("fourierft", "FourierFT: learned sparse spectrum of the update", build_fourierft,
               default_lr=5e-2, default_head_lr=5e-3,
               options=frozenset({"fourierft_n_frequency", "fourierft_scaling"}) | PROJECTION_OPTIONS),
        # The baseline of every adapter row: what the head alone learns (same head lr rule as the others).
        # default_lr is never used: nothing trains at --lr, and TrainConfig sets lr to the head's rate.
        Method("head", "head only: the task head trains, the base is frozen, no adapter", build_head,
               options=frozenset()),
    ]
}
METHOD_OPTIONS = frozenset().union(*(m.options for m in METHODS.values()))


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
    lr_ratio = getattr(cfg, "lr_ratio", 1.0)
    if "lr_ratio" in explicit and lr_ratio != 1 and "v" not in cfg.targets:
        raise PeftlabError(f"--lr-ratio {lr_ratio:g} sets eta_V = {lr_ratio:g} x eta_QK, but --targets "
                           f"{','.join(cfg.targets)} has no v, so nothing would get it",
                           fix="add v to --targets (e.g. --targets q,v), or drop --lr-ratio")


def _weight_shape(module: nn.Module) -> tuple[int, int]:
    weight = module.weight
    if type(module).__name__ == "Conv1D":  # stored transposed: (in, out)
        return weight.shape[1], weight.shape[0]
    return tuple(weight.shape)


def _check_rank(model: nn.Module, method: Method, cfg: MethodConfig, targets: ResolvedTargets) -> None:
    modules = dict(model.named_modules())
    smallest = min(min(_weight_shape(modules[name])) for name in targets.all_modules)
    if method.svd_init and cfg.rank >= smallest:
        raise PeftlabError(
            f"--rank {cfg.rank} is too large for {method.name}: it must be < min(in, out) = {smallest} of the "
            "adapted weights (the SVD init keeps at least one component)",
            fix=f"use --rank {max(1, smallest // 2)} or smaller",
        )
    if method.name == "fourierft":  # peft raises a ValueError deep in layer construction otherwise
        cells = min(_weight_shape(modules[name])[0] * _weight_shape(modules[name])[1] for name in targets.all_modules)
        if cfg.fourierft.n_frequency > cells:
            raise PeftlabError(f"--fourierft-n-frequency {cfg.fourierft.n_frequency} is more than the {cells} entries of "
                               "the smallest adapted weight", fix=f"use --fourierft-n-frequency {cells} or fewer")
    # LoRA-style factors (not VeRA, whose shared random basis may be wider than the layer): a rank above
    # min(in, out) adds nothing a full-rank update lacks and costs more parameters than the matrix itself.
    if method.uses_rank and method.name != "vera" and cfg.rank > smallest:
        raise PeftlabError(
            f"--rank {cfg.rank} is larger than min(in, out) = {smallest} of the adapted weights: the adapter would "
            f"have more parameters than the matrices it adapts",
            fix=f"use --rank {smallest} or smaller (or --method full)",
        )


# Import names whose pip package is called something else.
_PIP_NAMES = {"attr": "attrs", "sklearn": "scikit-learn", "yaml": "pyyaml", "PIL": "pillow"}


@contextlib.contextmanager
def _missing_package_is_a_user_error(method: str):
    """A builder (usually peft) importing a package that is not installed: one line naming it, not a traceback."""
    try:
        yield
    except ImportError as err:
        module = (err.name or "an unnamed module").split(".")[0]
        package = _PIP_NAMES.get(module, module)
        raise PeftlabError(f"method '{method}' needs the Python package '{package}' (import {module!r} failed), "
                           "which is not installed", fix=f"pip install {package} (or reinstall peftlab, which declares it)") \
            from None


@dataclass(frozen=True)
class InitStats:
    """What a method's init decided or measured, needed after it (saving, result.json, plots)."""

    calibration_seconds: float | None = None  # CorDA: wall time of the forward passes over calibration inputs
    kasa_plan: dict[str, int] | None = None  # KaSA: truncations peft's loader would not reproduce (saved)
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
    calibration_seconds = None
    # list(heads): a copy, since peft's SEQ_CLS wrapper extends modules_to_save in place
    if method.needs_calibration:
        if calibration is None:
            raise PeftlabError(f"{cfg.method} needs calibration inputs to build its init",
                               fix="run it through `peftlab train` (which passes --corda-samples training inputs), "
                                   "or pass apply_method(..., calibration=peftlab.methods.corda.calibration_runner(...))")
        timed = _Timed(calibration)
        with _missing_package_is_a_user_error(cfg.method):
            built = method.build(model, cfg, targets, list(heads), task_type, calibration=timed)
        calibration_seconds = timed.seconds
    else:
        with _missing_package_is_a_user_error(cfg.method):
            built = method.build(model, cfg, targets, list(heads), task_type)
    if not isinstance(built, Built):
        built = Built(built)
    model = built.model
    from peftlab.methods import kasa
    from peftlab.methods import svd_lora as svd_init

    stats = InitStats(
        calibration_seconds=calibration_seconds,
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


class _Timed:
    """Wraps a calibration callable and adds up the wall time of its calls."""

    def __init__(self, run: Callable[[], None]):
        self.run, self.seconds = run, 0.0

    def __call__(self) -> None:
        import time

        start = time.perf_counter()
        try:
            self.run()
        finally:
            self.seconds += time.perf_counter() - start


def extra_loss(model: nn.Module, cfg: MethodConfig | None) -> torch.Tensor | None:
    """The auxiliary loss of ``cfg``'s method on ``model`` (KaSA's regulariser), or None: the training loop adds
    it to the task loss."""
    if cfg is None or METHODS[cfg.method].extra_loss is None:
        return None
    return METHODS[cfg.method].extra_loss(model, cfg)
