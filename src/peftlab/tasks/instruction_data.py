"""Instruction data: GSM8K, Alpaca and JSON/JSONL instruction files, as ``instruction``/``input``/``output`` records.

``gsm8k``: ``<root>/gsm8k/{train,test}.jsonl`` (the final answer follows ``####``, kept as ``gold``; calculator
annotations ``<<16-3-4=9>>`` removed from the targets). ``alpaca``: ``<root>/alpaca/alpaca_data.json`` (or
``alpaca_data_1k.json``), a held-out 10% with the fixed seed :data:`SPLIT_SEED`, so every run seed scores on
the same records. ``json``: ``--train-file`` [``--eval-file``] with ``--instruction-fields``. With no local copy
the Hub is used unless offline.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from peftlab.errors import PeftlabError
from peftlab.tasks.data_files import from_hub, locate_data_file
from peftlab.tasks.json_files import JsonRecord, read_json_records, text_fields
from peftlab.tasks.table import Task

FORMAT_VERSION = "1"  # bump when prompt formatting or truncation changes: token caches key on it
INSTRUCTION_FILE_FIX = "a JSON list of records, or one JSON object per line (JSONL)"
GSM8K_FIX = "use the published GSM8K files unchanged"
SPLIT_SEED = 0  # held-out split of alpaca/json: the same records whatever the run's --seed
HELD_OUT_FRACTION = 0.1
HUB = {"gsm8k": ("openai/gsm8k", "main"), "alpaca": ("tatsu-lab/alpaca", None)}
LOCAL = {
    ("gsm8k", "train"): ("gsm8k/train.jsonl",),
    ("gsm8k", "test"): ("gsm8k/test.jsonl",),
    ("alpaca", "train"): ("alpaca/alpaca_data.json", "alpaca/alpaca_data_1k.json"),
}
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


def parse_record(obj: Any, fields: Fields, where: str) -> dict[str, str]:
    return text_fields(obj, where, {"instruction": fields.prompt, "input": fields.input, "output": fields.response},
                       required=("output",), present=("instruction",), fix=f"each record holds the text fields '{fields.prompt}' "
                       f"and '{fields.response}' (name others with --instruction-fields prompt,input,response)")


def read_records(path: str | os.PathLike, fields: Fields = Fields()) -> list[dict[str, str]]:
    """Records ``{"instruction", "input", "output"}`` of a JSON list or JSONL file; a malformed file or
    record raises :class:`PeftlabError` naming the file and line (JSONL) or record number (JSON list)."""
    path = Path(path)
    if not path.is_file():
        raise PeftlabError(f"instruction file not found: {path}", fix="check --train-file / --eval-file")
    records = [parse_record(r.value, fields, r.where) for r in read_json_records(path, fix=INSTRUCTION_FILE_FIX)]
    if not records:
        raise PeftlabError("file holds no records", where=str(path), fix=INSTRUCTION_FILE_FIX)
    return records


def make_dataset(records: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(records)


def _gsm8k_records(rows: list[JsonRecord]) -> list[dict[str, str]]:
    from peftlab.tasks.math_answers import extract_answer

    out = []
    for row in rows:
        record = parse_record(row.value, Fields("question", None, "answer"), row.where)
        gold = extract_answer(record["output"]) if "####" in record["output"] else None  # the number after ####
        if gold is None:
            raise PeftlabError("GSM8K answer has no '#### <number>' final answer", where=row.where, fix=GSM8K_FIX)
        record["output"] = _CALCULATOR.sub("", record["output"])
        record["gold"] = gold
        out.append(record)
    return out


def local_file(task: str, split: str, data_dir) -> tuple[Path | None, list[Path]]:
    return locate_data_file(data_dir, LOCAL[(task, split)])


def _hub_rows(task: str, split: str) -> list[dict]:
    import datasets

    name, config = HUB[task]
    return [dict(r) for r in datasets.load_dataset(name, config, split=split)]


def load_raw(spec: Task, split: str, data_dir=None):
    """One split of ``gsm8k`` (train/test) or ``alpaca`` (train) as a ``Dataset`` of ``instruction``, ``input``,
    ``output`` (GSM8K also ``gold``, the canonical final answer), its records read as its row's ``record_format``."""
    task, gsm8k = spec.name, spec.record_format == "gsm8k"
    fix = GSM8K_FIX if gsm8k else INSTRUCTION_FILE_FIX
    path, tried = local_file(task, split, data_dir)
    if path is not None:
        rows = read_json_records(path, fix=fix)
        if not rows:
            raise PeftlabError("file holds no records", where=str(path), fix=fix)
    else:
        found = from_hub(lambda: _hub_rows(task, split), HUB[task][0], what=f"{task} {split}", tried=tried,
                         holding=LOCAL[(task, split)][0])
        rows = [JsonRecord(f"{HUB[task][0]}, record {i}", r) for i, r in enumerate(found, 1)]
    return make_dataset(_gsm8k_records(rows) if gsm8k else [parse_record(r.value, Fields(), r.where) for r in rows])


def held_out_split(ds):
    """(train, held-out): a fixed-seed 90/10 split (at least one record on each side)."""
    if len(ds) < 2:
        raise PeftlabError(f"need at least 2 records to hold some out for evaluation, got {len(ds)}",
                           fix="add records, or pass --eval-file")
    n_eval = min(len(ds) - 1, max(1, round(HELD_OUT_FRACTION * len(ds))))
    split = ds.train_test_split(test_size=n_eval, shuffle=True, seed=SPLIT_SEED)
    return split["train"], split["test"]


def load_instruction_data(cfg, task: Task):
    """(train, eval) raw datasets of ``task`` (the run's, resolved from ``cfg.task``), before subsetting, from where
    its row says (``Task.instruction_source``)."""
    if task.instruction_source == "test_split":
        return load_raw(task, "train", cfg.data_dir), load_raw(task, "test", cfg.data_dir)
    if task.instruction_source == "held_out":
        return held_out_split(load_raw(task, "train", cfg.data_dir))
    if task.instruction_source == "files":
        if not cfg.train_file:
            raise PeftlabError("--task json needs --train-file", fix="pass a JSON list or JSONL of instruction records")
        fields = parse_fields(cfg.instruction_fields)
        train = make_dataset(read_records(cfg.train_file, fields))
        if cfg.eval_file:
            return train, make_dataset(read_records(cfg.eval_file, fields))
        return held_out_split(train)
    raise PeftlabError(f"task '{task.name}' is not an instruction task", fix="use gsm8k, alpaca or json")
