"""Instruction tuning of causal LMs: GSM8K, Alpaca and any JSON/JSONL instruction file.

``build_pipeline(cfg, tokenizer, model)`` is the ``instruction`` task kind's builder (see
:mod:`peftlab.tasks.prepare`). What it does, top to bottom:

* **Data.** ``gsm8k``: ``<root>/gsm8k/{train,test}.jsonl`` (``question``/``answer``; the final answer follows
  ``####``); trains on train, evaluates on a seeded subset of test (``--max-eval-samples``; the same problems
  before and after fine-tuning). ``alpaca``: ``<root>/alpaca/alpaca_data.json`` or ``alpaca_data_1k.json``
  (``instruction``/``input``/``output``), with a held-out 10% split (fixed seed :data:`SPLIT_SEED`, so every
  run seed scores on the same held-out records). ``json``: ``--train-file`` (and optionally ``--eval-file``,
  else a held-out 10%), a JSON list or JSONL of objects whose field names ``--instruction-fields`` gives as
  ``prompt,input,response`` (input optional: ``question,,answer`` or ``question,answer``). ``<root>`` is found
  like GLUE's (``--data-dir``, ``$PEFTLAB_DATA_DIR``, ``./data``, ``../shared/data``); when no local copy exists
  the Hub (``openai/gsm8k`` "main", ``tatsu-lab/alpaca``) is used unless ``HF_DATASETS_OFFLINE``/
  ``HF_HUB_OFFLINE`` is set, in which case a :class:`~peftlab.errors.PeftlabError` lists the paths tried.
  GSM8K's calculator annotations (``<<16-3-4=9>>``) are removed from the training targets.
* **Format.** With a chat template: user = instruction [+ "\\n\\n" + input], assistant = response (the template's
  own end-of-turn token, e.g. ``<|im_end|>``, ends the response and is trained on, so the model learns to stop).
  Without one: ``### Instruction:`` / ``### Input:`` / ``### Response:`` blocks and the EOS token.
  Prompt and response are tokenised separately and concatenated, so the training prompt is token-for-token
  the prompt used at generation time.
* **Loss on the response only.** ``labels`` is -100 on every prompt token (and padding). Examples longer than
  ``--max-length`` are cut on the prompt side first (its start is dropped, keeping the generation prefix),
  but the prompt keeps at least half of ``--max-length`` when the response is longer; then the response is
  cut from the right. An example left with no response token is dropped. Tokenisation is a cached
  ``datasets.map`` in the same cache folder and with the same hash as :func:`peftlab.tasks.data_files.tokenize`.
* **Evaluation.** GSM8K: batched greedy generation with the KV cache (left padding, stop at EOS/end of turn,
  ``--max-new-tokens``), exact match of the final number (:mod:`peftlab.tasks.math_answers`); every generation is
  written to ``<output_dir>/generations_<tag>.jsonl`` (tag ``before``, then ``epoch1``, ``epoch2``...;
  ``evaluate`` when ``peftlab evaluate`` re-scores a finished run) with the question, gold answer, generated
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

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from peftlab.errors import PeftlabError

FORMAT_VERSION = "1"  # bump when prompt formatting or truncation changes: token caches key on it
SPLIT_SEED = 0  # held-out split of alpaca/json: the same records whatever the run's --seed
HELD_OUT_FRACTION = 0.1
LOSS_EVAL_TOKENS = 8192  # padded tokens per loss-evaluation batch (logits are batch x length x vocabulary)
HUB = {"gsm8k": ("openai/gsm8k", "main"), "alpaca": ("tatsu-lab/alpaca", None)}
LOCAL = {
    ("gsm8k", "train"): ("gsm8k/train.jsonl",),
    ("gsm8k", "test"): ("gsm8k/test.jsonl",),
    ("alpaca", "train"): ("alpaca/alpaca_data.json", "alpaca/alpaca_data_1k.json"),
}
PLAIN_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
PLAIN_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
_CALCULATOR = re.compile(r"<<[^<>]*>>")


# --------------------------------------------------------------------------- reading records


@dataclass(frozen=True)
class Fields:
    """Field names of one instruction record: prompt, optional input, response."""

    prompt: str = "instruction"
    input: str | None = "input"
    response: str = "output"


def parse_fields(spec: str | Sequence[str]) -> Fields:
    """``"instruction,input,output"``, ``"question,,answer"`` or ``"question,answer"`` -> :class:`Fields`."""
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec)]
    if len(parts) == 2:
        parts = [parts[0], "", parts[1]]
    if len(parts) != 3 or not parts[0] or not parts[2]:
        raise PeftlabError(
            f"--instruction-fields must name the prompt, input and response fields, got '{spec}'",
            fix="e.g. --instruction-fields instruction,input,output (or question,,answer without an input field)",
        )
    return Fields(parts[0], parts[1] or None, parts[2])


def _record(obj: Any, fields: Fields, where: str) -> dict[str, str]:
    if not isinstance(obj, dict):
        raise PeftlabError(f"record is a JSON {type(obj).__name__}, expected an object", where=where,
                           fix=f"each record must be an object with '{fields.prompt}' and '{fields.response}'")
    out = {}
    for key, name, required in (("instruction", fields.prompt, True), ("input", fields.input, False),
                                ("output", fields.response, True)):
        if name is None:
            out[key] = ""
            continue
        value = obj.get(name)
        if value is None:
            if required:
                present = ", ".join(sorted(map(str, obj))) or "none"
                raise PeftlabError(f"record has no '{name}' field (fields: {present})", where=where,
                                   fix="fix the record, or name the fields with --instruction-fields prompt,input,response")
            value = ""
        if not isinstance(value, str):
            raise PeftlabError(f"field '{name}' is a JSON {type(value).__name__}, expected a string", where=where,
                               fix="instruction records hold text fields")
        out[key] = value
    if not out["output"].strip():
        raise PeftlabError(f"field '{fields.response}' is empty", where=where, fix="remove the record or fill it in")
    return out


def read_records(path: str | os.PathLike, fields: Fields = Fields()) -> list[dict[str, str]]:
    """Records ``{"instruction", "input", "output"}`` of a JSON list or JSONL file; a malformed file or
    record raises :class:`PeftlabError` naming the file and line (JSONL) or record number (JSON list)."""
    path = Path(path)
    if not path.is_file():
        raise PeftlabError(f"instruction file not found: {path}", fix="check --train-file / --eval-file")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise PeftlabError(f"file is not valid UTF-8 ({err.reason} at byte {err.start})", where=str(path)) from None
    records: list[dict[str, str]] = []
    if text.lstrip().startswith("["):  # one JSON list
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PeftlabError(f"invalid JSON: {err.msg}", where=f"{path}:{err.lineno}:{err.colno}",
                               fix="a JSON list of records, or one JSON object per line (JSONL)") from None
        for i, obj in enumerate(data):
            records.append(_record(obj, fields, f"{path}, record {i + 1}"))
    else:  # JSONL (a single object on one line is JSONL with one record)
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise PeftlabError(f"invalid JSON: {err.msg}", where=f"{path}:{number}:{err.colno}",
                                   fix="one JSON object per line (JSONL), or a JSON list") from None
            records.append(_record(obj, fields, f"{path}:{number}"))
    if not records:
        raise PeftlabError("file holds no records", where=str(path), fix="a JSON list or JSONL of instruction records")
    return records


def _content_hash(*parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            with open(part, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        else:
            h.update(str(part).encode())
        h.update(b"|")
    return h.hexdigest()[:32]


def _dataset(records: list[dict], fingerprint: str):
    """A ``datasets.Dataset`` with a content-addressed fingerprint (token caches key on it)."""
    from datasets import Dataset

    columns = {key: [r[key] for r in records] for key in records[0]}
    ds = Dataset.from_dict(columns)
    ds._fingerprint = fingerprint
    return ds


def _gsm8k_records(rows: list[dict], where: str) -> list[dict[str, str]]:
    from peftlab.tasks.math_answers import gold_answer

    out = []
    for i, row in enumerate(rows):
        record = _record(row, Fields("question", None, "answer"), f"{where}, record {i + 1}")
        gold = gold_answer(record["output"]) if "####" in record["output"] else None
        if gold is None:
            raise PeftlabError("GSM8K answer has no '#### <number>' final answer", where=f"{where}, record {i + 1}",
                               fix="use the published GSM8K files unchanged")
        record["output"] = _CALCULATOR.sub("", record["output"])
        record["gold"] = gold
        out.append(record)
    return out


def _offline() -> bool:
    from peftlab.tasks.data_files import _offline as offline

    return offline()


def _local_file(task: str, split: str, data_dir) -> tuple[Path | None, list[Path]]:
    from peftlab.tasks.data_files import _candidate_roots, _explicit_dir_check

    _explicit_dir_check(data_dir)
    tried = []
    for root in _candidate_roots(data_dir):
        for rel in LOCAL[(task, split)]:
            path = root / rel
            tried.append(path)
            if path.is_file():
                return path, tried
    return None, tried


def _hub_rows(task: str, split: str) -> list[dict]:
    import datasets

    name, config = HUB[task]
    return [dict(r) for r in datasets.load_dataset(name, config, split=split)]


def load_raw(task: str, split: str, data_dir=None):
    """One split of ``gsm8k`` (train/test) or ``alpaca`` (train) as a ``Dataset`` of ``instruction``, ``input``,
    ``output`` (GSM8K also ``gold``, the canonical final answer)."""
    path, tried = _local_file(task, split, data_dir)
    if path is not None:
        if task == "gsm8k":
            rows = []
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise PeftlabError(f"invalid JSON: {err.msg}", where=f"{path}:{number}",
                                           fix="use the published GSM8K files unchanged") from None
            records = _gsm8k_records(rows, str(path))
        else:
            records = read_records(path)
        return _dataset(records, _content_hash(path, task, split, FORMAT_VERSION))
    if _offline():
        reason = "not trying the Hub (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set)"
    else:
        try:
            rows = _hub_rows(task, split)
        except Exception as err:  # noqa: BLE001 - any Hub failure becomes the message below
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            reason = f"the Hub ({HUB[task][0]}) failed: {first}"
        else:
            records = _gsm8k_records(rows, HUB[task][0]) if task == "gsm8k" else [
                _record(r, Fields(), f"{HUB[task][0]}, record {i + 1}") for i, r in enumerate(rows)]
            return _dataset(records, _content_hash(HUB[task][0], task, split, len(records), FORMAT_VERSION))
    raise PeftlabError(
        f"no local copy of {task} {split}; {reason}",
        where="looked for " + ", ".join(str(p) for p in tried),
        fix=f"pass --data-dir (or set PEFTLAB_DATA_DIR) to a folder holding {LOCAL[(task, split)][0]}, or run with "
        "network access (HF_DATASETS_OFFLINE and HF_HUB_OFFLINE unset) to load it from the Hub",
    )


def _held_out(ds):
    """(train, held-out): a fixed-seed 90/10 split (at least one record on each side)."""
    if len(ds) < 2:
        raise PeftlabError(f"need at least 2 records to hold some out for evaluation, got {len(ds)}",
                           fix="add records, or pass --eval-file")
    n_eval = min(len(ds) - 1, max(1, round(HELD_OUT_FRACTION * len(ds))))
    split = ds.train_test_split(test_size=n_eval, shuffle=True, seed=SPLIT_SEED)
    return split["train"], split["test"]


def load_instruction_data(cfg):
    """(train, eval) raw datasets of ``cfg.task``, before subsetting."""
    task = cfg.task
    if task == "gsm8k":
        return load_raw("gsm8k", "train", cfg.data_dir), load_raw("gsm8k", "test", cfg.data_dir)
    if task == "alpaca":
        return _held_out(load_raw("alpaca", "train", cfg.data_dir))
    if task == "json":
        if not cfg.train_file:
            raise PeftlabError("--task json needs --train-file", fix="pass a JSON list or JSONL of instruction records")
        fields = parse_fields(cfg.instruction_fields)
        train_path = Path(cfg.train_file)
        train = _dataset(read_records(train_path, fields),
                         _content_hash(train_path, fields, "json-train", FORMAT_VERSION))
        if cfg.eval_file:
            eval_path = Path(cfg.eval_file)
            return train, _dataset(read_records(eval_path, fields),
                                   _content_hash(eval_path, fields, "json-eval", FORMAT_VERSION))
        return _held_out(train)
    raise PeftlabError(f"task '{task}' is not an instruction task", fix="use gsm8k, alpaca or json")


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
    :func:`peftlab.tasks.data_files.tokenize`); columns ``input_ids``, ``attention_mask``, ``labels``, ``length``,
    ``prompt_length``, ``truncated``. Rows with no response token left are dropped."""
    from peftlab.tasks.data_files import _tokenize_hash, tokenized_cache_dir

    if max_length is None or int(max_length) <= 0:
        raise PeftlabError(f"max_length must be a positive integer, got {max_length!r}", fix="use e.g. 512")
    key = f"sft{FORMAT_VERSION}-{cache_key}-{_template_digest(tokenizer)}-eos{tokenizer.eos_token_id}"
    digest = _tokenize_hash(ds, tokenizer, max_length, task, key)
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
    """Right-pads a list of examples: ``input_ids`` with the pad token, ``attention_mask`` 0, ``labels`` -100
    (other columns are ignored). ``pad_to``: pad every batch to this length (``--pad-to-max``)."""

    def __init__(self, pad_token_id: int, pad_to: int | None = None):
        self.pad_token_id, self.pad_to = int(pad_token_id), pad_to

    def __call__(self, features: Sequence[dict]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        if self.pad_to:
            width = max(width, self.pad_to)
        batch = {"input_ids": torch.full((len(features), width), self.pad_token_id, dtype=torch.long),
                 "attention_mask": torch.zeros((len(features), width), dtype=torch.long),
                 "labels": torch.full((len(features), width), -100, dtype=torch.long)}
        for row, f in enumerate(features):
            n = len(f["input_ids"])
            batch["input_ids"][row, :n] = torch.as_tensor(f["input_ids"])
            batch["attention_mask"][row, :n] = torch.as_tensor(f["attention_mask"])
            batch["labels"][row, :n] = torch.as_tensor(f["labels"])
        return batch


# --------------------------------------------------------------------------- evaluation


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
    """Greedy completions of token-id prompts, decoded without special tokens.

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
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            n = len(prompts[i])
            ids[row, width - n:] = torch.as_tensor(prompts[i])
            mask[row, width - n:] = 1
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


def score_generations(questions, golds, generated) -> list[dict]:
    from peftlab.tasks.math_answers import answers_match, extract_answer

    records = []
    for question, gold, text in zip(questions, golds, generated):
        predicted = extract_answer(text)
        records.append({"question": question, "gold": gold, "generated": text, "extracted": predicted,
                        "correct": answers_match(predicted, gold)})
    return records


def write_generations(path: str | os.PathLike, records: list[dict]) -> None:
    from peftlab.training.run_folder import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def read_generations(path: str | os.PathLike) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


class _Tags:
    """Names generation files: ``before`` for an evaluation before fine-tuning, then ``epoch<N>``."""

    def __init__(self, cfg, expects_before: bool):
        self.out = Path(cfg.output_dir)
        resuming = bool(cfg.resume) and (self.out / "checkpoint").is_dir()
        self.pending_before = expects_before and not resuming
        self.calls = 0

    def next(self) -> str:
        from peftlab.training.run_folder import FINISHED, read_result

        self.calls += 1
        finished = read_result(self.out)
        if finished is not None and finished.get("status") in FINISHED:
            return "evaluate"  # `peftlab evaluate` of a finished run: never overwrite its training-time files
        if self.pending_before and self.calls == 1:
            return "before"
        done = 0
        log = self.out / "epochs.jsonl"
        if log.is_file():
            done = sum(1 for line in log.read_text().splitlines() if line.strip())
        return f"epoch{done + 1}"


def _evaluate_gsm8k(cfg, tokenizer, eval_raw, extras: dict, tags: _Tags):
    questions = list(eval_raw["instruction"])
    golds = list(eval_raw["gold"])
    prompts = [encode_prompt(tokenizer, q) for q in questions]

    def evaluate(model, accelerator) -> dict[str, float]:
        from accelerate.utils import gather_object

        from peftlab.tasks.math_answers import answer_is_final

        model.eval()
        tag = tags.next()
        rank, world = accelerator.process_index, accelerator.num_processes
        mine = list(range(rank, len(prompts), world))
        texts = generate(accelerator.unwrap_model(model), tokenizer, [prompts[i] for i in mine],
                         max_new_tokens=cfg.max_new_tokens, batch_size=cfg.eval_batch_size, device=accelerator.device,
                         stop_when=answer_is_final)
        pairs = list(zip(mine, texts))
        if world > 1:
            pairs = gather_object(pairs)
        generated = dict(pairs)
        records = score_generations(questions, golds, [generated[i] for i in range(len(prompts))])
        accuracy = sum(r["correct"] for r in records) / max(1, len(records))
        answered = sum(r["extracted"] is not None for r in records) / max(1, len(records))
        if accelerator.is_main_process:
            name = f"generations_{tag}.jsonl"
            write_generations(Path(cfg.output_dir) / name, records)
            extras.setdefault("generations", {})[tag] = name
            extras["generations_file"] = name
        model.train()
        return {"accuracy": accuracy, "answered": answered}

    return evaluate


def _evaluate_loss(cfg, tokenizer, eval_tok):
    collate = SFTCollator(tokenizer.pad_token_id)
    longest = max(eval_tok["length"]) if len(eval_tok) else 1
    batch_size = max(1, min(cfg.eval_batch_size, LOSS_EVAL_TOKENS // max(1, longest)))
    order = sorted(range(len(eval_tok)), key=lambda i: -eval_tok[i]["length"])
    dataset = eval_tok.select(order).select_columns(["input_ids", "attention_mask", "labels"])

    @torch.no_grad()
    def evaluate(model, accelerator) -> dict[str, float]:
        model.eval()
        loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, batch_size=batch_size, collate_fn=collate))
        total, count = 0.0, 0
        for batch in loader:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            sums, counts = response_loss_sums(logits, batch["labels"])
            sums, counts = accelerator.gather_for_metrics((sums, counts))
            total += float(sums.sum())
            count += int(counts.sum())
        # Forget this loader only (accelerator.free_memory would also drop the optimizer and model it tracks).
        if loader in accelerator._dataloaders:
            accelerator._dataloaders.remove(loader)
        model.train()
        loss = total / max(1, count)
        return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))}

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


def build_pipeline(cfg, tokenizer, model=None):
    """The ``instruction`` kind's :class:`~peftlab.tasks.prepare.Pipeline` for ``cfg.task`` (gsm8k, alpaca, json)."""
    from peftlab.tasks import data_files as data
    from peftlab.tasks.prepare import Pipeline
    from peftlab.tasks.table import TASKS

    if tokenizer is None:
        raise PeftlabError(f"model '{cfg.model}' has no tokenizer", fix="use a causal LM with a tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    task = TASKS[cfg.task]
    train_raw, eval_raw = load_instruction_data(cfg)
    train_raw = data.subset(train_raw, cfg.max_train_samples, cfg.seed)
    eval_raw = data.subset(eval_raw, cfg.max_eval_samples, cfg.eval_seed)  # fixed across training seeds
    prefix = f"{cfg.model}-{cfg.task}"
    train = tokenize_instructions(train_raw, tokenizer, cfg.max_length, task=cfg.task, cache_key=f"{prefix}-train")
    if len(train) == 0:
        raise PeftlabError(f"no training example has a response token left at --max-length {cfg.max_length}",
                           fix="raise --max-length")
    _report_truncation(cfg, "train", len(train_raw), train)
    from peftlab.tasks.prepare import examples_digest

    extras: dict[str, Any] = {"train_examples_used": len(train), "eval_examples": len(eval_raw),
                              "eval_examples_digest": examples_digest({"eval": eval_raw})}
    pad_to = cfg.max_length if getattr(cfg, "pad_to_max", False) else None
    collate = SFTCollator(tokenizer.pad_token_id, pad_to)
    if cfg.task == "gsm8k":
        expects_before = cfg.epochs == 0 or bool(getattr(cfg, "eval_before", False)) or task.eval_before
        evaluate = _evaluate_gsm8k(cfg, tokenizer, eval_raw, extras, _Tags(cfg, expects_before))
        return Pipeline(train, collate, evaluate, "accuracy", 0.0, num_eval_examples=len(eval_raw), extras=extras,
                        eval_sets={"test": eval_raw})
    eval_tok = tokenize_instructions(eval_raw, tokenizer, cfg.max_length, task=cfg.task, cache_key=f"{prefix}-eval")
    _report_truncation(cfg, "eval", len(eval_raw), eval_tok)
    if len(eval_tok) == 0:
        raise PeftlabError(f"no evaluation example has a response token left at --max-length {cfg.max_length}",
                           fix="raise --max-length")
    extras["eval_examples"] = len(eval_tok)
    return Pipeline(train, collate, _evaluate_loss(cfg, tokenizer, eval_tok), "eval_loss", 0.0,
                    num_eval_examples=len(eval_tok), extras=extras, eval_sets={"eval": eval_raw})


def _report_truncation(cfg, split: str, n_raw: int, tokenised) -> None:
    truncated = sum(tokenised["truncated"])
    dropped = n_raw - len(tokenised)
    if (truncated or dropped) and _is_main():
        print(f"{cfg.task} {split}: {truncated} of {n_raw} examples truncated to --max-length {cfg.max_length} "
              f"(prompt first), {dropped} dropped (no response token left)")


def _is_main() -> bool:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0
