"""What the generation-scored task families share (``commonsense``, ``math``, ``e2e``): locating and reading their
data files, the prompt-masked training set, batched greedy generation with ``model.generate``, and the
``evaluate(model, accelerator, tag)`` that scores the generations and logs every one of them.

* **Data.** Files are found under the data roots every task uses (``--data-dir``, ``$PEFTLAB_DATA_DIR``,
  ``./data``, ``../shared/data``; :func:`peftlab.tasks.data_files.candidate_roots`); a missing file is a
  :class:`~peftlab.errors.PeftlabError` naming every path tried. LLM-Adapters' JSON files (a list of
  ``{"instruction", "input", "output", "answer"}``) are read by :func:`read_llm_adapters_json`, which names the
  file and record of a malformed one.
* **Training.** Prompt and response are formatted and tokenised exactly as for the instruction tasks
  (:func:`peftlab.tasks.instructions.tokenize_instructions`: the chat template when the tokenizer has one, the
  loss on the response only), so generation at evaluation time starts from the same prompt tokens.
* **Generation.** :func:`generate_greedy`: prompts sorted by length, left-padded into batches of
  ``--eval-batch-size``, ``model.generate`` with a greedy :class:`transformers.GenerationConfig` that stops at
  EOS / the chat end-of-turn token (:func:`peftlab.tasks.generation.stop_token_ids`) or ``--max-new-tokens``;
  optionally a per-row stopping criterion on the text so far (commonsense stops at the first answer word,
  after which nothing can change the extracted answer).
* **Evaluation.** :func:`generation_evaluator`: prompts are sharded by index across processes
  (``accelerate launch``), the texts gathered with ``accelerate.utils.gather_object``, scored by the family's
  ``score(texts) -> (records, metrics)``, and the records written (main process) to
  ``<output_dir>/generations_<tag>.jsonl`` (``before``, ``epoch<N>``, ``evaluate``), named in the evaluation's
  extras like GSM8K's.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from peftlab.errors import PeftlabError

FORMAT_VERSION = "1"  # bump when record reading or prompt building changes: dataset fingerprints key on it


# --------------------------------------------------------------------------- data files


def find_data_file(data_dir, relative: str, what: str) -> Path:
    """``<root>/<relative>`` in the first data root that has it; else one line listing every path tried."""
    from peftlab.tasks.data_files import candidate_roots, check_data_dir

    check_data_dir(data_dir)
    tried = []
    for root in candidate_roots(data_dir):
        path = root / relative
        tried.append(str(path))
        if path.is_file():
            return path
    raise PeftlabError(f"{what} not found", where="looked for " + ", ".join(tried),
                       fix=f"pass --data-dir (or set PEFTLAB_DATA_DIR) to the shared data folder holding {relative}")


def read_llm_adapters_json(path: Path) -> list[dict[str, str]]:
    """Records ``instruction``, ``input``, ``output``, ``answer`` (strings) of an LLM-Adapters JSON list;
    ``instruction`` and ``answer`` must be non-empty. ``output`` may be empty (mawps' test records, 3 of
    math_data.json's): :func:`training_records` drops those from training."""
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as err:
        raise PeftlabError(f"file is not valid UTF-8 ({err.reason} at byte {err.start})", where=str(path)) from None
    except json.JSONDecodeError as err:
        raise PeftlabError(f"invalid JSON: {err.msg}", where=f"{path}:{err.lineno}:{err.colno}",
                           fix="use the published LLM-Adapters files unchanged") from None
    if not isinstance(data, list) or not data:
        raise PeftlabError("expected a non-empty JSON list of records", where=str(path),
                           fix="use the published LLM-Adapters files unchanged")
    required = ("instruction", "answer")
    records = []
    for number, obj in enumerate(data, 1):
        where = f"{path}, record {number}"
        if not isinstance(obj, dict):
            raise PeftlabError(f"record is a JSON {type(obj).__name__}, expected an object", where=where)
        record = {}
        for key in ("instruction", "input", "output", "answer"):
            value = obj.get(key, "")
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise PeftlabError(f"field '{key}' is a JSON {type(value).__name__}, expected a string", where=where)
            if key in required and not value.strip():
                raise PeftlabError(f"field '{key}' is missing or empty", where=where,
                                   fix="use the published LLM-Adapters files unchanged")
            record[key] = value
        records.append(record)
    return records


def training_records(records: list[dict[str, str]]) -> tuple[list[dict[str, str]], int]:
    """(``instruction``/``input``/``output`` of the records with a response to train on, how many had none)."""
    kept = [{k: r[k] for k in ("instruction", "input", "output")} for r in records if r["output"].strip()]
    return kept, len(records) - len(kept)


def file_digest(*paths: Path, extra: str = "") -> str:
    """SHA-256 (32 hex) of the files' bytes, ``extra`` and :data:`FORMAT_VERSION`: a dataset fingerprint."""
    h = hashlib.sha256((FORMAT_VERSION + "|" + extra).encode())
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                h.update(block)
        h.update(b"|")
    return h.hexdigest()[:32]


def records_dataset(records: list[dict], fingerprint: str):
    """A ``datasets.Dataset`` of ``records`` whose fingerprint is ``fingerprint`` (token caches key on it)."""
    from datasets import Dataset

    ds = Dataset.from_dict({key: [r[key] for r in records] for key in records[0]})
    ds._fingerprint = fingerprint
    return ds


def subset_per_set(datasets_by_set: dict, n: int | None, seed: int) -> dict:
    """``--max-eval-samples`` applied to each set (drawn with ``--eval-seed``: the same for every training seed)."""
    from peftlab.tasks.data_files import subset

    return {name: subset(ds, n, seed) for name, ds in datasets_by_set.items()}


# --------------------------------------------------------------------------- training set


def training_pipeline(cfg, tokenizer, train_raw, *, evaluate: Callable, primary_metric: str, chance: float,
                      num_eval_examples: int, extras: dict, eval_sets: dict):
    """The :class:`~peftlab.tasks.prepare.Pipeline`: ``train_raw`` (``instruction``/``input``/``output``) subset
    by ``--max-train-samples`` (seeded by ``--seed``), tokenised with the loss on the response only."""
    from peftlab.tasks.data_files import subset
    from peftlab.tasks.instructions import SFTCollator, tokenize_instructions
    from peftlab.tasks.prepare import Pipeline

    train_raw = subset(train_raw, cfg.max_train_samples, cfg.seed)
    train = tokenize_instructions(train_raw, tokenizer, cfg.max_length, task=cfg.task,
                                  cache_key=f"{cfg.model}-{cfg.task}-train")
    if len(train) == 0:
        raise PeftlabError(f"no training example has a response token left at --max-length {cfg.max_length}",
                           fix="raise --max-length")
    truncated = sum(train["truncated"])
    if truncated and _is_main():
        print(f"{cfg.task} train: {truncated} of {len(train_raw)} examples truncated to --max-length "
              f"{cfg.max_length} (prompt first), {len(train_raw) - len(train)} dropped")
    extras = {**extras, "train_examples_used": len(train)}
    collate = SFTCollator(tokenizer.pad_token_id, cfg.max_length if getattr(cfg, "pad_to_max", False) else None)
    return Pipeline(train, collate, evaluate, primary_metric, chance, num_eval_examples=num_eval_examples,
                    extras=extras, eval_sets=eval_sets)


def ensure_pad_token(cfg, tokenizer) -> None:
    if tokenizer is None:
        raise PeftlabError(f"model '{cfg.model}' has no tokenizer", fix="use a causal LM with a tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def _is_main() -> bool:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0


# --------------------------------------------------------------------------- generation


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

    from peftlab.tasks.generation import stop_token_ids

    device = device or next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_token_ids(tokenizer)
    config = GenerationConfig(max_new_tokens=int(max_new_tokens), do_sample=False, num_beams=1,
                              eos_token_id=stops, pad_token_id=pad)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # similar lengths share a batch
    texts: dict[int, str] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            n = len(prompts[i])
            ids[row, width - n:] = torch.as_tensor(prompts[i])
            mask[row, width - n:] = 1
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
                         score: Callable[[list[str]], tuple[list[dict], dict[str, float]]], *,
                         stop_when: StopWhen | Sequence[StopWhen] | None = None) -> Callable:
    """``evaluate(model, accelerator, tag) -> Evaluation`` scoring greedy generations from ``prompts``;
    ``score(texts)`` (one per prompt, in order) returns the records to log and the metrics, and optionally a
    third item: notes on this evaluation (e.g. why a metric is missing), kept in result.json's
    ``metric_notes[tag]``."""
    from peftlab.tasks.generation import generation_file, write_generations
    from peftlab.tasks.prepare import Evaluation

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
