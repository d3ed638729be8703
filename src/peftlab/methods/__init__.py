"""Methods: how a backbone is made trainable, each registered once in :mod:`peftlab.methods.registry`."""
