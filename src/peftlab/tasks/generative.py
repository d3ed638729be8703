"""What the generation-scored tasks share: their data files (found under the data roots), LLM-Adapters' JSON
records and the pipeline of a family of test sets (:func:`family_pipeline`: commonsense, math). The prompt-masked
training set is :func:`peftlab.tasks.instructions.training_pipeline`'s (so generation starts from the training
prompt); generation and its evaluation are :mod:`peftlab.tasks.generation`'s.
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
    math_data.json's): not trained on."""
    from peftlab.tasks.json_files import read_json_records, text_fields

    rows = read_json_records(path, fix=LLM_ADAPTERS_FIX)
    if not rows:
        raise PeftlabError("expected a non-empty JSON list of records", where=str(path), fix=LLM_ADAPTERS_FIX)
    return [text_fields(row.value, row.where, {k: k for k in ("instruction", "input", "output", "answer")},
                        required=("instruction", "answer"), fix=LLM_ADAPTERS_FIX) for row in rows]


def _training_set(cfg, train_files: dict[str, tuple[str, str]], files: dict):
    """(the records with a response, joined in order; how many had none) of LLM-Adapters training files
    (files key -> (path under a data root, what it is for messages)); every file read goes into ``files``."""
    from datasets import Dataset

    kept, skipped = [], 0
    for key, (relative, what) in train_files.items():
        path = find_data_file(cfg.data_dir, relative, what)
        files[key] = str(path)
        records = read_llm_adapters_json(path)
        with_output = [{k: r[k] for k in ("instruction", "input", "output")} for r in records if r["output"].strip()]
        skipped += len(records) - len(with_output)
        kept += with_output
    return Dataset.from_list(kept), skipped


def _test_sets(cfg, task, gold_problem: Callable[[str], Callable[[str], str | None]], files: dict) -> dict:
    """``--eval-sets`` (default: all of ``task``'s) ``<data>/<family>/<name>/test.json`` as datasets (instruction,
    input, answer), each cut to ``--max-eval-samples``; a gold answer ``gold_problem(name)`` objects to (it says
    what is wrong) is a one-line error naming the file and record."""
    from datasets import Dataset

    from peftlab.tasks.data_files import subset

    tests = {}
    for name in cfg.eval_sets.split(",") if cfg.eval_sets else task.eval_set_names:
        path = find_data_file(cfg.data_dir, f"{task.kind}/{name}/test.json", f"{task.kind} test set '{name}'")
        files[f"test/{name}"] = str(path)
        records, check = read_llm_adapters_json(path), gold_problem(name)
        for number, record in enumerate(records, 1):
            problem = check(record["answer"])
            if problem:
                raise PeftlabError(f"gold answer '{record['answer']}' is not {problem}",
                                   where=f"{path}, record {number}", fix=LLM_ADAPTERS_FIX)
        # --eval-seed, not --seed: every training seed is scored on the same examples
        tests[name] = subset(Dataset.from_list([{k: r[k] for k in ("instruction", "input", "answer")}
                                                for r in records]), cfg.max_eval_samples, cfg.eval_seed)
    return tests


def family_pipeline(cfg, tokenizer, task, train_files: dict[str, tuple[str, str]], *, gold_problem, record, key,
                    counts: dict, extras: Callable[[int, dict], dict], chance=lambda tests: 0.0, stop_rule=None):
    """A generation-scored family's Pipeline (commonsense, math): LLM-Adapters' training files joined, the test sets
    of :func:`_test_sets`, every item's greedy answer made a record by ``record(set, row, text)``. Per metric of
    ``counts`` (name -> whether a record counts; the first is primary): ``<key(set)>_<name>``, the share of the set's
    records that count, and ``<name>``, its mean over the sets. ``stop_rule(set)`` ends a row's generation early;
    ``extras(training records, tests)`` and ``chance(tests)`` are the family's."""
    from peftlab.tasks.generation import generation_evaluator
    from peftlab.tasks.instructions import encode_prompt, ensure_pad_token, training_pipeline
    from peftlab.tasks.prepare import examples_digest

    ensure_pad_token(cfg, tokenizer)
    files: dict[str, str] = {}
    train_raw, skipped = _training_set(cfg, train_files, files)
    tests = _test_sets(cfg, task, gold_problem, files)
    items = [(name, row) for name, ds in tests.items() for row in ds]  # one flat list: batches mix the sets

    def score(texts: list[str]):
        records = [record(name, row, text) for (name, row), text in zip(items, texts)]
        metrics: dict[str, float] = {}
        for metric, counted in counts.items():
            for name in tests:
                rows = [r for r in records if r["set"] == name]
                metrics[f"{key(name)}_{metric}"] = sum(map(counted, rows)) / max(1, len(rows))
            metrics[metric] = sum(metrics[f"{key(n)}_{metric}"] for n in tests) / len(tests)
        return records, metrics

    prompts = [encode_prompt(tokenizer, row["instruction"], row["input"]) for _, row in items]
    stop_when = [stop_rule(name) for name, _ in items] if stop_rule else None
    evaluate = generation_evaluator(cfg, tokenizer, prompts, score, stop_when=stop_when)
    described = {**extras(len(train_raw), tests), "data_files": files, "train_records_without_output": skipped,
                 "eval_sets": list(tests), "eval_examples": {name: len(ds) for name, ds in tests.items()},
                 "eval_examples_digest": examples_digest(tests)}
    return training_pipeline(cfg, tokenizer, train_raw, evaluate=evaluate, primary_metric=next(iter(counts)),
                             chance=chance(tests), num_eval_examples=len(items), extras=described, eval_sets=tests)
