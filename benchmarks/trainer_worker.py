"""One run of the GLUE comparison (:mod:`benchmarks.against_trainer`), in its own process (pinned to one core by
:mod:`benchmarks.pairs`; its peak RSS is its own).

``python -m benchmarks.trainer_worker SPEC.json OUT.json`` runs the spec's ``setup``:

* ``pad128`` / ``longest`` / ``grouped``: the work through ``transformers.Trainer``, written the way a user would
  do Yao et al. without peftlab: ``AutoModelForSequenceClassification`` + a peft ``LoraConfig`` (q, v; the
  classifier and BERT's pooler trained, as peftlab trains them), AdamW with one parameter group per projection (q
  at eta_QK, v at lambda * eta_QK, the head at its own rate) and a linear warm-up/decay schedule passed as
  ``Trainer(optimizers=(opt, sched))``. ``pad128`` tokenises with ``padding="max_length"`` (Yao et al.'s
  pipeline; ``default_data_collator``), random batches; ``longest`` is the KaSA authors' GLUE pipeline (LoRA's
  NLU ``run_glue.py`` without ``--pad_to_max_length``): ``DataCollatorWithPadding`` (each batch padded to its
  longest example), random batches; ``grouped`` is Trainer's best on this data:
  ``train_sampling_strategy="group_by_length"`` (transformers 5's ``group_by_length=True``) and
  ``DataCollatorWithPadding``.
* ``peftlab``: :func:`peftlab.training.loop.train` with the same settings (``--pooling native``, so both
  sides run the same BertForSequenceClassification), ``--compile off``; ``peftlab-compiled``: the same with
  ``--compile on`` (:mod:`peftlab.training.compile`; its result.json ``compile`` record says whether it
  compiled, and the first step's seconds, which hold the compile time).

Both sides read the same seeded subset of the training set (:func:`peftlab.tasks.data_files.subset`; its
digest, :func:`peftlab.tasks.prepare.train_examples_digest`, is reported by every side) and are scored on the
full dev set with :func:`peftlab.tasks.metrics.compute_metrics`. ``train_s`` is the wall time of the epochs'
batch loops (batch loading and collation included; evaluation, checkpoints and saving not), read from a
``TrainerCallback`` (``on_epoch_begin`` .. ``on_epoch_end``) on the Trainer side and from result.json's
``timings.train_s`` on peftlab's. Every run reports the cores it was allowed (``os.sched_getaffinity``) and its
torch thread count.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from benchmarks.worker import PadCounter, make_trainer, measured, worker_main

TRAINER_SETUPS = ("pad128", "longest", "grouped")
PEFTLAB_SETUP, COMPILED_SETUP = "peftlab", "peftlab-compiled"
PEFTLAB_SETUPS = (PEFTLAB_SETUP, COMPILED_SETUP)


def _model_source(name: str):
    """(model factory, tokenizer path) as a user would load them: ``from_pretrained`` of the local checkpoint;
    a random-config test model (tiny-bert) is built from its config with its donor's tokenizer."""
    from transformers import AutoModelForSequenceClassification

    from peftlab.models.registry import resolve_source

    spec, source = resolve_source(name)
    if spec is not None and spec.random_config is not None:
        _, tokenizer_source = resolve_source(spec.tokenizer_from)

        def build(num_labels: int):
            config = spec.random_config()
            config.num_labels = num_labels
            return AutoModelForSequenceClassification.from_config(config)

        return build, tokenizer_source

    def load(num_labels: int):
        return AutoModelForSequenceClassification.from_pretrained(source, num_labels=num_labels)

    return load, source


def per_projection_groups(model, lr: float, lr_ratio: float, head_lr: float) -> list[dict]:
    """AdamW groups by projection, as one writes them by hand: q at ``lr``, v at ``lr_ratio * lr``, the trained
    head copies (peft's ``modules_to_save``) at ``head_lr``."""
    groups: dict[str, list] = {"q": [], "v": [], "head": []}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if ".query." in name:
            groups["q"].append(param)
        elif ".value." in name:
            groups["v"].append(param)
        else:
            groups["head"].append(param)
    rates = {"q": lr, "v": lr * lr_ratio, "head": head_lr}
    return [{"name": key, "params": params, "lr": rates[key], "weight_decay": 0.0}
            for key, params in groups.items() if params]


