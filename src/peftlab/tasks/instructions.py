"""Instruction tuning of causal LMs (the ``instruction`` pipeline: GSM8K, Alpaca, JSON; data:
:mod:`peftlab.tasks.instruction_data`), and the training set every generation task shares (:func:`training_pipeline`).

* **Format.** With a chat template: user = instruction [+ "\\n\\n" + input], assistant = response (the template's
  end-of-turn token ends the response and is trained on, so the model learns to stop); without one, Alpaca's
  ``### Instruction:`` blocks and EOS. Prompt and response are tokenised apart and concatenated, so the
  training prompt is token for token the prompt generation starts from.
* **Loss on the response only.** A long example loses the start of its prompt first (the prompt keeps at least
  half of ``--max-length`` when the response is longer), then the end of its response; one with no response
  token left is dropped.
* **Evaluation.** GSM8K: greedy answers, exact match of the final number (:mod:`peftlab.tasks.math_answers`),
  ``accuracy`` and ``answered``. Alpaca/JSON: token-weighted cross-entropy on the held-out responses
  (``eval_loss``, ``perplexity``; lower is better), per-example sums gathered with ``gather_for_metrics``.
"""

from __future__ import annotations

import copy
import hashlib
import math
import os
from typing import Any, Callable, Sequence

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


