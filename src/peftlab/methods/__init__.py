"""Methods: how a backbone is made trainable.

Owns the method registry (:mod:`peftlab.methods.registry`: LoRA, DoRA, PiSSA, MiLoRA, KaSA, CorDA, VeRA, FourierFT,
full FT, head only, each registered once with its builder on Hugging Face peft), target resolution (q/k/v/o, MLP,
layer ranges), the per-projection optimiser groups (eta_V = lambda * eta_QK), KaSA's regulariser, MiLoRA's and
CorDA's inits, conversion of SVD-initialised adapters to plain LoRA, and save / load / merge.

May import: ``peftlab.errors``, ``peftlab.models.registry``. Never training, the lab, bench or the CLI.
"""
