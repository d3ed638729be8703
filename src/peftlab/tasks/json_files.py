"""JSON list and JSONL files (instruction data, LLM-Adapters' sets, MT-Bench), read with datasets' ``json`` builder.

:func:`read_json_records` returns every record with where it is (``file:line`` or ``file, record n``), for the
caller's one-line errors. A file the builder cannot read, or reads with a text field typed otherwise, is re-read
by hand with :mod:`json` to name the line at fault. GLUE's ``glue_subsets`` files (an object of records, which
the builder reads as one row) keep their own reader in :mod:`peftlab.tasks.data_files`.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from peftlab.errors import PeftlabError
from peftlab.io_utils import read_text_utf8

_TEXT_TYPES = ("string", "large_string", "null")  # a text field as datasets types it (null: absent everywhere)


@dataclass(frozen=True)
class JsonRecord:
    """One record of a JSON list or JSONL file and where it is, for the caller's one-line errors."""

    where: str  # "<file>:<line>" (JSONL) or "<file>, record <n>" (JSON list)
    value: Any  # the record as parsed: an object is a dict (a field it lacks is absent or None)


def read_json_records(path: Path, text_fields: Sequence[str] = (), *, fix: str) -> list[JsonRecord]:
    """The records of a JSON list or JSONL file, in order, each with where it is (an empty list if none).

    Where datasets' ``json`` builder cannot read the file (invalid JSON or UTF-8, a record that is not an object,
    a field whose type changes) or types one of ``text_fields`` as anything but text (pyarrow reads "2020-01-01"
    as a timestamp), it is re-read with :mod:`json`: invalid JSON raises a :class:`PeftlabError` naming the line
    (``fix`` says what to do), anything else is returned as written, for the caller to name the record at fault.
    """
    path = Path(path)
    loaded = _load_json_with_datasets(path, tuple(text_fields))
    return loaded if loaded is not None else _scan_json_records(path, fix)


def _load_json_with_datasets(path: Path, text_fields: tuple[str, ...]) -> list[JsonRecord] | None:
    """:func:`read_json_records` through ``datasets.load_dataset("json")``; None when the by-hand pass must say
    what is wrong (or read what pyarrow would mistype)."""
    from datasets.packaged_modules.json.json import JsonConfig

    # Where this datasets version has them: a field of mixed types is an error (not silently re-encoded as
    # JSON, which turns the string "true" into True), and records are never read as agent traces.
    known = {f.name for f in dataclasses.fields(JsonConfig)}
    options = {k: v for k, v in (("on_mixed_types", None), ("parse_agent_traces", False)) if k in known}
    try:
        ds = load_builder("json", path, options)
    except Exception:  # noqa: BLE001 - whatever the builder's complaint, the by-hand pass names the line
        return None
    columns = ds.features
    if text_fields and not any(name in columns for name in text_fields):
        return None  # e.g. a list of lists, read as one "text" column: the by-hand pass says "not an object"
    if any(name in columns and getattr(columns[name], "dtype", None) not in _TEXT_TYPES for name in text_fields):
        return None
    try:  # a value the builder read but cannot decode (e.g. a non-UTF-8 byte inside a string) fails only here
        rows = ds.to_list()
    except Exception:  # noqa: BLE001 - the by-hand pass names the line and what is wrong with it
        return None
    raw = path.read_bytes()
    if raw.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"["):  # one JSON list
        return [JsonRecord(f"{path}, record {i}", row) for i, row in enumerate(rows, 1)]
    lines = [number for number, line in enumerate(raw.split(b"\n"), 1) if line.strip()]
    if len(lines) != len(rows):
        return None  # not one record per line (e.g. one object over several lines): let the by-hand pass judge
    return [JsonRecord(f"{path}:{number}", row) for number, row in zip(lines, rows)]


def load_builder(builder: str, path: Path, options: dict):
    """One file through a datasets builder, into memory, quietly; its cache in a private temporary folder under
    peftlab's cache: nothing is written next to the data, nothing stale is reused."""
    import datasets

    from peftlab.models.registry import cache_dir

    root = cache_dir() / "datasets-tables"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp, _datasets_quiet():
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=tmp,
                                     keep_in_memory=True, **options)


@contextmanager
def _datasets_quiet():
    """No progress bar or logged error from datasets while it reads a file: peftlab's own error is one line."""
    import datasets

    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    verbosity = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()


def _scan_json_records(path: Path, fix: str) -> list[JsonRecord]:
    """The by-hand pass of :func:`read_json_records`: :mod:`json` on the whole list, or line by line."""
    text = read_text_utf8(path, fix=fix)
    if text.lstrip().startswith("["):  # one JSON list
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PeftlabError(f"invalid JSON: {err.msg}", where=f"{path}:{err.lineno}:{err.colno}", fix=fix) from None
        return [JsonRecord(f"{path}, record {i}", obj) for i, obj in enumerate(data, 1)]
    records = []
    # Lines end at "\n" only (as for pyarrow): JSON strings may hold a raw U+2028, which str.splitlines splits at.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            records.append(JsonRecord(f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as err:
            raise PeftlabError(f"invalid JSON: {err.msg}", where=f"{path}:{number}:{err.colno}", fix=fix) from None
    return records
