"""One run of the decoder comparison (:mod:`benchmarks.against_trainer_decoder`), in its own process, pinned to
one core.

``python -m benchmarks.decoder_worker SPEC.json OUT.json`` runs the spec's ``setup``:

* ``llm-adapters``: the papers' decoder pipeline (LLM-Adapters' ``finetune.py``, which KaSA's code follows):
  ``transformers.Trainer`` + peft ``LoraConfig`` (CAUSAL_LM, q_proj and v_proj) + ``DataCollatorForSeq2Seq(
  padding=True, pad_to_multiple_of=8)``: every batch padded to its longest example (rounded up to 8), batches drawn
  at random (``group_by_length`` off, its default there). AdamW with the linear warm-up/decay schedule, passed as
  ``Trainer(optimizers=...)`` with peftlab's settings. Two departures from their script, neither changing what a
  step computes: it pads on the right (theirs on the left; with rotary positions the loss is the same), and it
  trains on the token sequences peftlab trains on (peftlab's prompt template and its -100 prompt labels, the same
  seeded draw of examples), so both sides train the same examples and their losses compare.
* ``peftlab``: :func:`peftlab.training.loop.train`: length-grouped batches padded to their longest.
* ``peftlab-packed``: the same with ``--packing`` (one unpadded row per batch, each example attending on its
  own: :mod:`peftlab.models.packed_attention`; random batches).

Every side reports the same numbers, counted the same way: ``train_s`` (the wall time of the epochs' batch loops;
a ``TrainerCallback`` on the Trainer side, result.json's ``timings.train_s`` on peftlab's), the real tokens trained
(the examples' lengths, prompt and response), the token slots its batches computed, the mean training loss
(each batch's mean over its response tokens, averaged over batches: Trainer's ``training_loss``, peftlab's
``train_loss``), the loss after training on a fixed probe (the first ``probe_examples`` training examples, the
same function on both sides), the model FLOPs of the examples trained (:mod:`benchmarks.flops`) and this
core's GEMM peak (:mod:`benchmarks.peak`).
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any

from benchmarks.trainer_worker import lora_b_abs_sum
from benchmarks.worker import PadCounter, make_trainer, measured, worker_main

TRAINER_SETUP, GROUPED_SETUP, PACKED_SETUP = "llm-adapters", "peftlab", "peftlab-packed"
SETUPS = (TRAINER_SETUP, GROUPED_SETUP, PACKED_SETUP)
LORA_TARGETS = "q,v"  # LLM-Adapters' LoRA default for LLaMA-style models: q_proj, v_proj
PEAK_SIZES, PEAK_REPEATS = (512, 1024, 2048), 3


def peftlab_config(spec: dict[str, Any], *, packing: bool):
    """The TrainConfig of peftlab's side; the Trainer side reads its data through it too."""
    from peftlab.config import TrainConfig, build_config

    return build_config(TrainConfig, overrides=dict(
        task=spec["task"], model=spec["model"], method="lora", targets=LORA_TARGETS, rank=spec["rank"],
        alpha=spec["alpha"], dropout=spec["dropout"], epochs=spec["epochs"], batch_size=spec["batch_size"],
        max_length=spec["max_length"], seed=spec["seed"], max_train_samples=spec["train_examples"], lr=spec["lr"],
        lr_ratio=1.0, warmup_ratio=spec["warmup_ratio"], max_grad_norm=spec["max_grad_norm"], threads=1,
        mixed_precision=spec["mixed_precision"], packing=packing, report_to="none", log_every=10**6,
        checkpoint_every=0, save="last", output_dir=spec["run_dir"], overwrite=True, data_dir=spec["data_dir"],
        # the run's own generation-scored evaluation costs nothing here: one item of one set, one new token
        eval_every=0, eval_sets=spec["eval_set"], max_eval_samples=1, max_new_tokens=1))


def training_set(cfg, tokenizer, model):
    """The tokenised training examples of ``cfg`` (peftlab's pipeline: the seeded draw, prompt-masked labels)."""
    from peftlab.tasks.prepare import build_pipeline
    from peftlab.training.guards import capped_max_length

    return build_pipeline(capped_max_length(cfg, model), tokenizer, model).train_dataset


def probe_loss(model, tokenizer, dataset, count: int, batch_size: int = 4) -> float:
    """Mean next-token cross-entropy over the response tokens of the first ``count`` examples (eval mode)."""
    import torch

    from peftlab.tasks.instructions import SFTCollator, response_loss_sums

    collate = SFTCollator(tokenizer)
    rows = [dataset[i] for i in range(min(count, len(dataset)))]
    total, tokens = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collate(rows[start:start + batch_size])
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            sums, counts = response_loss_sums(logits, batch["labels"])
            total, tokens = total + float(sums.sum()), tokens + int(counts.sum())
    model.train(was_training)
    return total / max(1, tokens)


def model_flops(model, lengths: list[int], epochs: int, batches: list[tuple[int, int]] | None) -> dict:
    """The model FLOPs of the real tokens trained (:class:`benchmarks.flops.ExampleFlops`: additive over examples,
    so every example at once), and ``executed``: what the batches computed, each of ``(rows, length)`` counted as
    ``rows`` examples of that length (padding included; None: no padding, nothing beyond the real tokens)."""
    from benchmarks.flops import ExampleFlops

    try:
        per_example = ExampleFlops(model)
    except Exception as err:  # an architecture the meta device cannot run, or not additive: say so, go on
        return {"unavailable": f"{type(err).__name__}: {err}"}
    useful = per_example.of(list(lengths) * epochs).to_dict()
    executed = useful["total"] if batches is None else per_example.executed(batches)
    return {**useful, "executed": executed, "executed_per_model_flop": executed / useful["total"]}