def glue_data(spec: dict[str, Any], tokenizer):
    """The seeded training subset (raw and tokenised) and the full dev set, tokenised: padded to T for pad128."""
    from peftlab.tasks import data_files as data

    train_raw = data.subset(data.load_split(spec["task"], "train", spec["data_dir"]), spec["train_examples"],
                            spec["seed"])
    dev_raw = data.load_split(spec["task"], "validation", spec["data_dir"])
    pair = "text_b" in train_raw.column_names

    def encode(batch):
        texts = (batch["text_a"], batch["text_b"]) if pair else (batch["text_a"],)
        return tokenizer(*texts, truncation=True, max_length=spec["max_length"],
                         padding="max_length" if spec["setup"] == "pad128" else False)

    text_columns = [c for c in ("text_a", "text_b") if c in train_raw.column_names]
    return (train_raw, train_raw.map(encode, batched=True, remove_columns=text_columns),
            dev_raw.map(encode, batched=True, remove_columns=text_columns))


def lora_model(spec: dict[str, Any], num_labels: int):
    """The model a user would load, its tokenizer, and peft's LoRA on q and v (classifier and pooler trained)."""
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.set_seed(spec["seed"])
    build_model, tokenizer_source = _model_source(spec["model"])
    model = build_model(num_labels)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    lora = LoraConfig(task_type="SEQ_CLS", r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                      target_modules=["query", "value"], modules_to_save=["classifier", "pooler.dense"])
    return get_peft_model(model, lora), tokenizer


