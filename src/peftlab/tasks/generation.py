"""Greedy generation from token-id prompts (:func:`generate_greedy`, the one path every generation-scored task
uses), sharded over processes (:func:`generate_sharded`), and those tasks' ``evaluate`` (:func:`generation_evaluator`:
scored, and written by the main process to ``<output_dir>/generations_<tag>.jsonl``).
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


def generate_sharded(cfg, tokenizer, model, accelerator, prompts: Sequence[list[int]],
                     stop_when: StopWhen | Sequence[StopWhen] | None = None) -> list[str]:
    """:func:`generate_greedy`'s texts of every prompt (at most ``cfg.max_new_tokens`` each, batches of
    ``cfg.eval_batch_size``), sharded by index across processes and gathered: every process gets them all."""
    from accelerate.utils import gather_object

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
    return [generated[i] for i in range(len(prompts))]


def generation_evaluator(cfg, tokenizer, prompts: Sequence[list[int]],
                         score: Callable[[list[str]], tuple], *,
                         stop_when: StopWhen | Sequence[StopWhen] | None = None) -> Callable:
    """``evaluate(model, accelerator, tag) -> Evaluation`` scoring :func:`generate_sharded`'s texts of ``prompts``.

    ``score(texts)`` (one per prompt, in order) returns the records to log and the metrics, and optionally a
    third item: notes on this evaluation (e.g. why a metric is missing), kept in result.json's
    ``metric_notes[tag]``. The records go to ``cfg.output_dir/generations_<tag>.jsonl``; the evaluation's
    extras name that file as ``generations[tag]`` and ``generations_file`` (the latest).
    """

    def evaluate(model, accelerator, tag: str) -> Evaluation:
        was_training = model.training
        model.eval()
        texts = generate_sharded(cfg, tokenizer, model, accelerator, prompts, stop_when)
        records, metrics, *notes = score(texts)
        extras: dict[str, Any] = {"metric_notes": {tag: notes[0]}} if notes and notes[0] else {}
        if accelerator.is_main_process:
            name = generation_file(tag)
            write_generations(Path(cfg.output_dir) / name, records)
            extras.update({"generations": {tag: name}, "generations_file": name})
        if was_training:
            model.train()
        return Evaluation(metrics, extras)

    return evaluate
