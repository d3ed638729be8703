"""The method registry: every fine-tuning method peftlab offers, registered once, by name.

One :class:`Method` row per method, as peft's ``register_peft_method``: its builder (usually a peft config), the
options it reads and its own option group, whether its saved adapter is converted to plain LoRA, its default rates
and limits. ``config.MethodName``, ``config.MethodConfig``'s groups (``cfg.kasa``: ``--kasa-*``), ``peftlab
methods``, the explicit-option check and :func:`peftlab.methods.table.apply_method` read this table. Torch-free on
import: the config (a leaf) reads the rows from here; the builders import peft when a model is adapted.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Literal

from peftlab.config_roles import POSITIVE, OptionGroup, Range, option

if TYPE_CHECKING:
    import torch
    from torch import nn


# --------------------------------------------------------------------------- the methods' own option groups
# Frozen dataclasses (a config copied with dataclasses.replace shares its groups). PREFIX is the flat names'
# prefix (kasa_beta, --kasa-beta) and MethodConfig's field (cfg.kasa); the docstring titles the --help section.


@dataclass(frozen=True)
class KasaOptions(OptionGroup):
    """KaSA"""

    PREFIX = "kasa"
    beta: float = option(1e-4, Range(0), key_v1=True, training_only=True)
    """KaSA: weight of ||Delta_sigma||^2 in the loss."""
    gamma: float = option(1e-3, Range(0), key_v1=True, training_only=True)
    """KaSA: weight of the orthogonality penalty ||dU^T dU - I||_F + ||dV dV^T - I||_F."""
    reduction: Literal["mean", "sum"] = option("mean", noun="KaSA reduction", key_v1=True, training_only=True)
    """KaSA: combine the per-module regularisers by 'mean' (the authors' code) or 'sum' (peft)."""
    truncate_rank: int | None = option(None, Range(1), key_v1=True)
    """KaSA: drop this many smallest singular components of each adapted base weight (default: --rank)."""
    mode: Literal["paper", "reference"] = option("paper", noun="KaSA mode", lower=True, key_v1=True)
    """KaSA: 'paper' (peft and the paper) or 'reference' (the authors' code: keeps in_features - k components, d x d orthogonality penalty); see docs/KASA_MODES.md."""


@dataclass(frozen=True)
class CordaOptions(OptionGroup):
    """CorDA"""

    PREFIX = "corda"
    mode: Literal["ipm", "kpm"] = option("ipm", noun="CorDA mode", lower=True, key_v1=True)
    """CorDA: 'ipm' (instruction-previewed: adapter from the r largest task-oriented components) or 'kpm' (knowledge-preserved: the r smallest)."""
    samples: int = option(256, Range(1), key_v1=True)
    """CorDA: training examples run through the model to collect the input covariances."""


@dataclass(frozen=True)
class VeraOptions(OptionGroup):
    """VeRA"""

    PREFIX = "vera"
    d_initial: float = option(0.1, Range(), key_v1=True)
    """VeRA: initial value of the d scaling vector."""


@dataclass(frozen=True)
class FourierFTOptions(OptionGroup):
    """FourierFT"""

    PREFIX = "fourierft"
    n_frequency: int = option(1000, Range(1), key_v1=True)
    """FourierFT: number of learned spectral coefficients per adapted matrix."""
    scaling: float = option(150.0, POSITIVE, key_v1=True)
    """FourierFT: scaling of the inverse DFT (the FourierFT paper uses 150 for RoBERTa-base on GLUE)."""


# --------------------------------------------------------------------------- builders


def _adapting(targets, heads: list[str], task_type: str | None) -> dict:
    """The options every peft tuner config takes alike: what to adapt, the head to train in full, the task."""
    # GPT-2's Conv1D stores (in, out); peft flips it per layer type
    return dict(target_modules=targets.all_modules, modules_to_save=heads or None, task_type=task_type,
                fan_in_fan_out=bool(targets.conv1d))


def _lora_config(cfg, targets, heads: list[str], task_type: str | None, **extra):
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      **_adapting(targets, heads, task_type), **extra)


