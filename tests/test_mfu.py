"""Model FLOP utilisation (benchmarks.flops, benchmarks.peak): the FLOPs FlopCounterMode counts on a meta-device copy
of a model equal what it counts for a real train step of the model itself (forward + backward from the logits,
eager attention so every product is a counted matmul) on tiny encoders and decoders, for head-only, LoRA, full
fine-tuning and layer-restricted adapters; the per-example fit adds up to whole batches; the copy leaves the model
alone; the GEMM peak probe reports a positive rate per size. No timing is asserted."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.flops import ExampleFlops, count_step, meta_copy, step_flops
from benchmarks.peak import gemm_peak
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


def measured_flops(model, rows: int = BATCH, length: int = LENGTH) -> tuple[int, int]:
    """(forward, backward) FLOPs of a real step of ``model`` on ``rows`` random examples of ``length`` tokens."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 128, (rows, length), generator=generator)
    with FlopCounterMode(display=False) as forward:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    with FlopCounterMode(display=False) as backward:
        if logits.requires_grad:
            logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return forward.get_total_flops(), backward.get_total_flops()


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
    ("llama", "causal-lm", "dora", "q,v", None),  # DoRA's weight norm (B·A) is counted too
    ("qwen2", "causal-lm", "full", "k,o", None),
]


@pytest.mark.parametrize("model_type,head,method,targets,layers", CASES)
def test_meta_copy_counts_what_the_real_step_runs(model_type, head, method, targets, layers, single_thread):
    model = adapted(tiny(model_type, head), method, targets, head, layers)
    counted, why_not = step_flops(model, BATCH, LENGTH)
    assert why_not is None, why_not
    forward, backward = measured_flops(model)
    assert (counted.forward, counted.backward) == (forward, backward) and backward > 0
    assert counted.total == forward + backward
    assert counted.tokens == BATCH * LENGTH and counted.examples == BATCH
    assert (counted.adapter > 0) == (method in ("lora", "dora")) and counted.adapter < counted.total


def test_less_trains_less_backward():
    """Head only < LoRA on v in layer 1 < LoRA on q,v everywhere < full fine-tuning, in backward FLOPs; forward
    grows only by the adapters' products."""
    counts = {}
    for method, targets, layers in (("head", "q", None), ("lora", "v", "1"), ("lora", "q,v", None),
                                    ("full", "q,v", None)):
        counted, _ = step_flops(adapted(tiny("bert", "classification"), method, targets, "classification", layers),
                                BATCH, LENGTH)
        counts[(method, layers)] = counted
    order = [counts[k].backward for k in (("head", None), ("lora", "1"), ("lora", None), ("full", None))]
    assert order == sorted(order) and len(set(order)) == 4
    assert counts[("head", None)].forward == counts[("full", None)].forward < counts[("lora", None)].forward


def test_meta_copy_leaves_the_model_alone():
    model = adapted(tiny("llama", "causal-lm"), "lora", "q,v", "causal-lm")
    model.get_base_model().set_attn_implementation("sdpa")
    before = {name: (p.device, p.requires_grad) for name, p in model.named_parameters()}
    meta = meta_copy(model)
    assert all(p.device.type == "meta" for p in meta.parameters())
    assert {n: p.requires_grad for n, p in meta.named_parameters()} == {n: g for n, (_, g) in before.items()}
    assert meta.get_base_model().config._attn_implementation == "eager"
    assert model.get_base_model().config._attn_implementation == "sdpa"
    assert {name: (p.device, p.requires_grad) for name, p in model.named_parameters()} == before
    assert count_step(meta, 2, 4).total == count_step(meta_copy(model), 2, 4).total  # nothing left behind


def test_per_example_fit_adds_up_to_batches():
    model = adapted(tiny("llama", "causal-lm"), "lora", "q,v", "causal-lm")
    per_example = ExampleFlops(model)
    meta = meta_copy(model)
    for length in (5, 16):
        assert per_example.total(length) == count_step(meta, 1, length).total
    assert per_example.executed([(3, 9), (1, 4)]) == count_step(meta, 3, 9).total + count_step(meta, 1, 4).total
    both = per_example.of([9, 4])
    assert both.total == count_step(meta, 1, 9).total + count_step(meta, 1, 4).total
    assert (both.tokens, both.examples) == (13, 2) and both.adapter > 0
    with pytest.raises(ValueError, match="not additive"):  # DoRA's weight norm runs once per step, not per example
        ExampleFlops(adapted(tiny("llama", "causal-lm"), "dora", "q,v", "causal-lm"))


def test_a_model_that_cannot_run_on_meta_is_said_so():
    class NoLogits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def set_attn_implementation(self, name):  # as transformers models have
            pass

        def forward(self, input_ids):
            return {"no": "logits"}

    counted, why_not = step_flops(NoLogits(), 1, 2)
    assert counted is None and why_not.startswith("AttributeError")


def test_gemm_peak_probe_reports_every_size():
    probe = gemm_peak(torch.float32, sizes=(16, 32), repeats=2)
    assert probe["dtype"] == "float32" and probe["threads"] == torch.get_num_threads()
    assert [s["n"] for s in probe["sizes"]] == [16, 32]
    assert all(s["gflops_best"] > 0 and len(s["gflops"]) == 2 for s in probe["sizes"])
    assert probe["peak_gflops"] == max(s["gflops_best"] for s in probe["sizes"])
