"""The ``peftlab`` command line: the entry point and the listing commands.

Subcommand modules register their own parsers and are imported lazily, so ``peftlab --help`` and
``peftlab models`` do not import torch.
"""
