"""What the generation-scored task families share (``commonsense``, ``math``, ``e2e``): locating and reading their
data files and the prompt-masked training set. Generation and its evaluation are
:mod:`peftlab.tasks.generation`'s (:func:`generate_greedy`, :func:`generation_evaluator`, importable from here).

* **Data.** Files are found under the data roots every task uses (``--data-dir``, ``$PEFTLAB_DATA_DIR``,
  ``./data``, ``../shared/data``; :func:`peftlab.tasks.data_files.candidate_roots`); a missing file is a
  :class:`~peftlab.errors.PeftlabError` naming every path tried. LLM-Adapters' JSON files (a list of
  ``{"instruction", "input", "output", "answer"}``) are read by :func:`read_llm_adapters_json` (datasets'
  ``json`` builder, :func:`peftlab.tasks.json_files.read_json_records`), which names the file and record of a
  malformed one.
* **Training.** Prompt and response are formatted and tokenised exactly as for the instruction tasks
  (:func:`peftlab.tasks.instructions.tokenize_instructions`: the chat template when the tokenizer has one, the
  loss on the response only, the prompt cut first), so generation at evaluation time starts from the same
  prompt tokens; batches are right-padded by :class:`peftlab.tasks.instructions.SFTCollator`, or with
  ``--packing`` packed into one unpadded row (:class:`peftlab.tasks.batching.PackingCollator`).
* **Evaluation.** :func:`peftlab.tasks.generation.generation_evaluator`: greedy ``model.generate``, optionally
  with a per-row stopping rule on the text so far (commonsense stops at the first answer word, after which
  nothing can change the extracted answer), the family's ``score(texts) -> (records, metrics)``, and every
  generation logged in ``<output_dir>/generations_<tag>.jsonl`` (``before``, ``epoch<N>``, ``evaluate``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from peftlab.errors import PeftlabError

LLM_ADAPTERS_FIX = "use the published LLM-Adapters files unchanged"


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
    from peftlab.tasks.json_files import read_json_records

    fields = ("instruction", "input", "output", "answer")
    rows = read_json_records(path, fields, fix=LLM_ADAPTERS_FIX)
    if not rows:
        raise PeftlabError("expected a non-empty JSON list of records", where=str(path), fix=LLM_ADAPTERS_FIX)
    required = ("instruction", "answer")
    records = []
    for row in rows:
        obj, where = row.value, row.where
        if not isinstance(obj, dict):
            raise PeftlabError(f"record is a JSON {type(obj).__name__}, expected an object", where=where)
        record = {}
        for key in fields:
            value = obj.get(key, "")
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise PeftlabError(f"field '{key}' is a JSON {type(value).__name__}, expected a string", where=where)
            if key in required and not value.strip():
                raise PeftlabError(f"field '{key}' is missing or empty", where=where, fix=LLM_ADAPTERS_FIX)
            record[key] = value
        records.append(record)
    return records


def training_records(records: list[dict[str, str]]) -> tuple[list[dict[str, str]], int]:
    """(``instruction``/``input``/``output`` of the records with a response to train on, how many had none)."""
    kept = [{k: r[k] for k in ("instruction", "input", "output")} for r in records if r["output"].strip()]
    return kept, len(records) - len(kept)


def records_dataset(records: list[dict]):
    """A ``datasets.Dataset`` of ``records`` (the token cache keys on its rows' content)."""
    from datasets import Dataset

    return Dataset.from_list(records)


def test_set(path: Path, records: list[dict[str, str]], gold_problem: Callable[[str], str | None]):
    """One scored test set as a dataset (instruction, input, answer); a gold answer ``gold_problem`` objects to
    (it returns what is wrong, else None) is a one-line error naming the file and record."""
    for number, record in enumerate(records, 1):
        problem = gold_problem(record["answer"])
        if problem:
            raise PeftlabError(f"gold answer '{record['answer']}' is not {problem}", where=f"{path}, record {number}",
                               fix="use the published LLM-Adapters files")
    return records_dataset([{k: r[k] for k in ("instruction", "input", "answer")} for r in records])


def prompt_items(tests: dict, tokenizer) -> tuple[list[tuple[str, dict]], list[list[int]]]:
    """(set, row) for every test item over all sets, and its encoded prompt: one flat list, so generation
    batches mix sets of similar prompt lengths."""
    from peftlab.tasks.instructions import encode_prompt

    items = [(name, row) for name, ds in tests.items() for row in ds]
    return items, [encode_prompt(tokenizer, row["instruction"], row["input"]) for _, row in items]


def subset_per_set(datasets_by_set: dict, n: int | None, seed: int) -> dict:
    """``--max-eval-samples`` applied to each set (drawn with ``--eval-seed``: the same for every training seed)."""
    from peftlab.tasks.data_files import subset

    return {name: subset(ds, n, seed) for name, ds in datasets_by_set.items()}


def read_test_sets(cfg, family: str, names, gold_problem: Callable[[str], Callable[[str], str | None]],
                   files: dict[str, str]) -> dict:
    """The named test sets ``<data>/<family>/<name>/test.json`` (each gold answer checked by ``gold_problem(name)``),
    each cut to ``--max-eval-samples``; every file read is added to ``files`` as ``test/<name>``."""
    tests = {}
    for name in names:
        path = find_data_file(cfg.data_dir, f"{family}/{name}/test.json", f"{family} test set '{name}'")
        files[f"test/{name}"] = str(path)
        tests[name] = test_set(path, read_llm_adapters_json(path), gold_problem(name))
    return subset_per_set(tests, cfg.max_eval_samples, cfg.eval_seed)


def test_set_extras(tests: dict) -> dict:
    """result.json's description of the test sets scored: their names, sizes and the examples' digest."""
    from peftlab.tasks.prepare import examples_digest

    return {"eval_sets": list(tests), "eval_examples": {name: len(ds) for name, ds in tests.items()},
            "eval_examples_digest": examples_digest(tests)}


# --------------------------------------------------------------------------- training set


def training_pipeline(cfg, tokenizer, train_raw, *, evaluate: Callable, primary_metric: str, chance: float,
                      num_eval_examples: int, extras: dict, eval_sets: dict):
    """The :class:`~peftlab.tasks.prepare.Pipeline`: ``train_raw`` (``instruction``/``input``/``output``) subset
    by ``--max-train-samples`` (seeded by ``--seed``), tokenised with the loss on the response only."""
    from peftlab.tasks.data_files import subset
    from peftlab.tasks.instructions import tokenize_instructions, training_collator
    from peftlab.tasks.prepare import Pipeline, train_examples_digest

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
    collate = training_collator(cfg, tokenizer)  # right-padded, or one unpadded row per batch (--packing)
    return Pipeline(train, collate, evaluate, primary_metric, chance, num_eval_examples=num_eval_examples,
                    extras=extras, eval_sets=eval_sets,
                    # the drawn records, before tokenisation drops any (train_examples_used counts those kept)
                    train_examples_digest=train_examples_digest(train_raw))


def ensure_pad_token(cfg, tokenizer) -> None:
    if tokenizer is None:
        raise PeftlabError(f"model '{cfg.model}' has no tokenizer", fix="use a causal LM with a tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def _is_main() -> bool:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0
