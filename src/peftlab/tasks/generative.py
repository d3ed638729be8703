"""What the generation-scored tasks share: their data files (found under the data roots,
:func:`peftlab.tasks.data_files.candidate_roots`) and LLM-Adapters' JSON records. The prompt-masked training
set is :func:`peftlab.tasks.instructions.training_pipeline`'s (so generation starts from the training prompt);
generation and its evaluation are :mod:`peftlab.tasks.generation`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from peftlab.errors import PeftlabError

LLM_ADAPTERS_FIX = "use the published LLM-Adapters files unchanged"


# --------------------------------------------------------------------------- data files


def find_data_file(data_dir, relative: str, what: str) -> Path:
    """``<root>/<relative>`` in the first data root that has it; else one line listing every path tried."""
    from peftlab.tasks.data_files import locate_data_file

    path, tried = locate_data_file(data_dir, (relative,))
    if path is None:
        raise PeftlabError(f"{what} not found", where="looked for " + ", ".join(map(str, tried)),
                           fix="pass --data-dir (or set PEFTLAB_DATA_DIR) to the shared data folder holding "
                           f"{relative}")
    return path


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
            value = "" if obj.get(key) is None else obj[key]
            if not isinstance(value, str):
                raise PeftlabError(f"field '{key}' is a JSON {type(value).__name__}, expected a string", where=where)
            if key in required and not value.strip():
                raise PeftlabError(f"field '{key}' is missing or empty", where=where, fix=LLM_ADAPTERS_FIX)
            record[key] = value
        records.append(record)
    return records


def training_set(cfg, sources: dict[str, tuple[str, str]]):
    """(the records with a response, joined in order; how many had none; files key -> the file read) of
    LLM-Adapters training files, ``sources``: files key -> (path under a data root, what it is for messages)."""
    from datasets import Dataset, concatenate_datasets

    files, parts, skipped = {}, [], 0
    for key, (relative, what) in sources.items():
        path = find_data_file(cfg.data_dir, relative, what)
        files[key] = str(path)
        records = read_llm_adapters_json(path)
        kept = [{k: r[k] for k in ("instruction", "input", "output")} for r in records if r["output"].strip()]
        skipped += len(records) - len(kept)
        parts.append(Dataset.from_list(kept))
    return concatenate_datasets(parts) if len(parts) > 1 else parts[0], skipped, files


def test_set(path: Path, records: list[dict[str, str]], gold_problem: Callable[[str], str | None]):
    """One scored test set as a dataset (instruction, input, answer); a gold answer ``gold_problem`` objects to
    (it returns what is wrong, else None) is a one-line error naming the file and record."""
    for number, record in enumerate(records, 1):
        problem = gold_problem(record["answer"])
        if problem:
            raise PeftlabError(f"gold answer '{record['answer']}' is not {problem}", where=f"{path}, record {number}",
                               fix="use the published LLM-Adapters files")
    from datasets import Dataset

    return Dataset.from_list([{k: r[k] for k in ("instruction", "input", "answer")} for r in records])


def prompt_items(tests: dict, tokenizer) -> tuple[list[tuple[str, dict]], list[list[int]]]:
    """(set, row) for every test item over all sets, and its encoded prompt: one flat list, so generation
    batches mix sets of similar prompt lengths."""
    from peftlab.tasks.instructions import encode_prompt

    items = [(name, row) for name, ds in tests.items() for row in ds]
    return items, [encode_prompt(tokenizer, row["instruction"], row["input"]) for _, row in items]


def read_test_sets(cfg, task, gold_problem: Callable[[str], Callable[[str], str | None]], files: dict) -> dict:
    """``--eval-sets`` (default: all of ``task``'s) ``<data>/<family>/<name>/test.json``, each gold answer checked by
    ``gold_problem(name)``, each cut to ``--max-eval-samples``; every file read goes into ``files`` as
    ``test/<name>``."""
    from peftlab.tasks.data_files import subset

    family = task.kind  # its data folder: commonsense/, math/
    tests = {}
    for name in tuple(cfg.eval_sets.split(",")) if cfg.eval_sets else task.eval_set_names:
        path = find_data_file(cfg.data_dir, f"{family}/{name}/test.json", f"{family} test set '{name}'")
        files[f"test/{name}"] = str(path)
        # --eval-seed, not --seed: every training seed is scored on the same examples
        tests[name] = subset(test_set(path, read_llm_adapters_json(path), gold_problem(name)), cfg.max_eval_samples,
                             cfg.eval_seed)
    return tests


def set_scorer(tests: dict, items: list, record: Callable, key: Callable[[str], str], fields: dict) -> Callable:
    """``score(texts)`` of a family's generated texts: ``record(set, row, text)`` of each (a dict with ``set``), and
    per metric of ``fields`` (name -> whether a record counts) ``<key(set)>_<name>``, the share of the set's records
    that count, and ``<name>``, its mean over the sets."""

    def score(texts: list[str]):
        records = [record(name, row, text) for (name, row), text in zip(items, texts)]
        metrics: dict[str, float] = {}
        for metric, counts in fields.items():
            for name in tests:
                rows = [r for r in records if r["set"] == name]
                metrics[f"{key(name)}_{metric}"] = sum(map(counts, rows)) / max(1, len(rows))
            metrics[metric] = sum(metrics[f"{key(n)}_{metric}"] for n in tests) / len(tests)
        return records, metrics

    return score


def test_set_extras(tests: dict) -> dict:
    """result.json's description of the test sets scored: their names, sizes and the examples' digest."""
    from peftlab.tasks.prepare import examples_digest

    return {"eval_sets": list(tests), "eval_examples": {name: len(ds) for name, ds in tests.items()},
            "eval_examples_digest": examples_digest(tests)}


# --------------------------------------------------------------------------- training set
