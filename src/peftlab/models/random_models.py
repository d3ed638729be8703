"""Architectures built from a config with random weights: ``tiny-*`` for tests, ``*-random`` for speed benchmarks.

Each entry is data (``AutoConfig.for_model(model_type, **config)``) and borrows a real tokenizer
(``tokenizer_from``). ``tiny-gpt2``, ``tiny-phi3``, ``tiny-falcon`` and ``tiny-modernbert`` fuse q, k and v into
one matrix (split for training: :mod:`peftlab.methods.fused_qkv`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
DECODER_VOCAB = 49152  # smollm2-135m's tokenizer, which the tiny decoders borrow
ENCODER_VOCAB = 30522  # minilm-l6's (BERT WordPiece: [PAD] 0, [CLS] 101, [SEP] 102)


@dataclass(frozen=True)
class RandomModel:
    name: str
    description: str
    family: str  # "encoder" or "decoder"
    model_type: str
    tokenizer_from: str
    config: dict[str, Any] = field(default_factory=dict)

    def config_builder(self) -> Callable[[], Any]:
        def build():
            from transformers import AutoConfig

            return AutoConfig.for_model(self.model_type, **self.config)

        return build


RANDOM_MODELS: tuple[RandomModel, ...] = (
    RandomModel("tiny-bert", "random BERT, 2 layers, 32 wide (tests)", "encoder", "bert", "minilm-l6",
                dict(vocab_size=ENCODER_VOCAB, **TINY)),
    RandomModel("tiny-llama", "random Llama, 2 layers, 32 wide, GQA (tests)", "decoder", "llama", "smollm2-135m",
                dict(vocab_size=DECODER_VOCAB, num_key_value_heads=2, tie_word_embeddings=True, **TINY)),
    RandomModel("tiny-gpt2", "random GPT-2, 2 layers, 32 wide; q, k, v fused in the Conv1D attn.c_attn (tests)",
                "decoder", "gpt2", "smollm2-135m", dict(vocab_size=DECODER_VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                         n_inner=64)),
    # pad_token_id None: the loader takes the tokenizer's (Phi-3's default, 32000, is another vocabulary's)
    RandomModel("tiny-phi3", "random Phi-3, 2 layers, 32 wide, GQA 4/2; q, k, v fused in self_attn.qkv_proj (tests)",
                "decoder", "phi3", "smollm2-135m",
                dict(vocab_size=DECODER_VOCAB, num_key_value_heads=2, pad_token_id=None, **TINY)),
    RandomModel("tiny-falcon", "random Falcon (new_decoder_architecture: 4 query heads in 2 kv groups), 2 layers, 32 "
                "wide; q, k, v fused, group-interleaved, in self_attention.query_key_value (tests)", "decoder",
                "falcon", "smollm2-135m", dict(vocab_size=DECODER_VOCAB, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
                                               ffn_hidden_size=64)),
    RandomModel("tiny-modernbert", "random ModernBERT, 2 layers, 32 wide; q, k, v fused in attn.Wqkv (tests)",
                "encoder", "modernbert", "minilm-l6",
                dict(vocab_size=ENCODER_VOCAB, pad_token_id=0, cls_token_id=101, sep_token_id=102, bos_token_id=101,
                     eos_token_id=102, **TINY)),
    RandomModel("roberta-base-random", "RoBERTa-base shape with random weights (speed benchmarks)", "encoder",
                "roberta", "minilm-l6", dict(vocab_size=50265, max_position_embeddings=514, type_vocab_size=1)),
    RandomModel("llama3-8b-2l-random", "Llama-3.1-8B layer shape (4096 wide, GQA 32/8, 14336 FFN), 2 layers, random "
                "(speed benchmarks)", "decoder", "llama", "smollm2-135m",
                dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                     num_attention_heads=32, num_key_value_heads=8)),
)