def run_trainer(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import DataCollatorWithPadding, default_data_collator

    from peftlab.tasks.metrics import compute_metrics
    from peftlab.tasks.prepare import train_examples_digest
    from peftlab.tasks.table import TASKS

    setup_start = time.perf_counter()
    task = TASKS[spec["task"]]
    model, tokenizer = lora_model(spec, 1 if task.kind == "regression" else task.num_labels)
    train_raw, train_ds, dev_ds = glue_data(spec, tokenizer)
    collator = PadCounter(default_data_collator if spec["setup"] == "pad128" else DataCollatorWithPadding(tokenizer))
    optimizer = torch.optim.AdamW(per_projection_groups(model, spec["lr"], spec["lr_ratio"], spec["head_lr"]))

    def metrics(prediction):
        return compute_metrics(TASKS[spec["task"]], prediction.predictions, prediction.label_ids)

    trainer, clock = make_trainer(spec, model, optimizer, train_ds, collator,
                                  sampling="group_by_length" if spec["setup"] == "grouped" else "random",
                                  arguments={"per_device_eval_batch_size": spec["eval_batch_size"]},
                                  eval_dataset=dev_ds, processing_class=tokenizer, compute_metrics=metrics)
    setup_s = time.perf_counter() - setup_start
    train_start = time.perf_counter()
    output = trainer.train()
    train_call_s = time.perf_counter() - train_start
    train_slots, train_pads = collator.slots, collator.pads  # before evaluation adds its own batches
    eval_start = time.perf_counter()
    evaluated = trainer.evaluate()
    eval_s = time.perf_counter() - eval_start
    skipped = ("loss", "runtime", "samples_per_second", "steps_per_second", "epoch")
    dev_metrics = {k[len("eval_"):]: v for k, v in evaluated.items()
                   if k.startswith("eval_") and k[len("eval_"):] not in skipped}
    groups = [{"name": g.get("name"), "initial_lr": g.get("initial_lr", g["lr"]), "tensors": len(g["params"]),
               "params": sum(p.numel() for p in g["params"])} for g in trainer.optimizer.param_groups]
    return {
        "examples": len(train_ds) * spec["epochs"], "train_s": clock.seconds, "train_call_s": train_call_s,
        "setup_s": setup_s, "eval_s": eval_s, "optimizer_steps": output.global_step,
        "train_loss": output.training_loss, "logged_losses": clock.losses, "dev_metrics": dev_metrics,
        "optimizer_groups": groups, "train_token_slots": train_slots, "train_pad_tokens": train_pads,
        "train_real_tokens": train_slots - train_pads, "lora_b_abs_sum": lora_b_abs_sum(model),
        "mixed_precision": "bf16" if trainer.args.bf16 else "no",
        "train_examples_digest": train_examples_digest(train_raw),
    }


def lora_b_abs_sum(model) -> float:
    """The summed |B| of every LoRA factor: 0 until an optimizer step moved it (the run really trained)."""
    return float(sum(p.detach().abs().sum() for n, p in model.named_parameters() if "lora_B" in n))


def run_peftlab(spec: dict[str, Any]) -> dict[str, Any]:
    from peftlab.config import TrainConfig, build_config
    from peftlab.tasks import data_files as data
    from peftlab.tasks import batching
    from peftlab.training.loop import train

    cfg = build_config(TrainConfig, overrides=dict(
        task=spec["task"], model=spec["model"], method="lora", targets="q,v", rank=spec["rank"],
        alpha=spec["alpha"], dropout=spec["dropout"], epochs=spec["epochs"], batch_size=spec["batch_size"],
        eval_batch_size=spec["eval_batch_size"], max_length=spec["max_length"], seed=spec["seed"],
        max_train_samples=spec["train_examples"], lr=spec["lr"], lr_ratio=spec["lr_ratio"],
        head_lr=spec["head_lr"], warmup_ratio=spec["warmup_ratio"], max_grad_norm=spec["max_grad_norm"],
        threads=spec["threads"], mixed_precision=spec["mixed_precision"], pooling="native", report_to="none",
        compile="on" if spec["setup"] == COMPILED_SETUP else "off",
        log_every=10**6, checkpoint_every=0, output_dir=spec["run_dir"], overwrite=True,
        data_dir=spec["data_dir"]))
    result = train(cfg)
    timings = result.get("timings") or {}
    # The token slots its batches computed: the run's own sampler order (peftlab.tasks.batching), recomputed.
    from peftlab.models.registry import load_tokenizer

    raw = data.subset(data.load_split(cfg.task, "train", cfg.data_dir), cfg.max_train_samples, cfg.seed)
    tokenised = batching.tokenize(raw, load_tokenizer(cfg.model), cfg.max_length, task=cfg.task,
                              cache_key=f"{cfg.model}-train")
    lengths = [int(x) for x in tokenised["length"]]
    slots = sum(len(b) * max(lengths[i] for i in b)
                for epoch in range(cfg.epochs)
                for b in batching.length_grouped_batches(lengths, cfg.batch_size, cfg.seed, epoch))
    real = sum(lengths) * cfg.epochs
    return {
        "examples": result["train_examples"], "train_s": timings.get("train_s", result["train_seconds"]),
        "train_step_s": result["train_seconds"], "setup_s": timings.get("setup_s"), "eval_s": timings.get("eval_s"),
        "timings": timings, "optimizer_steps": result.get("optimizer_steps"),
        "train_loss": (result["epochs_log"][-1]["train_loss"] if result["epochs_log"] else None),
        "logged_losses": [e["train_loss"] for e in result["epochs_log"]],
        "dev_metrics": result["final"]["metrics"], "status": result["status"],
        "optimizer_groups": [{"name": k, "initial_lr": v} for k, v in (result.get("group_lrs") or {}).items()],
        "train_token_slots": slots, "train_pad_tokens": slots - real, "train_real_tokens": real,
        "mixed_precision": result.get("mixed_precision"), "train_examples_digest": result.get("train_examples_digest"),
        "compile": result.get("compile"),  # choice, compiled or fallen back, graphs, the first step's seconds
    }


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return measured(run_peftlab if spec["setup"] in PEFTLAB_SETUPS else run_trainer, spec)


if __name__ == "__main__":
    sys.exit(worker_main(run_spec, "trainer_worker"))
