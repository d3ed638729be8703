"""--packing (peftlab.tasks.batching.PackingCollator): a batch's examples in one unpadded row train exactly as the
padded batch does. The per-token losses and the gradients equal the padded batch's on tiny random Llama and
Qwen2 models on a CPU, for each way the row's examples are kept apart: transformers' block-diagonal mask under
SDPA and eager attention, and peftlab's per-example SDPA (peftlab.models.packed_attention). The same row without
what keeps the examples apart (use_cache=False and the boundaries; or the restarting position_ids) gives
different losses, so the equality test can fail; the prompt stays masked; the loop counts examples, not rows,
and draws random batches."""

from __future__ import annotations

import json
import math

import pytest
import torch

from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.tasks import instructions as sft
from peftlab.models.packed_attention import BOUNDARY_KWARGS, IMPLEMENTATION, use_packed_attention
from peftlab.tasks.batching import PackingCollator, examples_in_batch, prepare_packed_attention

# fp32 on a CPU: packed and padded differ only by summation order (about 1e-7 in these logits); a leak across a
# boundary moves the per-token losses by 1e-2 and more (asserted below).
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
LEAK_AT_LEAST = 1e-3
VOCAB = 128
# (length, prompt length) of four examples: different lengths, so padding and boundaries both occur
EXAMPLES = ((9, 4), (4, 2), (13, 5), (6, 3))


def tiny_causal_lm(model_type: str, attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                  max_position_embeddings=64, initializer_range=0.3, pad_token_id=0)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()  # train mode: as in the loop (no dropout in these configs)


def features() -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for length, prompt in EXAMPLES:
        ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()  # never the pad id 0
        out.append({"input_ids": ids, "attention_mask": [1] * length, "labels": [-100] * prompt + ids[prompt:],
                    "length": length})
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from peftlab.models.registry import load_tokenizer

    return load_tokenizer("tiny-llama")  # SmolLM2's tokenizer (pad = <|im_end|>)


def padded_batch(tokenizer, feats) -> dict:
    batch = sft.SFTCollator(tokenizer)(feats)
    batch["input_ids"][batch["attention_mask"] == 0] = 0  # a pad id inside this tiny vocabulary
    return batch


