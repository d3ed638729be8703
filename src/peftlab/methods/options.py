"""Per-method option groups turned into peft's sub-configs.

peft nests a method's own knobs in a sub-config (``LoraConfig(kasa_config=KasaConfig(beta=...))``); peftlab's
groups (:class:`~peftlab.config.KasaOptions`, :class:`~peftlab.config.CordaOptions`, ...) are declared with the
config, where every option is (``cfg.kasa.beta``: type, range, roles, help). This module builds peft's
sub-config of a group, for the builders in :mod:`peftlab.methods.table`. peft is imported when one is built.
"""

from __future__ import annotations

from peftlab.config import CordaOptions, KasaOptions


def kasa_peft_config(options: KasaOptions):
    """peft's ``KasaConfig`` (the regulariser weights peft's KaSA layers carry)."""
    from peft import KasaConfig

    return KasaConfig(beta=options.beta, gamma=options.gamma)


def corda_peft_config(options: CordaOptions):
    """peft's ``CordaConfig`` (the calibration itself runs through ``apply_method(..., calibration=...)``)."""
    from peft.tuners.lora.config import CordaConfig

    return CordaConfig(corda_method=options.mode)
