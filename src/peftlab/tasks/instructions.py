"""Instruction tuning of causal LMs: GSM8K, Alpaca and any JSON/JSONL instruction file.

``build_pipeline(cfg, tokenizer, model)`` is the ``instruction`` task kind's builder (see
:mod:`peftlab.tasks.prepare`). What it does, top to bottom:

* **Data** (:mod:`peftlab.tasks.instruction_data`). ``gsm8k``: ``<root>/gsm8k/{train,test}.jsonl``
  (``question``/``answer``; the final answer follows ``####``); trains on train, evaluates on a seeded subset of
  test (``--max-eval-samples``; the same problems before and after fine-tuning). ``alpaca``:
  ``<root>/alpaca/alpaca_data.json`` or ``alpaca_data_1k.json`` (``instruction``/``input``/``output``), with a
  held-out 10% split (fixed seed :data:`SPLIT_SEED`, so every run seed scores on the same held-out records).
  ``json``: ``--train-file`` (and optionally ``--eval-file``, else a held-out 10%), a JSON list or JSONL of
  objects whose field names ``--instruction-fields`` gives as ``prompt,input,response`` (input optional:
  ``question,,answer`` or ``question,answer``). ``<root>`` is found like GLUE's (``--data-dir``,
  ``$PEFTLAB_DATA_DIR``, ``./data``, ``../shared/data``); when no local copy exists the Hub (``openai/gsm8k``
  "main", ``tatsu-lab/alpaca``) is used unless ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` is set, in which case
  a :class:`~peftlab.errors.PeftlabError` lists the paths tried. GSM8K's calculator annotations
  (``<<16-3-4=9>>``) are removed from the training targets.
* **Format.** With a chat template: user = instruction [+ "\\n\\n" + input], assistant = response (the template's
  own end-of-turn token, e.g. ``<|im_end|>``, ends the response and is trained on, so the model learns to stop).
  Without one: ``### Instruction:`` / ``### Input:`` / ``### Response:`` blocks and the EOS token.
  Prompt and response are tokenised separately and concatenated, so the training prompt is token-for-token
  the prompt used at generation time.
* **Loss on the response only.** ``labels`` is -100 on every prompt token (and padding). Examples longer than
  ``--max-length`` are cut on the prompt side first (its start is dropped, keeping the generation prefix),
  but the prompt keeps at least half of ``--max-length`` when the response is longer; then the response is
  cut from the right. An example left with no response token is dropped. Tokenisation is a cached
  ``datasets.map`` in the same cache folder and with the same hash as :func:`peftlab.tasks.batching.tokenize`.
  The truncation happens there; :class:`SFTCollator` (transformers' ``DataCollatorForSeq2Seq``) only pads, on
  the right, ``labels`` with -100. With ``--packing`` a batch is one unpadded row instead
  (:class:`peftlab.tasks.batching.PackingCollator`, :func:`training_collator`).
* **Evaluation.** GSM8K: batched greedy ``model.generate`` (:func:`peftlab.tasks.generation.generate_greedy`;
  left padding, stop at EOS/end of turn, once the answer is final, or at ``--max-new-tokens``), exact match of
  the final number
  (:mod:`peftlab.tasks.math_answers`); every generation is written to ``<output_dir>/generations_<tag>.jsonl``
  (the tag the training loop passes: ``before``, then ``epoch1``, ``epoch2``...; ``evaluate`` when
  ``peftlab evaluate`` re-scores a saved run) with the question, gold answer, generated
  text, extracted answer and whether it is correct. Metrics: ``accuracy`` and ``answered`` (the fraction of
  generations with any number in them).
  Alpaca/JSON: token-weighted mean cross-entropy on the held-out responses (``eval_loss``) and
  ``perplexity`` = exp(eval_loss); **lower is better** for both.
* **Several processes** (``accelerate launch``): generation is sharded by example index across processes
  and the per-example records are gathered with ``accelerate.utils.gather_object`` before scoring (so every
  process returns the same metrics); the loss evaluation gathers per-example sums with
  ``accelerator.gather_for_metrics`` (which drops the duplicates of an uneven last batch). Only the main
  process writes generation files.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
from typing import Any, Sequence

import torch

from peftlab.errors import PeftlabError
from peftlab.tasks.prepare import Evaluation, Pipeline, eval_loader_on, examples_digest, train_examples_digest
from peftlab.tasks.generation import generation_evaluator
from peftlab.tasks.instruction_data import FORMAT_VERSION, load_instruction_data
from peftlab.tasks.table import Task

LOSS_EVAL_TOKENS = 8192  # padded tokens per loss-evaluation batch (logits are batch x length x vocabulary)
PLAIN_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PLAIN_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


# --------------------------------------------------------------------------- formatting and tokenising


def user_message(instruction: str, input_text: str = "") -> str:
    return instruction + ("\n\n" + input_text if input_text and input_text.strip() else "")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_text(tokenizer, instruction: str, input_text: str = "") -> str:
    """The prompt exactly as the model sees it before its answer (ends with the assistant header)."""
    if has_chat_template(tokenizer):
        return tokenizer.apply_chat_template([{"role": "user", "content": user_message(instruction, input_text)}],
                                             tokenize=False, add_generation_prompt=True)
    template = PLAIN_PROMPT_WITH_INPUT if input_text and input_text.strip() else PLAIN_PROMPT
    return template.format(instruction=instruction, input=input_text)


def response_text(tokenizer, instruction: str, input_text: str, output: str) -> str:
    """The response as trained on, including the end-of-turn / EOS marker."""
    if has_chat_template(tokenizer):
        user = user_message(instruction, input_text)
        prompt = prompt_text(tokenizer, instruction, input_text)
        full = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}, {"role": "assistant", "content": output}], tokenize=False)
        if full.startswith(prompt):
            return full[len(prompt):].rstrip()
    return output + (tokenizer.eos_token or "")


def encode_prompt(tokenizer, instruction: str, input_text: str = "") -> list[int]:
    ids = tokenizer(prompt_text(tokenizer, instruction, input_text), add_special_tokens=False)["input_ids"]
    if not has_chat_template(tokenizer) and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return ids


def encode_example(tokenizer, instruction: str, input_text: str, output: str, max_length: int) -> dict | None:
    """``input_ids``/``attention_mask``/``labels`` (-100 on the prompt) of one example, truncated to
    ``max_length``; None when no response token would be left."""
    prompt = encode_prompt(tokenizer, instruction, input_text)
    response = tokenizer(response_text(tokenizer, instruction, input_text, output),
                         add_special_tokens=False)["input_ids"]
    truncated = len(prompt) + len(response) > max_length
    if truncated:
        keep = max(max_length - len(response), min(len(prompt), max_length // 2), 1)
        keep = min(keep, len(prompt))
        prompt = prompt[len(prompt) - keep:]
        response = response[: max_length - keep]
    if not response or not prompt:
        return None
    ids = prompt + response
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * len(prompt) + response,
            "length": len(ids), "prompt_length": len(prompt), "truncated": truncated}


def _template_digest(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or "plain"
    return hashlib.sha256(str(template).encode()).hexdigest()[:12]


def tokenize_instructions(ds, tokenizer, max_length: int, *, task: str, cache_key: str):
    """Tokenise ``instruction``/``input``/``output`` rows with :func:`encode_example` (cached like
    :func:`peftlab.tasks.batching.tokenize`); columns ``input_ids``, ``attention_mask``, ``labels``, ``length``,
    ``prompt_length``, ``truncated``. Rows with no response token left are dropped."""
    from peftlab.tasks.batching import tokenize_hash, tokenized_cache_dir

    if max_length is None or int(max_length) <= 0:
        raise PeftlabError(f"max_length must be a positive integer, got {max_length!r}", fix="use e.g. 512")
    key = f"sft{FORMAT_VERSION}-{cache_key}-{_template_digest(tokenizer)}-eos{tokenizer.eos_token_id}"
    digest = tokenize_hash(ds, tokenizer, max_length, task, key)
    out_dir = tokenized_cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)

    def encode(batch):
        out: dict[str, list] = {k: [] for k in ("input_ids", "attention_mask", "labels", "length", "prompt_length",
                                                "truncated")}
        for instruction, input_text, output in zip(batch["instruction"], batch["input"], batch["output"]):
            example = encode_example(tokenizer, instruction, input_text, output, int(max_length))
            if example is not None:
                for k, v in example.items():
                    out[k].append(v)
        return out

    return ds.map(encode, batched=True, remove_columns=ds.column_names, cache_file_name=str(out_dir / f"{digest}.arrow"),
                  load_from_cache_file=True, new_fingerprint=digest, desc=f"tokenising {task}")


class SFTCollator:
    """Right-pads a list of tokenised examples with transformers' ``DataCollatorForSeq2Seq``: ``input_ids`` with
    the pad token, ``attention_mask`` 0, ``labels`` -100 (other columns are dropped). ``pad_to``: pad every
    batch to this length (``--pad-to-max``; examples are already truncated to it at tokenisation, the prompt
    first, so the collator never cuts). Training pads on the right whatever the tokenizer's own
    ``padding_side``: the collator works on a copy of the tokenizer set to the right."""

    KEEP = ("input_ids", "attention_mask", "labels")

    def __init__(self, tokenizer, pad_to: int | None = None):
        from transformers import DataCollatorForSeq2Seq

        right = copy.copy(tokenizer)  # shallow: shares the vocabulary; only its padding side differs
        right.padding_side = "right"
        self.pad_to = pad_to
        self.inner = DataCollatorForSeq2Seq(right, padding="max_length" if pad_to else "longest",
                                            max_length=pad_to or None, label_pad_token_id=-100, return_tensors="pt")

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        return self.inner([{k: f[k] for k in self.KEEP if k in f} for f in features])


def training_collator(cfg, tokenizer):
    """The training batches' collator: :class:`peftlab.tasks.batching.PackingCollator` with ``--packing`` (one
    unpadded row per batch), else :class:`SFTCollator` (right-padded to the batch's longest, or to --max-length
    with ``--pad-to-max``)."""
    if getattr(cfg, "packing", False):
        from peftlab.tasks.batching import PackingCollator

        return PackingCollator()
    return SFTCollator(tokenizer, cfg.max_length if getattr(cfg, "pad_to_max", False) else None)


def score_generations(questions, golds, generated) -> list[dict]:
    from peftlab.tasks.math_answers import answers_match, extract_answer

    records = []
    for question, gold, text in zip(questions, golds, generated):
        predicted = extract_answer(text)
        records.append({"question": question, "gold": gold, "generated": text, "extracted": predicted,
                        "correct": answers_match(predicted, gold)})
    return records


def gsm8k_evaluator(cfg, tokenizer, eval_raw):
    """GSM8K's ``evaluate(model, accelerator, tag)``: greedy answers to the test problems, exact match of the
    final number; ``accuracy`` and ``answered``, every generation logged in ``generations_<tag>.jsonl``."""
    from peftlab.tasks.math_answers import answer_is_final

    questions = list(eval_raw["instruction"])
    golds = list(eval_raw["gold"])

    def score(texts: list[str]):
        records = score_generations(questions, golds, texts)
        accuracy = sum(r["correct"] for r in records) / max(1, len(records))
        answered = sum(r["extracted"] is not None for r in records) / max(1, len(records))
        return records, {"accuracy": accuracy, "answered": answered}

    return generation_evaluator(cfg, tokenizer, [encode_prompt(tokenizer, q) for q in questions], score,
                                stop_when=answer_is_final)


def loss_evaluator(cfg, tokenizer, eval_tok):
    collate = SFTCollator(tokenizer)
    longest = max(eval_tok["length"]) if len(eval_tok) else 1
    batch_size = max(1, min(cfg.eval_batch_size, LOSS_EVAL_TOKENS // max(1, longest)))
    order = sorted(range(len(eval_tok)), key=lambda i: -eval_tok[i]["length"])
    dataset = eval_tok.select(order).select_columns(["input_ids", "attention_mask", "labels"])

    @torch.no_grad()
    def evaluate(model, accelerator, tag: str) -> Evaluation:  # tag: the loss evaluation writes no files
        model.eval()
        loader = eval_loader_on(accelerator, torch.utils.data.DataLoader(dataset, batch_size=batch_size,
                                                                         collate_fn=collate))
        total, count = 0.0, 0
        for batch in loader:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            sums, counts = response_loss_sums(logits, batch["labels"])
            sums, counts = accelerator.gather_for_metrics((sums, counts))
            total += float(sums.sum())
            count += int(counts.sum())
        model.train()
        loss = total / max(1, count)
        return Evaluation({"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))})

    return evaluate


def response_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example summed next-token cross-entropy over labelled positions, and their counts."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    losses = torch.nn.functional.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=-100,
                                               reduction="none")
    mask = shift_labels != -100
    return (losses * mask).sum(dim=1), mask.sum(dim=1)


# --------------------------------------------------------------------------- the pipeline


def build_pipeline(cfg, tokenizer, model, task: Task):
    """The ``instruction`` kind's :class:`~peftlab.tasks.prepare.Pipeline` for ``task`` (gsm8k, alpaca, json)."""
    from peftlab.tasks import data_files as data

    if tokenizer is None:
        raise PeftlabError(f"model '{cfg.model}' has no tokenizer", fix="use a causal LM with a tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_raw, eval_raw = load_instruction_data(cfg, task)
    train_raw = data.subset(train_raw, cfg.max_train_samples, cfg.seed)
    eval_raw = data.subset(eval_raw, cfg.max_eval_samples, cfg.eval_seed)  # fixed across training seeds
    prefix = f"{cfg.model}-{cfg.task}"
    train = tokenize_instructions(train_raw, tokenizer, cfg.max_length, task=cfg.task, cache_key=f"{prefix}-train")
    if len(train) == 0:
        raise PeftlabError(f"no training example has a response token left at --max-length {cfg.max_length}",
                           fix="raise --max-length")
    report_truncation(cfg, "train", len(train_raw), train)
    extras: dict[str, Any] = {"train_examples_used": len(train), "eval_examples": len(eval_raw),
                              "eval_examples_digest": examples_digest({"eval": eval_raw})}
    collate = training_collator(cfg, tokenizer)
    digest = train_examples_digest(train_raw)  # the drawn records, before tokenisation drops any
    if task.primary_metric != "eval_loss":  # scored on its generated answers (GSM8K)
        evaluate = gsm8k_evaluator(cfg, tokenizer, eval_raw)
        return Pipeline(train, collate, evaluate, "accuracy", 0.0, num_eval_examples=len(eval_raw), extras=extras,
                        eval_sets={"test": eval_raw}, train_examples_digest=digest)
    eval_tok = tokenize_instructions(eval_raw, tokenizer, cfg.max_length, task=cfg.task, cache_key=f"{prefix}-eval")
    report_truncation(cfg, "eval", len(eval_raw), eval_tok)
    if len(eval_tok) == 0:
        raise PeftlabError(f"no evaluation example has a response token left at --max-length {cfg.max_length}",
                           fix="raise --max-length")
    extras["eval_examples"] = len(eval_tok)
    return Pipeline(train, collate, loss_evaluator(cfg, tokenizer, eval_tok), "eval_loss", 0.0,
                    num_eval_examples=len(eval_tok), extras=extras, eval_sets={"eval": eval_raw},
                    train_examples_digest=digest)


def report_truncation(cfg, split: str, n_raw: int, tokenised) -> None:
    truncated = sum(tokenised["truncated"])
    dropped = n_raw - len(tokenised)
    if (truncated or dropped) and _is_main():
        print(f"{cfg.task} {split}: {truncated} of {n_raw} examples truncated to --max-length {cfg.max_length} "
              f"(prompt first), {dropped} dropped (no response token left)")


def _is_main() -> bool:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0
