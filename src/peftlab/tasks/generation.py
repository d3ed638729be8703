"""Greedy generation from token-id prompts, and the ``evaluate`` of every task scored on generated text.

* :func:`generate_greedy`, the one path evaluation uses (GSM8K, commonsense, math, E2E, MT-Bench): prompts
  sorted by length, left-padded into batches, ``model.generate`` with a greedy
  :class:`transformers.GenerationConfig` that stops at EOS / the chat end-of-turn token (:func:`stop_token_ids`)
  or ``max_new_tokens``, optionally a per-row stopping rule on the text so far.
* :func:`generate`, peftlab's earlier hand-written greedy loop (KV cache, finished rows leave the batch): the
  same tokens (tests check it), kept only for ``peftlab bench --decode``, which times the two.
* :func:`generation_evaluator`, the ``evaluate(model, accelerator, tag)`` of those tasks: prompts are sharded by
  index across processes (``accelerate launch``), the texts gathered with ``accelerate.utils.gather_object``,
  scored, and (main process only) written to ``<output_dir>/generations_<tag>.jsonl``, a file named in the
  evaluation's extras.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from peftlab.io_utils import atomic_write_text
from peftlab.tasks.prepare import Evaluation


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts as one left-padded batch (ids, attention mask): a decoder continues every row at the end."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def stop_token_ids(tokenizer) -> list[int]:
    """EOS and the chat end-of-turn tokens that end a generated answer."""
    ids = []
    for token in (tokenizer.eos_token, "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        if token is None:
            continue
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None) and tid not in ids:
            ids.append(tid)
    return ids


def _cache_argument(model) -> str:
    """The forward argument that takes the KV cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[list[int]], *, max_new_tokens: int, batch_size: int,
             device=None, stop_when: Callable[[str], bool] | None = None) -> list[str]:
    """Greedy completions of token-id prompts, decoded without special tokens: the hand-written loop that
    ``peftlab bench --decode`` times against :func:`generate_greedy` (evaluation runs that one).

    Batches of similar prompt lengths, left-padded, with the KV cache. A sequence ends at EOS / end of turn
    (:func:`stop_token_ids`), after ``max_new_tokens`` tokens, or when ``stop_when(text so far)`` turns true
    (checked at each newline). Finished sequences leave the batch (their rows are dropped from the cache), so
    one long generation does not keep the other 63 computing padding: the cost is the sum of the generated
    lengths, not batches x the longest. Token for token this is ``model.generate(do_sample=False)``.
    """
    from transformers import DynamicCache

    device = device or next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = set(stop_token_ids(tokenizer))
    cache_arg = _cache_argument(model)
    ends_line: dict[int, bool] = {}  # token id -> its text holds a newline (decoded once per id, not per step)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # similar lengths share a batch
    generated: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        ids, mask = left_padded([prompts[i] for i in chunk], pad)
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        alive = list(chunk)  # prompt index of each row still generating
        cache = DynamicCache(config=getattr(model, "config", None))
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{cache_arg: cache},
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        next_position = positions[:, -1] + 1
        for step in range(int(max_new_tokens)):
            tokens = logits.argmax(-1)
            keep = []
            for row, token in enumerate(tokens.tolist()):
                index = alive[row]
                if token in stops:
                    continue
                generated[index].append(token)
                if token not in ends_line:
                    ends_line[token] = "\n" in tokenizer.decode([token])
                if stop_when is not None and ends_line[token] and stop_when(
                        tokenizer.decode(generated[index], skip_special_tokens=True)):
                    continue
                keep.append(row)
            if not keep or step == int(max_new_tokens) - 1:
                break
            if len(keep) < len(alive):
                rows = torch.as_tensor(keep, device=device)
                cache.batch_select_indices(rows)
                mask, tokens, next_position = mask[rows], tokens[rows], next_position[rows]
                alive = [alive[row] for row in keep]
            mask = torch.cat([mask, mask.new_ones((len(alive), 1))], dim=1)
            logits = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                           **{cache_arg: cache}, use_cache=True).logits[:, -1]
            next_position = next_position + 1
    return [tokenizer.decode(generated[i], skip_special_tokens=True).strip() for i in range(len(prompts))]


