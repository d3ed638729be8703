"""Model FLOP utilisation (peftlab.bench.flops, peftlab.bench.peak): the FLOPs counted from the architecture equal
what torch.utils.flop_counter.FlopCounterMode counts for a real train step (forward + backward, eager attention so
every product is a counted matmul) on tiny encoders and decoders, for head-only, LoRA, full fine-tuning and
layer-restricted adapters; the GEMM peak probe reports a positive rate per size. No timing is asserted."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from peftlab.bench.flops import Architecture, Layer, Linear, architecture, count_step, step_flops
from peftlab.bench.peak import gemm_peak
from peftlab.methods.table import MethodConfig, apply_method

BATCH, LENGTH = 3, 9


def tiny(model_type: str, head: str):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    extra = {"llama": dict(num_key_value_heads=2), "qwen2": dict(num_key_value_heads=2)}.get(model_type, {})
    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, pad_token_id=0, num_labels=2, **extra)
    config._attn_implementation = "eager"  # matmuls FlopCounterMode sees (it has no formula for CPU SDPA)
    torch.manual_seed(0)
    auto = AutoModelForCausalLM if head == "causal-lm" else AutoModelForSequenceClassification
    return auto.from_config(config).train()


def adapted(model, method: str, targets, head: str, layers=None):
    if method == "head":
        from peftlab.methods.targets import head_module_names

        model.requires_grad_(False)
        for name in head_module_names(model):
            model.get_submodule(name).requires_grad_(True)
        return model
    cfg = MethodConfig(method=method, targets=targets, rank=4, layers=layers)
    task_type = "CAUSAL_LM" if head == "causal-lm" else "SEQ_CLS"
    return apply_method(model, cfg, train_head=head != "causal-lm", task_type=task_type).model


def measured_flops(model, head: str) -> int:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (BATCH, LENGTH), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["labels"] = ids.clone() if head == "causal-lm" else torch.tensor([0, 1, 0])
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    return counter.get_total_flops()


CASES = [  # (model type, head, method, targets, layers)
    ("bert", "classification", "head", "q", None),
    ("bert", "classification", "lora", "q,v", None),
    ("bert", "classification", "lora", "q,k,v,o,up,down", None),
    ("bert", "classification", "full", "q,v", None),
    ("bert", "classification", "lora", "v", "1"),  # the lowest trainable parameter in layer 1
    ("roberta", "classification", "lora", "q,v", None),  # dense + out_proj head on <s>
    ("llama", "classification", "lora", "q,v", None),  # GQA; the score head runs on every token
    ("llama", "causal-lm", "lora", "q,v", None),
    ("llama", "causal-lm", "lora", "q,k,v,o,gate,up,down", None),
    ("llama", "causal-lm", "dora", "q,v", None),  # counted as its low-rank part; the weight norm is noted
    ("qwen2", "causal-lm", "full", "k,o", None),
]


@pytest.mark.parametrize("model_type,head,method,targets,layers", CASES)
def test_counted_flops_equal_flop_counter_mode(model_type, head, method, targets, layers, single_thread):
    model = adapted(tiny(model_type, head), method, targets, head, layers)
    counted, why_not = step_flops(model, [LENGTH] * BATCH)
    assert why_not is None, why_not
    measured = measured_flops(model, head)
    if method == "dora":  # DoRA also multiplies B by A for its weight norm: not model FLOPs, and said so
        assert any("DoRA" in note for note in counted.notes) and measured > counted.total
        return
    assert counted.total == measured
    assert counted.tokens == BATCH * LENGTH and counted.examples == BATCH
    assert (counted.adapter > 0) == (method in ("lora", "dora"))


def test_the_count_follows_the_definition():
    """By hand on one layer: forward 2mkn per product; backward 2mkn per operand needing a gradient."""
    d, f, r, n = 8, 16, 2, 5

    def lin(name, i, o, **kw):
        return Linear(name, i, o, **kw)

    frozen = Layer(lin("q", d, d), lin("k", d, d), lin("v", d, d), lin("o", d, d),
                   (lin("up", d, f), lin("down", f, d)), query_heads=2, head_dim=4)
    linear_fwd = 2 * n * (4 * d * d + 2 * d * f)
    attention_fwd = 2 * (2 * 2 * 4 * n * n)
    nothing = count_step(Architecture("bert", (frozen,), (), head_per_token=False), [n])
    assert (nothing.forward, nothing.backward) == (linear_fwd + attention_fwd, 0)  # nothing trains: no backward

    head = (lin("classifier", d, 2, trains=True),)  # head only: its weight gradient, no input gradient
    only_head = count_step(Architecture("bert", (frozen,), head, head_per_token=False), [n])
    assert only_head.backward == 2 * 1 * d * 2

    lora_v = Layer(frozen.q, frozen.k, lin("v", d, d, lora_rank=r, adapted=True), frozen.o, frozen.mlp, 2, 4)
    step = count_step(Architecture("bert", (lora_v,), (), head_per_token=False), [n])
    adapter_fwd = 2 * n * (d * r + r * d)
    # backward: A's weight; B's weight and input; P V's value operand (not P: q and k need none); o's input;
    # the MLP's inputs (no weight gradients: frozen); nothing below v (q, k, the layer's input need none)
    expected = (2 * n * d * r) + 2 * (2 * n * r * d) + 2 * 2 * 4 * n * n + 2 * n * d * d + 2 * n * (2 * d * f)
    assert step.forward == linear_fwd + attention_fwd + adapter_fwd and step.backward == expected
    assert step.adapter == adapter_fwd + 3 * 2 * n * d * r


def test_architecture_is_read_through_peft_wrappers_and_refuses_what_it_cannot_count(tiny_model):
    model = adapted(tiny("llama", "causal-lm"), "lora", "q,v", "causal-lm")
    arch = architecture(model)
    assert len(arch.layers) == 2 and arch.head_per_token and arch.head[0].out_features == 128
    first = arch.layers[0]
    assert first.q.lora_rank == 4 and first.k.lora_rank == 0 and not first.q.trains and first.gated
    assert (first.query_heads, first.head_dim, first.k.out_features) == (4, 8, 16)  # GQA: 2 kv heads
    counted, why_not = step_flops(tiny_model("deberta-v2"), [4])
    assert counted is None and "deberta-v2" in why_not


def test_gemm_peak_probe_reports_every_size():
    probe = gemm_peak(torch.float32, sizes=(16, 32), repeats=2)
    assert probe["dtype"] == "float32" and probe["threads"] == torch.get_num_threads()
    assert [s["n"] for s in probe["sizes"]] == [16, 32]
    assert all(s["gflops_best"] > 0 and len(s["gflops"]) == 2 for s in probe["sizes"])
    assert probe["peak_gflops"] == max(s["gflops_best"] for s in probe["sizes"])
