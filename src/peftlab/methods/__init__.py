"""Methods: how a backbone is made trainable.

Owns the METHODS table (LoRA, DoRA, PiSSA, MiLoRA, KaSA, CorDA, VeRA, FourierFT, full FT) and their
builders on Hugging Face peft, target resolution (q/k/v/o, MLP, layer ranges), the per-projection
optimiser groups (eta_V = lambda * eta_QK), KaSA's regulariser, MiLoRA's and CorDA's inits, conversion of
SVD-initialised adapters to plain LoRA, and save / load / merge.

May import: ``peftlab.errors``, ``peftlab.models.registry``. Never training, the lab, bench or the CLI.
"""
