"""One run of ``peftlab bench --against trainer`` on a GLUE task, in its own process (pinned to one core by
:mod:`peftlab.bench.pairs`; its peak RSS is its own).

``python -m peftlab.bench.trainer_worker SPEC.json OUT.json`` runs the spec's ``setup``:

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

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

TRAINER_SETUPS = ("pad128", "longest", "grouped")
PEFTLAB_SETUP, COMPILED_SETUP = "peftlab", "peftlab-compiled"
PEFTLAB_SETUPS = (PEFTLAB_SETUP, COMPILED_SETUP)


def peak_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


class PadCounter:
    """Wraps a collator and counts the token slots and pad slots of the batches it builds (a mask sum), and keeps
    each batch's (rows, padded length)."""

    def __init__(self, inner):
        self.inner, self.slots, self.pads, self.batches, self.shapes = inner, 0, 0, 0, []

    def __call__(self, features):
        batch = self.inner(features)
        mask = batch["attention_mask"]
        self.slots += mask.numel()
        self.pads += int((mask == 0).sum())
        self.batches += 1
        self.shapes.append(tuple(int(n) for n in mask.shape))
        return batch


def epoch_clock():
    """A Trainer callback timing the epoch loops only (``seconds``) and keeping the logged losses: the Trainer
    side's own timer, as result.json's ``timings.train_s`` is peftlab's (both workers use it)."""
    from transformers import TrainerCallback

    class EpochClock(TrainerCallback):
        def __init__(self):
            self.seconds, self.start, self.losses = 0.0, None, []

        def on_epoch_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_epoch_end(self, args, state, control, **kwargs):
            self.seconds += time.perf_counter() - self.start

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return EpochClock()


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


def run_trainer(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import (AutoTokenizer, DataCollatorWithPadding, Trainer, TrainingArguments,
                              default_data_collator, get_linear_schedule_with_warmup)

    from peftlab.tasks import data_files as data
    from peftlab.tasks.metrics import compute_metrics
    from peftlab.tasks.prepare import train_examples_digest
    from peftlab.tasks.table import TASKS

    setup_start = time.perf_counter()
    transformers.logging.set_verbosity_error()
    task, pad128 = TASKS[spec["task"]], spec["setup"] == "pad128"
    num_labels = 1 if task.kind == "regression" else task.num_labels
    transformers.set_seed(spec["seed"])
    build_model, tokenizer_source = _model_source(spec["model"])
    model = build_model(num_labels)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id

    train_raw = data.subset(data.load_split(spec["task"], "train", spec["data_dir"]), spec["train_examples"],
                            spec["seed"])
    dev_raw = data.load_split(spec["task"], "validation", spec["data_dir"])
    pair = "text_b" in train_raw.column_names

    def encode(batch):
        texts = (batch["text_a"], batch["text_b"]) if pair else (batch["text_a"],)
        return tokenizer(*texts, truncation=True, max_length=spec["max_length"],
                         padding="max_length" if pad128 else False)

    text_columns = [c for c in ("text_a", "text_b") if c in train_raw.column_names]
    train_ds = train_raw.map(encode, batched=True, remove_columns=text_columns)
    dev_ds = dev_raw.map(encode, batched=True, remove_columns=text_columns)
    collator = PadCounter(default_data_collator if pad128 else DataCollatorWithPadding(tokenizer))

    lora = LoraConfig(task_type="SEQ_CLS", r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"],
                      target_modules=["query", "value"], modules_to_save=["classifier", "pooler.dense"])
    model = get_peft_model(model, lora)
    optimizer = torch.optim.AdamW(per_projection_groups(model, spec["lr"], spec["lr_ratio"], spec["head_lr"]))
    steps = math.ceil(len(train_ds) / spec["batch_size"]) * spec["epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(spec["warmup_ratio"] * steps), max(1, steps))

    clock = epoch_clock()
    args = TrainingArguments(
        output_dir=spec["run_dir"], per_device_train_batch_size=spec["batch_size"],
        per_device_eval_batch_size=spec["eval_batch_size"], num_train_epochs=spec["epochs"],
        max_grad_norm=spec["max_grad_norm"], seed=spec["seed"], use_cpu=True,
        bf16=spec["mixed_precision"] == "bf16",
        train_sampling_strategy="group_by_length" if spec["setup"] == "grouped" else "random",
        eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
        logging_strategy="steps", logging_steps=spec["logging_steps"], dataloader_num_workers=0)

    def metrics(prediction):
        return compute_metrics(TASKS[spec["task"]], prediction.predictions, prediction.label_ids)

    trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=dev_ds, data_collator=collator,
                      processing_class=tokenizer, optimizers=(optimizer, scheduler), compute_metrics=metrics,
                      callbacks=[clock])
    setup_s = time.perf_counter() - setup_start
    train_start = time.perf_counter()
    output = trainer.train()
    train_call_s = time.perf_counter() - train_start
    train_slots, train_pads = collator.slots, collator.pads  # before evaluation adds its own batches
    eval_start = time.perf_counter()
    evaluated = trainer.evaluate()
    eval_s = time.perf_counter() - eval_start
    dev_metrics = {k[len("eval_"):]: v for k, v in evaluated.items()
                   if k.startswith("eval_") and k[len("eval_"):] not in ("loss", "runtime", "samples_per_second",
                                                                         "steps_per_second", "epoch")}
    groups = [{"name": g.get("name"), "initial_lr": g.get("initial_lr", g["lr"]), "tensors": len(g["params"]),
               "params": sum(p.numel() for p in g["params"])} for g in trainer.optimizer.param_groups]
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    return {
        "examples": len(train_ds) * spec["epochs"], "train_s": clock.seconds, "train_call_s": train_call_s,
        "setup_s": setup_s, "eval_s": eval_s, "optimizer_steps": output.global_step,
        "train_loss": output.training_loss, "logged_losses": clock.losses, "dev_metrics": dev_metrics,
        "optimizer_groups": groups, "train_token_slots": train_slots, "train_pad_tokens": train_pads,
        "train_real_tokens": train_slots - train_pads,
        "lora_b_abs_sum": float(sum(p.detach().abs().sum() for p in lora_b)),
        "mixed_precision": "bf16" if args.bf16 else "no", "train_examples_digest": train_examples_digest(train_raw),
    }


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
    import torch

    torch.set_num_threads(spec["threads"])
    start, cpu_start = time.perf_counter(), time.process_time()
    out = run_peftlab(spec) if spec["setup"] in PEFTLAB_SETUPS else run_trainer(spec)
    out.setdefault("status", "ok")
    out["examples_per_s"] = out["examples"] / out["train_s"] if out["train_s"] else None
    out["in_process_s"] = time.perf_counter() - start
    out["cpu_s"] = time.process_time() - cpu_start
    out["peak_rss_mb"] = peak_rss_mb()
    out["torch_threads"] = torch.get_num_threads()
    out["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m peftlab.bench.trainer_worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    spec = json.loads(Path(argv[0]).read_text())
    result = run_spec(spec)
    from peftlab.io_utils import atomic_write_text

    atomic_write_text(argv[1], json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