def write_generations(path: str | os.PathLike, records: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def read_generations(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def generation_file(tag: str) -> str:
    """The generation log of the evaluation ``tag``: ``generations_before.jsonl``, ``generations_epoch1.jsonl``..."""
    return f"generations_{tag}.jsonl"


StopWhen = Callable[[str], bool]  # generated text so far -> nothing more can change the score


def _text_stop(tokenizer, prompt_width: int, rules: Sequence[StopWhen]):
    """A per-row ``StoppingCriteria``: row ``r`` is done once ``rules[r](its generated text)`` is true."""
    from transformers import StoppingCriteria

    class TextStop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            texts = tokenizer.batch_decode(input_ids[:, prompt_width:], skip_special_tokens=True)
            return torch.tensor([bool(rule(t)) for rule, t in zip(rules, texts)], dtype=torch.bool,
                                device=input_ids.device)

    return TextStop()


@torch.no_grad()
def generate_greedy(model, tokenizer, prompts: Sequence[list[int]], *, max_new_tokens: int, batch_size: int,
                    device=None, stop_when: StopWhen | Sequence[StopWhen] | None = None) -> list[str]:
    """Greedy completions of token-id ``prompts`` (one text per prompt, in order), decoded without special
    tokens and stripped. Batches of similar prompt lengths, left-padded, through ``model.generate``.
    ``stop_when``: one rule for every prompt, or one per prompt (a row stops when its rule holds)."""
    from transformers import GenerationConfig, StoppingCriteriaList

    device = device or next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_token_ids(tokenizer)
    config = GenerationConfig(max_new_tokens=int(max_new_tokens), do_sample=False, num_beams=1,
                              eos_token_id=stops, pad_token_id=pad)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # similar lengths share a batch
    texts: dict[int, str] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        ids, mask = left_padded([prompts[i] for i in chunk], pad)
        width = ids.shape[1]
        criteria = None
        if stop_when is not None:
            rules = [stop_when if callable(stop_when) else stop_when[i] for i in chunk]
            criteria = StoppingCriteriaList([_text_stop(tokenizer, width, rules)])
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             stopping_criteria=criteria)
        for row, i in enumerate(chunk):
            tokens = out[row, width:].tolist()
            # Cut at the first stop token: what follows is padding (pad = eos for SmolLM2).
            end = next((k for k, t in enumerate(tokens) if t in stops), len(tokens))
            texts[i] = tokenizer.decode(tokens[:end], skip_special_tokens=True).strip()
    return [texts[i] for i in range(len(prompts))]


def generation_evaluator(cfg, tokenizer, prompts: Sequence[list[int]],
                         score: Callable[[list[str]], tuple], *,
                         stop_when: StopWhen | Sequence[StopWhen] | None = None) -> Callable:
    """``evaluate(model, accelerator, tag) -> Evaluation`` scoring :func:`generate_greedy`'s texts from
    ``prompts`` (at most ``cfg.max_new_tokens`` each, batches of ``cfg.eval_batch_size``).

    ``score(texts)`` (one per prompt, in order) returns the records to log and the metrics, and optionally a
    third item: notes on this evaluation (e.g. why a metric is missing), kept in result.json's
    ``metric_notes[tag]``. The records go to ``cfg.output_dir/generations_<tag>.jsonl``; the evaluation's
    extras name that file as ``generations[tag]`` and ``generations_file`` (the latest).
    """

    def evaluate(model, accelerator, tag: str) -> Evaluation:
        from accelerate.utils import gather_object

        was_training = model.training
        model.eval()
        rank, world = accelerator.process_index, accelerator.num_processes
        mine = list(range(rank, len(prompts), world))
        texts = generate_greedy(accelerator.unwrap_model(model), tokenizer, [prompts[i] for i in mine],
                                max_new_tokens=cfg.max_new_tokens, batch_size=cfg.eval_batch_size,
                                device=accelerator.device,
                                stop_when=stop_when if stop_when is None or callable(stop_when)
                                else [stop_when[i] for i in mine])
        pairs = list(zip(mine, texts))
        if world > 1:
            pairs = gather_object(pairs)
        generated = dict(pairs)
        records, metrics, *notes = score([generated[i] for i in range(len(prompts))])
        extras: dict[str, Any] = {"metric_notes": {tag: notes[0]}} if notes and notes[0] else {}
        if accelerator.is_main_process:
            name = generation_file(tag)
            write_generations(Path(cfg.output_dir) / name, records)
            extras.update({"generations": {tag: name}, "generations_file": name})
        if was_training:
            model.train()
        return Evaluation(metrics, extras)

    return evaluate
