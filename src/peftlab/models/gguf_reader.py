"""One GGUF parse per file while transformers converts it (tokenizer, config and tensors each ask for a reader)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any


@contextmanager
def gguf_parsed_once():
    """Within the block, each GGUF file is parsed once. Where the cost hides: transformers builds a new
    ``gguf.GGUFReader`` for the tokenizer, the config and the tensors, and a reader's constructor walks every
    metadata entry in Python (the token list and merges: 4 s for SmolLM2's 49k tokens, 17 s for Qwen's 151k), so a
    conversion parsed the same file three times. The readers only read (a memory map), so one reader per path
    serves all three. transformers imports ``GGUFReader`` from ``gguf`` when it calls it, which is what makes the
    swap apply; should a later version bind it earlier, the conversion is slower, never different."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple, Any] = {}

    def one_reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = one_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
