"""Methods: how a backbone is made trainable. Each method is registered once in :mod:`peftlab.methods.registry`
(its builder on Hugging Face peft, its options, limits and default rates); the rest targets projections, groups
the optimizer's rates, runs the methods' own inits and regularisers, and saves, loads and merges."""
