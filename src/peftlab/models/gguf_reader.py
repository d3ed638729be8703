"""One GGUF parse per file while transformers converts it (tokenizer, config and tensors each ask for a reader),
and one tensor-name map per architecture (transformers builds one per module of the model)."""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Any


@contextmanager
def gguf_parsed_once():
    """Within the block, each GGUF file is parsed once and each tensor-name map built once. Where the cost hides:

    * transformers builds a new ``gguf.GGUFReader`` for the tokenizer, the config and the tensors, and a reader's
      constructor walks every metadata entry in Python (the token list and merges: 4 s for SmolLM2's 49k tokens,
      17 s for Qwen's 151k), so a conversion parsed the same file three times. The readers only read (a memory
      map), so one reader per path serves all three;
    * to name the tensors, transformers walks the model's module tree and calls ``gguf.get_tensor_name_map(arch,
      n_blocks)`` at every module (397 for SmolLM2), which rebuilds the same table each time (measured alone:
      a SmolLM2 conversion 15 -> 10 s with one map). The map is only read (``get_name``), so one per (arch, n_blocks) serves them all.

    transformers imports both names from ``gguf`` when it calls them, which is what makes the swap apply; should a
    later version bind them earlier, the conversion is slower, never different."""
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, Any] = {}

    def one_reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, functools.cache(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map