def per_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy at every labelled position, row by row (the examples' order in both layouts)."""
    shift_logits, shift_labels = logits[:, :-1].float(), labels[:, 1:]
    keep = shift_labels != -100
    return torch.nn.functional.cross_entropy(shift_logits[keep], shift_labels[keep], reduction="none")


def loss_and_grads(model, batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), per_token_losses(out.logits.detach(), batch["labels"]), grads


def without(batch: dict, *keys: str) -> dict:
    return {k: v for k, v in batch.items() if k not in keys}


@pytest.mark.parametrize("attn", ["sdpa", "eager", "per-example"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_packed_batch_trains_exactly_as_the_padded_batch(tokenizer, model_type, attn):
    model = tiny_causal_lm(model_type, "eager" if attn == "eager" else "sdpa")
    if attn == "per-example":
        assert use_packed_attention(model) and model.config._attn_implementation == IMPLEMENTATION
    feats = features()
    padded = padded_batch(tokenizer, feats)
    packed = PackingCollator()(feats)
    assert packed["input_ids"].shape == (1, sum(n for n, _ in EXAMPLES)) and "attention_mask" not in packed
    padded_loss, padded_tokens, padded_grads = loss_and_grads(model, padded)  # per-example attention: plain SDPA
    packed_loss, packed_tokens, packed_grads = loss_and_grads(model, packed)
    assert padded_tokens.numel() == sum(n - p for n, p in EXAMPLES)  # every response token, once
    torch.testing.assert_close(packed_tokens, padded_tokens, **TOLERANCE)
    torch.testing.assert_close(packed_loss, padded_loss, **TOLERANCE)  # the mean over the same response tokens
    assert packed_grads.keys() == padded_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)

    def losses(batch):
        with torch.no_grad():
            return per_token_losses(model(**batch).logits, packed["labels"])

    # With the config's default use_cache=True, transformers builds an empty DynamicCache, skips the packed-sequence
    # detection and every example attends to those before it in the row (per-example attention needs the
    # boundaries removed too, or it would still keep the examples apart).
    leaked = losses(without(packed, "use_cache", *BOUNDARY_KWARGS))
    assert float((leaked - padded_tokens).abs().max()) > LEAK_AT_LEAST
    mask_only = losses(without(packed, "use_cache"))  # only per-example attention does without the mask
    assert (float((mask_only - padded_tokens).abs().max()) < LEAK_AT_LEAST) == (attn == "per-example")
    # Nor, under a mask, without the restarting positions: the row is then one long sequence. (Attending per
    # example, positions that run on across the row only shift each example's rotary positions by a constant,
    # which leaves its scores as they were.)
    joined = losses(without(packed, "position_ids"))
    assert (float((joined - padded_tokens).abs().max()) > LEAK_AT_LEAST) == (attn != "per-example")
    # The first example sees nothing before it, so only the later ones change: the leak is across boundaries.
    first = EXAMPLES[0][0] - EXAMPLES[0][1]
    torch.testing.assert_close(leaked[:first], padded_tokens[:first], **TOLERANCE)


def test_prompt_masking_survives_packing(tokenizer):
    feats = [sft.encode_example(tokenizer, "Name a colour.", "", "Blue.", 128),
             sft.encode_example(tokenizer, "Count to three, please.", "", "1, 2, 3", 128),
             sft.encode_example(tokenizer, "Say hi.", "to Ann", "Hi Ann!", 128)]
    packed = PackingCollator()(feats)
    assert packed["labels"][0].tolist() == [label for f in feats for label in f["labels"]]  # prompts stay -100
    assert packed["input_ids"][0].tolist() == [t for f in feats for t in f["input_ids"]]
    assert packed["position_ids"][0].tolist() == [i for f in feats for i in range(len(f["input_ids"]))]
    assert packed["use_cache"] is False
    padded = sft.SFTCollator(tokenizer)(feats)
    labelled = lambda labels: int((labels[:, 1:] != -100).sum())  # noqa: E731 - positions the loss averages over
    assert labelled(packed["labels"]) == labelled(padded["labels"]) == sum(len(f["input_ids"]) - f["prompt_length"]
                                                                            for f in feats)
    assert examples_in_batch(packed) == examples_in_batch(padded) == 3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_prepare_packed_attention_switches_sdpa_checks_and_refuses_a_leak(attn):
    model = tiny_causal_lm("llama", attn)
    packed = prepare_packed_attention(model)
    assert packed.per_example == (attn == "sdpa") and packed.max_difference < 1e-5
    assert packed.implementation == (IMPLEMENTATION if attn == "sdpa" else "eager")  # eager keeps its mask
    assert model.training  # the check restored the mode
    assert prepare_packed_attention(model).per_example == (attn == "sdpa")  # again: nothing left to switch

    class IgnoresPositions(torch.nn.Module):  # a model whose attention never sees the restarting positions
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, position_ids=None, use_cache=None, **kwargs):
            return self.inner(input_ids=input_ids, **kwargs)

    with pytest.raises(PeftlabError, match="attend to each other"):
        prepare_packed_attention(IgnoresPositions(tiny_causal_lm("llama", "sdpa")))


def test_per_example_attention_is_plain_sdpa_for_padded_batches_and_generation(tokenizer):
    """A model switched for packed rows still evaluates (padded, masked) and generates (left padding, a cache) as
    with SDPA: the run's evaluations and saved adapter are unaffected."""
    reference, switched = tiny_causal_lm("llama", "sdpa").eval(), tiny_causal_lm("llama", "sdpa").eval()
    assert use_packed_attention(switched)
    padded = padded_batch(tokenizer, features())
    inputs = {k: padded[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        torch.testing.assert_close(switched(**inputs).logits, reference(**inputs).logits)
        prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])  # left-padded
        mask = (prompts != 0).long()
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(switched.generate(input_ids=prompts, attention_mask=mask, **kwargs),
                           reference.generate(input_ids=prompts, attention_mask=mask, **kwargs))
    # a sliding-window model keeps transformers' mask (a window inside an example would be lost)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mistral", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, sliding_window=4)
    config._attn_implementation = "sdpa"
    assert not use_packed_attention(AutoModelForCausalLM.from_config(config))


def test_packing_is_for_decoder_tasks_and_excludes_pad_to_max(tmp_path, capsys):
    from peftlab.cli.main import main

    assert main(["train", "--task", "rte", "--packing", "--output-dir", str(tmp_path / "a")]) == 2
    assert "encoder head" in capsys.readouterr().err
    assert main(["train", "--task", "gsm8k", "--model", "tiny-llama", "--packing", "--pad-to-max",
                 "--output-dir", str(tmp_path / "b")]) == 2
    assert "--pad-to-max" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything was made


def _json_cfg(tmp_path, **overrides) -> TrainConfig:
    records = [{"q": f"What is {i} plus {i}?" + " Think." * (i % 5), "a": f"{2 * i}"} for i in range(22)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    values = dict(task="json", model="tiny-llama", train_file=str(path), instruction_fields="q,,a", method="lora",
                  targets="q,v", rank=4, epochs=1, batch_size=4, max_length=64, eval_batch_size=4, log_every=1,
                  output_dir=str(tmp_path / "run"), report_to="none")
    values.update(overrides)
    return build_run_config(overrides=values)


def test_packing_runs_through_the_loop_counting_examples(tmp_path):
    from peftlab.training.loop import train

    result = train(_json_cfg(tmp_path, packing=True))
    assert result["status"] == "ok" and result["config"]["packing"] is True
    used = result["train_examples_used"]  # 22 records, 10% held out
    assert used == 20 and result["train_examples"] == used  # examples, not packed rows
    assert result["optimizer_steps"] == math.ceil(used / 4)
    assert math.isfinite(result["epochs_log"][-1]["train_loss"])


def test_packing_draws_random_batches_and_checks_the_model(tmp_path, monkeypatch):
    from peftlab.tasks import batching
    from peftlab.training.setup import setup

    checked = []
    real_prepare = batching.prepare_packed_attention

    def recorded(model):
        checked.append(real_prepare(model))
        return checked[-1]

    monkeypatch.setattr(batching, "prepare_packed_attention", recorded)
    run = setup(_json_cfg(tmp_path, packing=True), "fresh")
    assert run.sampler.grouped is False and len(checked) == 1 and checked[0].per_example
    assert run.model.config._attn_implementation == IMPLEMENTATION  # tiny-llama runs SDPA: attention per example
    batch = next(iter(run.train_loader))
    assert batch["input_ids"].shape[0] == 1 and examples_in_batch(batch) == 4 and batch["use_cache"] is False
    assert batch["cu_seq_lens_q"].tolist()[0] == 0 and len(batch["cu_seq_lens_q"]) == 4 + 1
    padded = setup(_json_cfg(tmp_path, output_dir=str(tmp_path / "padded")), "fresh")
    assert padded.sampler.grouped is True and len(checked) == 1  # the default: length-grouped, padded
