"""JSON list and JSONL files (instruction data, LLM-Adapters' sets, MT-Bench, the user's labelled JSON), read with
:mod:`json`: every record with where it is (``file:line`` or ``file, record n``), for the caller's one-line errors,
and the values exactly as written (pyarrow would read "1969-07-20" as a timestamp). GLUE's ``glue_subsets`` files
(an object of records) keep their own reader in :mod:`peftlab.tasks.data_files`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError
from peftlab.io_utils import read_text_utf8


@dataclass(frozen=True)
class JsonRecord:
    """One record of a JSON list or JSONL file and where it is, for the caller's one-line errors."""

    where: str  # "<file>:<line>" (JSONL) or "<file>, record <n>" (JSON list)
    value: Any  # the record as parsed: an object is a dict


def read_json_records(path: Path, *, fix: str) -> list[JsonRecord]:
    """The records of a JSON list or JSONL file, in order (an empty list if none); invalid JSON or UTF-8 is one
    line naming the line (``fix`` says what to do)."""
    text = read_text_utf8(path, fix=fix)
    if text.lstrip().startswith("["):  # one JSON list
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PeftlabError(f"invalid JSON: {err.msg}", where=f"{path}:{err.lineno}:{err.colno}", fix=fix) from None
        return [JsonRecord(f"{path}, record {i}", obj) for i, obj in enumerate(data, 1)]
    records = []
    # Lines end at "\n" only: JSON strings may hold a raw U+2028, which str.splitlines splits at.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            records.append(JsonRecord(f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise PeftlabError(f"invalid JSON: {err.msg}", where=f"{path}:{number}:{err.colno}", fix=fix) from None
    return records


def text_fields(obj: Any, where: str, names: dict[str, str | None], *, required: tuple[str, ...], fix: str,
                present: tuple[str, ...] = ()) -> dict[str, str]:
    """A record's text fields (``names``: key -> field name, None for none), "" where absent or null; one line at
    ``where`` for a record that is no object, a field that is no string, a ``required`` key missing or blank, or a
    ``present`` key missing (blank allowed: an instruction may be empty where the input says it all)."""
    if not isinstance(obj, dict):
        raise PeftlabError(f"record is a JSON {type(obj).__name__}, expected an object", where=where, fix=fix)
    out = {}
    for key, name in names.items():
        value = obj.get(name) if name else None
        if value is not None and not isinstance(value, str):
            raise PeftlabError(f"field '{name}' is a JSON {type(value).__name__}, expected a string", where=where,
                               fix=fix)
        if (key in required and not (value or "").strip()) or (key in present and value is None):
            present = ", ".join(sorted(str(k) for k, v in obj.items() if v is not None)) or "none"
            problem = f"field '{name}' is empty" if value is not None else f"record has no '{name}' field"
            raise PeftlabError(f"{problem} (fields: {present})", where=where, fix=fix)
        out[key] = value or ""
    return out