def run_trainer(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import DataCollatorForSeq2Seq

    from peftlab.models.registry import load_model

    setup_start = time.perf_counter()
    transformers.logging.set_verbosity_error()
    transformers.set_seed(spec["seed"])
    model, tokenizer = load_model(spec["model"], head="causal-lm", seed=spec["seed"])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_ds = training_set(peftlab_config(spec, packing=False), tokenizer, model)
    lengths = [int(n) for n in train_ds["length"]]
    columns = train_ds.select_columns(["input_ids", "attention_mask", "labels"])
    right = copy.copy(tokenizer)  # shallow: shares the vocabulary; pads on the right (see the module docstring)
    right.padding_side = "right"
    collator = PadCounter(DataCollatorForSeq2Seq(right, padding=True, pad_to_multiple_of=8, label_pad_token_id=-100,
                                                 return_tensors="pt"))
    lora = LoraConfig(task_type="CAUSAL_LM", r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                      target_modules=["q_proj", "v_proj"], bias="none")
    model = get_peft_model(model, lora)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec["lr"], weight_decay=0.0)
    trainer, clock = make_trainer(spec, model, optimizer, columns, collator)
    setup_s = time.perf_counter() - setup_start
    output = trainer.train()
    return {
        "train_s": clock.seconds, "setup_s": setup_s, "optimizer_steps": output.global_step,
        "examples": len(columns) * spec["epochs"], "train_loss": output.training_loss, "logged_losses": clock.losses,
        "train_real_tokens": collator.slots - collator.pads, "train_token_slots": collator.slots,
        "lengths_real_tokens": sum(lengths) * spec["epochs"],
        "probe_loss": probe_loss(model, tokenizer, train_ds, spec["probe_examples"]),
        "model_flops": model_flops(model, lengths, spec["epochs"], collator.shapes),
        "lora_b_abs_sum": lora_b_abs_sum(model),
    }


def trained_as(cfg):
    """A fresh model adapted as the run trained it (a loaded run's adapter is frozen: no backward to count)."""
    from peftlab.methods.table import apply_method
    from peftlab.models.registry import load_model

    model, _ = load_model(cfg.model, head="causal-lm", seed=cfg.seed)
    return apply_method(model, cfg, train_head=False, task_type="CAUSAL_LM").model


def run_peftlab(spec: dict[str, Any]) -> dict[str, Any]:
    from peftlab.models.packed_attention import use_packed_attention
    from peftlab.training.evaluation import load_run
    from peftlab.training.loop import train
    from peftlab.training.schedule import LengthGroupedBatchSampler

    packing = spec["setup"] == PACKED_SETUP
    cfg = peftlab_config(spec, packing=packing)
    result = train(cfg)
    timings = result.get("timings") or {}
    run = load_run(cfg.output_dir)  # the trained adapter on a fresh base model
    train_ds = training_set(run.cfg, run.tokenizer, run.model)  # the cached tokenisation the run used
    lengths = [int(n) for n in train_ds["length"]]
    real = sum(lengths) * cfg.epochs
    model = trained_as(cfg)
    batches = []  # the run's own batches (its sampler, same seed), recomputed
    sampler = LengthGroupedBatchSampler(lengths, cfg.batch_size, cfg.seed, grouped=not packing)
    for epoch in range(cfg.epochs):
        sampler.epoch = epoch
        batches += [[lengths[i] for i in batch] for batch in sampler]
    if packing and use_packed_attention(model.get_base_model()):  # as the run did: each example on its own
        slots, shapes = real, None
    elif packing:  # one unpadded row under a block-diagonal mask: the row's whole square of scores
        slots, shapes = real, [(1, sum(batch)) for batch in batches]
    else:
        shapes = [(len(batch), max(batch)) for batch in batches]
        slots = sum(rows * n for rows, n in shapes)
    return {
        "train_s": timings.get("train_s", result["train_seconds"]), "setup_s": timings.get("setup_s"),
        "optimizer_steps": result.get("optimizer_steps"), "examples": result["train_examples"],
        "status": result["status"], "train_loss": result["epochs_log"][-1]["train_loss"],
        "logged_losses": [e["train_loss"] for e in result["epochs_log"]],
        "train_real_tokens": real, "train_token_slots": slots, "lengths_real_tokens": real,
        "probe_loss": probe_loss(run.model, run.tokenizer, train_ds, spec["probe_examples"]),
        "model_flops": model_flops(model, lengths, cfg.epochs, shapes),
        "packing": result["config"].get("packing"),
    }


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The run, then its tokens/s, model FLOP/s and this core's GEMM peak (after training)."""
    import torch

    from benchmarks.peak import gemm_peak

    out = measured(run_trainer if spec["setup"] == TRAINER_SETUP else run_peftlab, spec)
    seconds = out["train_s"]
    out["tokens_per_s"] = out["train_real_tokens"] / seconds if seconds else None
    total = (out.get("model_flops") or {}).get("total")
    out["model_gflops"] = total / seconds / 1e9 if total and seconds else None
    out["gemm_peak"] = gemm_peak(torch.bfloat16 if spec["mixed_precision"] == "bf16" else torch.float32,
                                 sizes=PEAK_SIZES, repeats=PEAK_REPEATS)
    return out


if __name__ == "__main__":
    sys.exit(worker_main(run_spec, "decoder_worker"))
