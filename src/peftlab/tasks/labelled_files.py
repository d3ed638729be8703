"""The user's labelled data as read: CSV, TSV, JSON, JSONL, Parquet files, save_to_disk folders and Hub datasets.

CSV/TSV are read with pandas (TSV: tab-separated with quoting off, as GLUE's; cells as written,
``keep_default_na=False``: the text "NA" stays text), Parquet with pyarrow, JSON/JSONL with :mod:`json`. A
``--dataset`` folder goes through ``load_from_disk``; any other ``--dataset`` is a Hub dataset, online only
(offline it is an error, never a silent fall-back). Every source becomes a :class:`RawTable` whose
``locate(row)`` names a row as a user finds it (``file:line``, ``file, record n``, ``file, row n``); where pandas
fails, the stdlib's reader names the line at fault. :func:`data_digest` hashes the bytes a run reads (the run key
carries it).
"""

from __future__ import annotations

import csv
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from peftlab.errors import PeftlabError
from peftlab.tasks.data_files import csv_rows

FILE_KINDS = {".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
FORMATS = "CSV, TSV, JSON, JSONL or Parquet"
_READ_FIX = "fix the file (or export it again from its source)"


@dataclass(frozen=True)
class RawTable:
    """One labelled source as read: ``columns`` (name -> values, in row order), ``class_names`` (a column the
    source declares as datasets ``ClassLabel``: its names by id) and where each row is."""

    name: str  # for messages: the file, or "folder [split]"
    columns: dict[str, list]
    locate: Callable[[int], str]  # 0-based row -> "file:line" / "file, record n" / "file, row n"
    class_names: dict[str, tuple[str, ...]]

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0


# --------------------------------------------------------------------------- checks before reading


def check_file(value: str, flag: str) -> Path:
    """``--train-file`` / ``--eval-file``: an existing, non-empty file of a known format (one line otherwise)."""
    path = Path(value).expanduser()
    if path.is_dir():
        hint = (f"pass it as --dataset {value}" if _is_saved_dataset(path) else
                f"pass one {FORMATS} file (a folder written by save_to_disk goes to --dataset)")
        raise PeftlabError(f"{flag} {value} is a folder, not a file", fix=hint)
    if not path.is_file():
        raise PeftlabError(f"{flag} {value} not found", fix=f"pass an existing {FORMATS} file")
    if path.suffix.lower() not in FILE_KINDS:
        raise PeftlabError(f"{flag} {value}: unknown file type '{path.suffix}'",
                           fix="use a .csv, .tsv, .json, .jsonl or .parquet file")
    if path.stat().st_size == 0:
        raise PeftlabError(f"{flag} {value} is empty (0 bytes)", fix="pass a file with a header and data rows")
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise PeftlabError(f"{flag} {value} cannot be read: {err.strerror}",
                           fix="check the file's permissions") from None
    return path


def _is_saved_dataset(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json"))


def is_dataset_folder(value: str) -> bool:
    """``--dataset`` names a local folder (read with load_from_disk) rather than a Hub dataset."""
    return Path(value).expanduser().is_dir()


# --------------------------------------------------------------------------- digests


@functools.lru_cache(maxsize=256)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:  # size, mtime: a changed file is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    stat = path.stat()
    return _file_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def data_digest(parts: list[tuple[str, Path]]) -> str:
    """SHA-256 (64 hex) of the bytes a run's data comes from: per role (train, eval), a file's bytes or every
    file of a folder (sorted relative paths and bytes). Content only: a moved copy hashes the same."""
    h = hashlib.sha256()
    for role, path in parts:
        h.update(f"{role}\n".encode())
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            if path.is_dir():
                h.update(f"{file.relative_to(path).as_posix()}\n".encode())
            h.update(file_sha256(file).encode())
    return h.hexdigest()


# --------------------------------------------------------------------------- files


def read_file(path: Path) -> RawTable:
    """A labelled file as a :class:`RawTable` (one-line errors that name the line for CSV/TSV/JSON/JSONL)."""
    kind = FILE_KINDS[path.suffix.lower()]
    if kind == "json":
        return _read_json(path)
    if kind == "parquet":
        return _read_parquet(path)
    import pandas as pd

    # As datasets' csv builder reads it: cells as written (the text "NA" stays text), TSV with quoting off.
    options = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if kind == "tsv" else {}
    try:
        frame = pd.read_csv(path, keep_default_na=False, **options)
    except Exception as err:  # noqa: BLE001 - the parser's complaint, at its line where the stdlib finds one
        raise _csv_problem(path, kind) or PeftlabError(f"cannot read {kind.upper()} file: {_cause_line(err)}",
                                                       where=str(path), fix=_READ_FIX) from None
    if frame.empty:
        raise _csv_problem(path, kind) or PeftlabError("file has no data rows", where=str(path),
                                                       fix="add rows below the header")
    columns = {str(name): frame[name].tolist() for name in frame.columns}  # plain Python values
    return RawTable(str(path), columns, _line_locator(path, kind, len(frame)), {})


def _read_parquet(path: Path) -> RawTable:
    """A Parquet file; a column datasets wrote as ``ClassLabel`` keeps its class names (the file's metadata)."""
    import pyarrow.parquet as pq
    from datasets import Dataset

    try:
        ds = Dataset(pq.read_table(path))
    except Exception as err:  # noqa: BLE001 - any reader complaint is one line
        raise PeftlabError(f"cannot read Parquet file: {_cause_line(err)}", where=str(path), fix=_READ_FIX) from None
    return _dataset_table(str(path), ds)


def _cause_line(err: BaseException) -> str:
    """The first line of the innermost cause (datasets wraps the parser's error in its own)."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__


def _csv_problem(path: Path, kind: str) -> PeftlabError | None:
    """Why the csv builder failed, at its line (None when the stdlib reader sees nothing wrong)."""
    header = None
    data_rows = 0
    try:
        for line, row in csv_rows(path, kind):
            if header is None:
                header = row
            elif len(row) > len(header):
                sep = "tab-separated" if kind == "tsv" else "comma-separated"
                return PeftlabError(f"row has {len(row)} {sep} fields, the header has {len(header)}",
                                    where=f"{path}:{line}", fix="quote fields that contain the separator, "
                                    "or remove the extra fields" if kind == "csv" else "remove the extra tabs")
            else:
                data_rows += 1
    except PeftlabError as err:
        return err
    if header is None or data_rows == 0:
        return PeftlabError("file has a header but no data rows" if header else "file has no header",
                            where=str(path), fix="add a header line and data rows")
    return None


def _line_locator(path: Path, kind: str, rows: int) -> Callable[[int], str]:
    """Row -> ``file:line`` of a CSV/TSV, its records' lines read by hand only when an error needs one."""

    @functools.cache
    def starts() -> list[int] | None:
        try:
            found = [line for line, _ in csv_rows(path, kind)][1:]  # the header is not a row
        except PeftlabError:
            return None
        return found if len(found) == rows else None  # the stdlib reader disagrees: say the row instead

    return lambda row: f"{path}:{starts()[row]}" if starts() else f"{path}, row {row + 1}"


def _read_json(path: Path) -> RawTable:
    from peftlab.tasks.json_files import read_json_records

    records = read_json_records(path, fix="fix the JSON (one object per line for JSONL, or a list of objects)")
    if not records:
        raise PeftlabError("file has no records", where=str(path), fix="add one JSON object per labelled example")
    names: dict[str, None] = {}
    for record in records:
        if not isinstance(record.value, dict):
            raise PeftlabError(f"record is a JSON {type(record.value).__name__}, not an object", where=record.where,
                               fix='write each example as an object, e.g. {"text": "...", "label": "..."}')
        names.update(dict.fromkeys(record.value))
    columns = {name: [record.value.get(name) for record in records] for name in names}
    wheres = [record.where for record in records]
    return RawTable(str(path), columns, wheres.__getitem__, {})


# --------------------------------------------------------------------------- folders and the Hub


def read_dataset(value: str) -> dict[str, RawTable]:
    """``--dataset``: split -> :class:`RawTable`, from a save_to_disk folder (a single Dataset is split
    ``train``) or, online, from the Hub."""
    import datasets

    if is_dataset_folder(value):
        folder = Path(value).expanduser()
        try:
            loaded = datasets.load_from_disk(str(folder), keep_in_memory=True)
        except Exception as err:  # noqa: BLE001 - any loader complaint is one line
            raise PeftlabError(f"--dataset {value} is a folder, but not one written by save_to_disk: "
                               f"{_cause_line(err)}", fix="pass a folder written by Dataset.save_to_disk or "
                               "DatasetDict.save_to_disk, or a file as --train-file") from None
    else:
        from peftlab.tasks.data_files import hub_offline

        if Path(value).expanduser().is_file():
            raise PeftlabError(f"--dataset {value} is a file", fix=f"pass it as --train-file {value}")
        if hub_offline():
            raise PeftlabError(f"--dataset {value}: no such folder, and the Hub is not tried offline "
                               "(HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set)",
                               fix="pass a folder written by save_to_disk, a --train-file, or run online")
        name, _, config = value.partition(":")
        try:  # online only; never exercised by the tests
            loaded = datasets.load_dataset(name, config or None)
        except Exception as err:  # noqa: BLE001 - a missing dataset, a network failure: one line
            raise PeftlabError(f"cannot load Hub dataset '{value}': {_cause_line(err)}",
                               fix="check the name (NAME or NAME:CONFIG, as datasets.load_dataset takes it)") from None
    splits = {"train": loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)
    return {split: _dataset_table(f"{value} [{split}]", ds) for split, ds in splits.items()}


def _dataset_table(name: str, ds) -> RawTable:
    if len(ds) == 0:
        raise PeftlabError("split has no rows", where=name, fix="pass a dataset whose splits hold examples")
    columns = ds.to_dict()
    return RawTable(name, columns, lambda i: f"{name}, row {i + 1}", _class_names(ds))


def _class_names(ds) -> dict[str, tuple[str, ...]]:
    from datasets import ClassLabel

    return {name: tuple(f.names) for name, f in ds.features.items() if isinstance(f, ClassLabel)}


def hub_or_folder_parts(value: str) -> list[tuple[str, Path]]:
    """The digest parts of a ``--dataset``: the folder's files; none for a Hub dataset (it has no local bytes)."""
    return [("dataset", Path(value).expanduser())] if is_dataset_folder(value) else []