def _peft(model, config):
    from peft import get_peft_model

    return get_peft_model(model, config)


def build_full(model, cfg, targets, heads, task_type):
    """Full fine-tuning of the selected projections (weights and biases) and the head; nothing else. Head-only
    fine-tuning is this with no targets (saved like ``full``, as a standard transformers folder)."""
    model.requires_grad_(False)
    for name, module in model.named_modules():
        if name in targets.all_modules or name in heads:
            module.requires_grad_(True)
    return model


def _lora(**extra) -> Callable:
    """The builder of a peft LoRA variant: LoRA itself, DoRA (``use_dora=True``), PiSSA (``init_lora_weights=
    "pissa"``: the exact SVD; "pissa_niter_k" would be faster but randomised)."""
    def build(model, cfg, targets, heads, task_type):
        return _peft(model, _lora_config(cfg, targets, heads, task_type, **extra))

    return build


def build_milora(model, cfg, targets, heads, task_type):
    model = _peft(model, _lora_config(cfg, targets, heads, task_type, init_lora_weights=True))
    from peftlab.methods import svd_lora as svd_init

    svd_init.milora_init(model)
    return model


def build_kasa(model, cfg, targets, heads, task_type):
    """peft's KaSA + --kasa-truncate-rank/--kasa-mode; returns ``Built`` with the truncation plan."""
    from peft import KasaConfig  # the regulariser weights peft's KaSA layers carry

    from peftlab.methods import kasa

    config = _lora_config(cfg, targets, heads, task_type,
                          kasa_config=KasaConfig(beta=cfg.kasa.beta, gamma=cfg.kasa.gamma))
    model, plan, dropped = kasa.build(model, cfg, config, targets.all_modules)
    return Built(model, kasa_plan=plan, kasa_dropped=dropped)


def build_corda(model, cfg, targets, heads, task_type, calibration):
    from peft.tuners.lora.config import CordaConfig  # the calibration runs through apply_method(..., calibration=)

    from peftlab.methods import corda

    config = _lora_config(cfg, targets, heads, task_type, init_lora_weights="corda",
                          corda_config=CordaConfig(corda_method=cfg.corda.mode))
    return corda.build(model, config, cfg, calibration)


def build_vera(model, cfg, targets, heads, task_type):
    from peft import VeraConfig

    # save_projection: the frozen random A/B travel with the adapter, so loading needs no PRNG replay
    return _peft(model, VeraConfig(r=cfg.rank, vera_dropout=cfg.dropout, d_initial=cfg.vera.d_initial,
                                   save_projection=True, **_adapting(targets, heads, task_type)))


def build_fourierft(model, cfg, targets, heads, task_type):
    from peft import FourierFTConfig

    return _peft(model, FourierFTConfig(n_frequency=cfg.fourierft.n_frequency, scaling=cfg.fourierft.scaling,
                                        **_adapting(targets, heads, task_type)))


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
    extra_loss: Callable[[nn.Module, object], torch.Tensor] | None = None  # (model, its MethodConfig)
    converts_to_lora: bool = False  # saved adapter is converted to plain LoRA on the original base weights
    # The rank is bounded by min(in, out) of every adapted weight (LoRA-style factors; not VeRA, whose shared random
    # basis may be wider than the layer).
    rank_within_layer: bool = True
    # The method's own limit on the adapted weights' (out, in) shapes: raises a PeftlabError (else peft fails deep in
    # layer construction).
    check_shapes: Callable[[object, list[tuple[int, int]]], None] | None = None
    needs_calibration: bool = False  # build(..., calibration=callable): runs the model over task inputs (CorDA)
    # Learning rates used when --lr / --head-lr are not given: methods differ by orders of magnitude
    # (FourierFT's spectrum trains at ~5e-2, full fine-tuning at ~5e-5), so one global default would be
    # wrong for most of them. Values follow each method's paper for RoBERTa-base on GLUE.
    default_lr: float = 5e-4
    # The head's learning rate unless --head-lr is given; it does not follow --lr (one rule for every method,
    # shown by `peftlab methods` and recorded in result.json's group_lrs).
    default_head_lr: float = 5e-4
    # The config options this method reads, besides its own group's (added to them); setting any other one
    # explicitly is an error, never silence. Every method that adapts projections reads PROJECTION_OPTIONS
    # (--targets, --layers, their --lr and V's --lr-ratio); head-only reads none of them.
    options: frozenset = frozenset({"rank", "alpha", "dropout"}) | PROJECTION_OPTIONS
    # Its own options (cfg.kasa: --kasa-beta, ...): MethodConfig holds one field per method that has them.
    group: type[OptionGroup] | None = None

    def __post_init__(self):
        if self.group is not None:  # flat names, as users type them: kasa_beta is cfg.kasa.beta
            own = {f"{self.group.PREFIX}_{f.name}" for f in fields(self.group)}
            object.__setattr__(self, "options", self.options | own)

    @property
    def uses_rank(self) -> bool:
        return "rank" in self.options

    @property
    def adapts_projections(self) -> bool:
        """Trains something on the --targets projections (every method but head-only)."""
        return "targets" in self.options