def prompt_text(tokenizer, instruction: str, input_text: str = "", history: Sequence[tuple[str, str]] = ()) -> str:
    """The prompt exactly as the model sees it before its answer (ends with the assistant header); ``history``:
    earlier (question, answer) turns of the conversation (MT-Bench's second turn), as FastChat replays them."""
    if has_chat_template(tokenizer):
        turns = [m for q, a in history for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
        user = {"role": "user", "content": user_message(instruction, input_text)}
        return tokenizer.apply_chat_template(turns + [user], tokenize=False, add_generation_prompt=True)
    template = PLAIN_PROMPT_WITH_INPUT if input_text and input_text.strip() else PLAIN_PROMPT
    return "".join(prompt_text(tokenizer, q) + a + "\n\n" for q, a in history) + \
        template.format(instruction=instruction, input=input_text)


def response_text(tokenizer, instruction: str, input_text: str, output: str) -> str:
    """The response as trained on, including the end-of-turn / EOS marker."""
    if has_chat_template(tokenizer):
        prompt = prompt_text(tokenizer, instruction, input_text)
        full = tokenizer.apply_chat_template([{"role": "user", "content": user_message(instruction, input_text)},
                                              {"role": "assistant", "content": output}], tokenize=False)
        if full.startswith(prompt):
            return full[len(prompt):].rstrip()
    return output + (tokenizer.eos_token or "")


def encode_prompt(tokenizer, instruction: str, input_text: str = "", history: Sequence[tuple[str, str]] = ()
                  ) -> list[int]:
    """:func:`prompt_text`'s token ids: generation starts from exactly the training prompt."""
    ids = tokenizer(prompt_text(tokenizer, instruction, input_text, history), add_special_tokens=False)["input_ids"]
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


def tokenize_instructions(ds, tokenizer, max_length: int, *, task: str, cache_key: str, content: str | None = None):
    """Tokenise ``instruction``/``input``/``output`` rows with :func:`encode_example`, cached
    (:func:`peftlab.tasks.batching.cached_map`); columns ``input_ids``, ``attention_mask``, ``labels``, ``length``,
    ``prompt_length``, ``truncated``. Rows with no response token left are dropped."""
    from peftlab.tasks.batching import cached_map

    def encode(batch, max_length: int):
        out: dict[str, list] = {k: [] for k in ("input_ids", "attention_mask", "labels", "length", "prompt_length",
                                                "truncated")}
        for instruction, input_text, output in zip(batch["instruction"], batch["input"], batch["output"]):
            example = encode_example(tokenizer, instruction, input_text, output, max_length)
            if example is not None:
                for k, v in example.items():
                    out[k].append(v)
        return out

    key = f"sft{FORMAT_VERSION}-{cache_key}-{_template_digest(tokenizer)}-eos{tokenizer.eos_token_id}"
    return cached_map(ds, encode, tokenizer, max_length, task=task, cache_key=key, content=content)


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


def gsm8k_evaluator(cfg, tokenizer, eval_raw):
    """GSM8K's ``evaluate(model, accelerator, tag)``: greedy answers to the test problems, exact match of the
    final number; ``accuracy`` and ``answered``, every generation logged in ``generations_<tag>.jsonl``."""
    from peftlab.tasks.math_answers import answer_is_final, answers_match, extract_answer

    questions = list(eval_raw["instruction"])
    golds = list(eval_raw["gold"])

    def score(texts: list[str]):
        records = []
        for question, gold, text in zip(questions, golds, texts):
            predicted = extract_answer(text)
            records.append({"question": question, "gold": gold, "generated": text, "extracted": predicted,
                            "correct": answers_match(predicted, gold)})
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

    ensure_pad_token(cfg, tokenizer)
    train_raw, eval_raw = load_instruction_data(cfg, task)
    eval_raw = data.subset(eval_raw, cfg.max_eval_samples, cfg.eval_seed)  # fixed across training seeds
    extras: dict[str, Any] = {"eval_examples": len(eval_raw),
                              "eval_examples_digest": examples_digest({"eval": eval_raw})}
    if task.primary_metric != "eval_loss":  # scored on its generated answers (GSM8K)
        return training_pipeline(
            cfg, tokenizer, train_raw, evaluate=gsm8k_evaluator(cfg, tokenizer, eval_raw), primary_metric="accuracy",
            chance=0.0, num_eval_examples=len(eval_raw), extras=extras, eval_sets={"test": eval_raw})
    eval_tok = tokenize_instructions(eval_raw, tokenizer, cfg.max_length, task=cfg.task,
                                     cache_key=f"{cfg.model}-{cfg.task}-eval")
    report_truncation(cfg, "eval", len(eval_raw), eval_tok)
    nonempty(cfg, "evaluation", eval_tok)
    extras["eval_examples"] = len(eval_tok)
    return training_pipeline(cfg, tokenizer, train_raw, evaluate=loss_evaluator(cfg, tokenizer, eval_tok),
                                        primary_metric="eval_loss", chance=0.0, num_eval_examples=len(eval_tok),
                                        extras=extras, eval_sets={"eval": eval_raw})


def training_pipeline(cfg, tokenizer, train_raw, *, evaluate: Callable, primary_metric: str, chance: float,
                      num_eval_examples: int, extras: dict, eval_sets: dict):
    """The :class:`~peftlab.tasks.prepare.Pipeline`: ``train_raw`` (``instruction``/``input``/``output``) subset
    by ``--max-train-samples`` (seeded by ``--seed``), tokenised with the loss on the response only."""
    from peftlab.tasks.data_files import subset

    train_raw = subset(train_raw, cfg.max_train_samples, cfg.seed)
    train_digest = train_examples_digest(train_raw)  # once: the token cache's key and result.json's digest
    train = tokenize_instructions(train_raw, tokenizer, cfg.max_length, task=cfg.task,
                                  cache_key=f"{cfg.model}-{cfg.task}-train", content=train_digest)
    nonempty(cfg, "training", train)
    report_truncation(cfg, "train", len(train_raw), train)
    collate = training_collator(cfg, tokenizer)  # right-padded, or one unpadded row per batch (--packing)
    return Pipeline(train, collate, evaluate, primary_metric, chance, num_eval_examples=num_eval_examples,
                    extras={**extras, "train_examples_used": len(train)}, eval_sets=eval_sets,
                    # the drawn records, before tokenisation drops any (train_examples_used counts those kept)
                    train_examples_digest=train_digest)


def nonempty(cfg, what: str, tokenised) -> None:
    if len(tokenised) == 0:
        raise PeftlabError(f"no {what} example has a response token left at --max-length {cfg.max_length}",
                           fix="raise --max-length")


def report_truncation(cfg, split: str, n_raw: int, tokenised) -> None:
    truncated = sum(tokenised["truncated"])
    dropped = n_raw - len(tokenised)
    if (truncated or dropped) and int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        print(f"{cfg.task} {split}: {truncated} of {n_raw} examples truncated to --max-length {cfg.max_length} "
              f"(prompt first), {dropped} dropped (no response token left)")


def ensure_pad_token(cfg, tokenizer) -> None:
    if tokenizer is None:
        raise PeftlabError(f"model '{cfg.model}' has no tokenizer", fix="use a causal LM with a tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
