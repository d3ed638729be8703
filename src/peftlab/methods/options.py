"""Per-method option groups of :class:`~peftlab.methods.table.MethodConfig`, nested as in peft.

peft nests a method's own knobs in a sub-config (``LoraConfig(kasa_config=KasaConfig(beta=...))``); peftlab
does the same: ``MethodConfig(method="kasa", kasa=KasaOptions(beta=1e-2))``, read as ``cfg.kasa.beta``. Each
group checks its own values (one-line :class:`~peftlab.errors.PeftlabError` naming the flag) and, where
peft has a sub-config for it, builds that (:meth:`KasaOptions.peft_config`, :meth:`CordaOptions.peft_config`).

Outside Python the options keep their flat names, ``<group>_<option>``: the flags (``--kasa-beta``), YAML and
sweep keys (``kasa_beta: 0.01``; a config file may also nest them, ``kasa: {beta: 0.01}``), ``config.yaml``,
result.json's ``config`` and therefore the run keys (:mod:`peftlab.config_cli` flattens and nests).

Torch-free on purpose: the config layer and ``peftlab methods`` import this without loading a model stack.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from peftlab.errors import PeftlabError, closest, unknown

KASA_MODES = ("paper", "reference")
CORDA_MODES = ("ipm", "kpm")


def require_finite(value, flag: str, *, positive: bool = False, nonnegative: bool = False) -> None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PeftlabError(f"{flag} must be a number, got '{value}'") from None
    if not math.isfinite(number):
        raise PeftlabError(f"{flag} must be a finite number, got {value}", fix=f"give {flag} a finite value")
    if positive and number <= 0:
        raise PeftlabError(f"{flag} must be > 0, got {value}", fix=f"give {flag} a positive value")
    if nonnegative and number < 0:
        raise PeftlabError(f"{flag} must be >= 0, got {value}", fix=f"give {flag} a value >= 0")


def require_int(value, flag: str, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PeftlabError(f"{flag} must be an integer, got '{value}'")
    if positive and value <= 0:
        raise PeftlabError(f"{flag} must be > 0, got {value}", fix=f"give {flag} a positive integer (e.g. 8)")


def _lowered(options, name: str) -> str:
    value = str(getattr(options, name)).lower()
    object.__setattr__(options, name, value)  # frozen: normalised once, here
    return value


# Frozen: a config copied with dataclasses.replace shares its groups, so none may change under the other.
@dataclass(frozen=True)
class KasaOptions:
    """KaSA (--kasa-*)"""

    beta: float = 1e-4
    """KaSA: weight of ||Delta_sigma||^2 in the loss."""
    gamma: float = 1e-3
    """KaSA: weight of the orthogonality penalty ||dU^T dU - I||_F + ||dV dV^T - I||_F."""
    reduction: str = "mean"
    """KaSA: combine the per-module regularisers by 'mean' (the authors' code) or 'sum' (peft)."""
    truncate_rank: int | None = None
    """KaSA: drop this many smallest singular components of each adapted base weight (default: --rank)."""
    mode: str = "paper"
    """KaSA: 'paper' (peft and the paper) or 'reference' (the authors' code: keeps in_features - k components, d x d orthogonality penalty); see docs/KASA_MODES.md."""

    def __post_init__(self):
        require_finite(self.beta, "--kasa-beta", nonnegative=True)
        require_finite(self.gamma, "--kasa-gamma", nonnegative=True)
        if self.reduction not in ("mean", "sum"):
            raise PeftlabError(f"unknown KaSA reduction '{self.reduction}'", where="--kasa-reduction",
                               fix="use mean or sum")
        if self.truncate_rank is not None:
            require_int(self.truncate_rank, "--kasa-truncate-rank", positive=True)
        if _lowered(self, "mode") not in KASA_MODES:
            raise unknown("KaSA mode", self.mode, KASA_MODES, where="--kasa-mode")

    def peft_config(self):
        """peft's ``KasaConfig`` (the regulariser weights peft's KaSA layers carry)."""
        from peft import KasaConfig

        return KasaConfig(beta=self.beta, gamma=self.gamma)


@dataclass(frozen=True)
class CordaOptions:
    """CorDA (--corda-*)"""

    mode: str = "ipm"
    """CorDA: 'ipm' (instruction-previewed: adapter from the r largest task-oriented components) or 'kpm' (knowledge-preserved: the r smallest)."""
    samples: int = 256
    """CorDA: training examples run through the model to collect the input covariances."""

    def __post_init__(self):
        if _lowered(self, "mode") not in CORDA_MODES:
            raise unknown("CorDA mode", self.mode, CORDA_MODES, where="--corda-mode")
        require_int(self.samples, "--corda-samples", positive=True)

    def peft_config(self):
        """peft's ``CordaConfig`` (the calibration itself runs through ``apply_method(..., calibration=...)``)."""
        from peft.tuners.lora.config import CordaConfig

        return CordaConfig(corda_method=self.mode)


@dataclass(frozen=True)
class VeraOptions:
    """VeRA (--vera-*)"""

    d_initial: float = 0.1
    """VeRA: initial value of the d scaling vector."""


@dataclass(frozen=True)
class FourierFTOptions:
    """FourierFT (--fourierft-*)"""

    n_frequency: int = 1000
    """FourierFT: number of learned spectral coefficients per adapted matrix."""
    scaling: float = 150.0
    """FourierFT: scaling of the inverse DFT (the FourierFT paper uses 150 for RoBERTa-base on GLUE)."""

    def __post_init__(self):
        require_int(self.n_frequency, "--fourierft-n-frequency", positive=True)
        require_finite(self.scaling, "--fourierft-scaling", positive=True)


def as_options(cls, value, group: str):
    """``value`` as a ``cls`` group: an instance as is, a mapping (``{"beta": 0.01}``) built into one."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise PeftlabError(f"'{group}' must be {cls.__name__} or a mapping of its options, got {value!r}",
                           fix=f"e.g. {group}: {{{dataclasses.fields(cls)[0].name}: ...}} in YAML, or "
                               f"{group}_{dataclasses.fields(cls)[0].name}: ...")
    names = [f.name for f in dataclasses.fields(cls)]
    given = {str(k).replace("-", "_"): v for k, v in value.items()}
    for key in given:
        if key not in names:
            raise PeftlabError(f"unknown {group} option '{key}'{closest(key, names)}",
                               fix=f"{group} has: {', '.join(names)}")
    return cls(**given)