def _fourierft_fits(cfg, shapes: list[tuple[int, int]]) -> None:
    from peftlab.errors import PeftlabError

    cells = min(rows * cols for rows, cols in shapes)
    if cfg.fourierft.n_frequency > cells:
        raise PeftlabError(f"--fourierft-n-frequency {cfg.fourierft.n_frequency} is more than the {cells} entries of "
                           "the smallest adapted weight", fix=f"use --fourierft-n-frequency {cells} or fewer")


def _kasa_regulariser(model: nn.Module, cfg) -> torch.Tensor:
    from peftlab.methods import kasa

    return kasa.regulariser(model, cfg)


METHODS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("full", "full fine-tuning of the selected projections and the head", build_full,
               default_lr=5e-5, default_head_lr=5e-4, options=PROJECTION_OPTIONS),
        Method("lora", "LoRA (Hu et al.)", _lora()),
        Method("dora", "DoRA: weight-decomposed LoRA (Liu et al.)", _lora(use_dora=True)),
        Method("pissa", "PiSSA: LoRA initialised from the r largest singular components",
               _lora(init_lora_weights="pissa"), svd_init=True, converts_to_lora=True),
        Method("milora", "MiLoRA: LoRA initialised from the r smallest singular components", build_milora,
               svd_init=True, converts_to_lora=True),
        Method("kasa", "KaSA: SVD truncation + learned singular values, regularised (Wang et al.)", build_kasa,
               svd_init=True, conv1d=False, extra_loss=_kasa_regulariser,  # peft's KaSA refuses fan_in_fan_out
               group=KasaOptions),
        Method("corda", "CorDA: LoRA from a covariance-oriented SVD over task inputs (Yang et al.)", build_corda,
               svd_init=True, converts_to_lora=True, needs_calibration=True, group=CordaOptions),
        Method("vera", "VeRA: frozen shared random A/B, learned scaling vectors", build_vera,
               default_lr=4e-3, default_head_lr=4e-3, rank_within_layer=False,
               options=frozenset({"rank", "dropout"}) | PROJECTION_OPTIONS, group=VeraOptions),
        Method("fourierft", "FourierFT: learned sparse spectrum of the update", build_fourierft,
               default_lr=5e-2, default_head_lr=5e-3, check_shapes=_fourierft_fits,
               options=PROJECTION_OPTIONS, group=FourierFTOptions),
        # The baseline of every adapter row: what the head alone learns (same head lr rule as the others).
        # default_lr is never used: nothing trains at --lr, and TrainConfig sets lr to the head's rate.
        Method("head", "head only: the task head trains, the base is frozen, no adapter", build_full,
               options=frozenset()),
    ]
}
METHOD_NAMES = tuple(METHODS)  # config.MethodName: the --method choices, in this order
# config.MethodConfig's option groups, by field name (cfg.kasa), in the table's order
METHOD_GROUPS = {m.group.PREFIX: m.group for m in METHODS.values() if m.group is not None}
METHOD_OPTIONS = frozenset().union(*(m.options for m in METHODS.values()))

