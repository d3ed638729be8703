"""GLUE data: the ``glue_data`` TSV files (or the Hub), subsets, the selection split.

Every split becomes a :class:`datasets.Dataset` of ``text_a``, [``text_b``,] ``label`` (a class id in
``Task.label_names`` order; STS-B's score). Where it comes from, in order:

1. ``<root>/glue/<Task>/`` or ``<root>/<Task>/`` (a glue_data folder), ``<root>`` being ``--data-dir``, else the
   first of ``$PEFTLAB_DATA_DIR``, ``./data``, ``../shared/data`` holding the file (:func:`candidate_roots`);
2. for MNLI, QNLI and QQP, whose full training sets are not offline: ``<root>/glue_subsets/<Task>/``, 10k random
   subsets of GLUE *train* (ZhengxiangShi/PowerfulPromptFT). result.json records ``dataset: glue_subsets`` and
   reports label the column, so a subset is never passed off as the full task; QNLI's real dev set is found
   first (step 1), and MNLI from the subsets has one dev set;
3. the Hub (``nyu-mll/glue``), unless ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` is set;
4. else one line listing every file looked for.

The TSVs are read with quoting off (sentences hold unbalanced ``"``), a UTF-8 BOM dropped (MRPC dev has one),
and a malformed row is reported as ``file:line``.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from peftlab.errors import PeftlabError
from peftlab.io_utils import read_text_utf8
from peftlab.tasks.table import Task, task as registered_task


HUB_DATASET = "nyu-mll/glue"
GLUE_FIX = "repair or re-download the file (GLUE glue_data layout)"  # a GLUE file is not the user's to rewrite

csv.field_size_limit(1 << 24)  # a few GLUE sentences are long; the default limit is 128 KiB


# --------------------------------------------------------------------------- finding the data


def candidate_roots(data_dir: str | os.PathLike | None) -> list[Path]:
    """The data roots to look in, in order: ``data_dir`` alone if given, else ``$PEFTLAB_DATA_DIR``, ``./data``
    and ``../shared/data`` (every task kind finds its local files this way)."""
    if data_dir is not None:
        return [Path(data_dir).expanduser()]
    roots = []
    env = os.environ.get("PEFTLAB_DATA_DIR")
    if env:
        roots.append(Path(env).expanduser())
    roots += [Path.cwd() / "data", Path.cwd().parent / "shared" / "data"]
    return roots


def check_data_dir(data_dir: str | os.PathLike | None) -> None:
    """An explicit ``--data-dir`` that does not exist is an error, not a silent fall-back."""
    if data_dir is not None and not Path(data_dir).expanduser().is_dir():
        raise PeftlabError(
            f"data folder '{data_dir}' does not exist",
            fix="pass --data-dir a folder holding glue/<Task>/train.tsv (or a glue_data folder holding CoLA/ etc.)",
        )


def locate_data_file(data_dir, relatives) -> tuple[Path | None, list[Path]]:
    """The first ``<root>/<relative>`` that is a file, over the data roots (every relative tried in each root in
    turn), and every path tried; an explicit ``data_dir`` that does not exist is an error."""
    check_data_dir(data_dir)
    tried = []
    for root in candidate_roots(data_dir):
        for relative in relatives:
            path = root / relative
            tried.append(path)
            if path.is_file():
                return path, tried
    return None, tried


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def from_hub(load, name: str, *, what: str, tried: list[Path], holding: str):
    """``load()``: ``what`` from the Hub dataset ``name``, there being no local copy at the paths ``tried``; when
    offline or when it fails, one line saying so and where a local copy goes (a data root holding ``holding``)."""
    if hub_offline():
        reason = "not trying the Hub (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set)"
    else:
        try:
            return load()
        except Exception as err:  # noqa: BLE001 - any Hub failure becomes the message below
            reason = f"the Hub ({name}) failed: {first_line(err)}"
    raise PeftlabError(f"no local copy of {what}; {reason}", where="looked for " + ", ".join(map(str, tried)),
                       fix=f"pass --data-dir (or set PEFTLAB_DATA_DIR) to a folder holding {holding}, or run with "
                       "network access (HF_DATASETS_OFFLINE and HF_HUB_OFFLINE unset) to load it from the Hub")


def _named_split(task: Task, split: str) -> str:
    """``validation`` of a task with several dev sets is its first (MNLI: matched)."""
    return task.eval_splits[0] if split == "validation" else split


def _split_file(task: Task, split: str) -> str:
    """glue_data's file of a split: train.tsv; dev.tsv, or dev_<name>.tsv for validation_<name> (MNLI)."""
    split = _named_split(task, split)
    return "train.tsv" if split == "train" else "dev" + split.removeprefix("validation") + ".tsv"


def _check_task_split(task: Task | str, split: str) -> Task:
    """The GLUE task (a name is resolved here, once) and a split it has."""
    task = registered_task(task) if isinstance(task, str) else task
    if not task.glue_dir:
        raise PeftlabError(f"task '{task.name}' is not a GLUE task", fix="load instruction data with peftlab.tasks.instructions")
    allowed = ("train", "validation") + tuple(s for s in task.eval_splits if s != "validation")
    if split not in allowed:
        hint = " (GLUE test splits have no labels)" if split == "test" else ""
        raise PeftlabError(f"unknown split '{split}' for task '{task.name}'{hint}",
                           fix=f"use one of: {', '.join(allowed)}")
    return task


# --------------------------------------------------------------------------- reading the TSVs


def _label(raw: str, task: Task, label_ids: dict[str, int], where: str):
    """One row's label: a class id by name, or STS-B's score (a finite number)."""
    if task.kind != "regression":
        if raw not in label_ids:
            raise PeftlabError(f"unknown label '{raw}'", where=where,
                               fix=f"{task.glue_dir} labels are: {', '.join(task.label_names)}")
        return label_ids[raw]
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise PeftlabError(f"score '{raw}' is not a number", where=where,
                           fix="STS-B scores must be numbers between 0 and 5")
    return value


def csv_rows(path: Path, kind: str, fix: str | None = None):
    """(first line, fields) of every non-blank record of a CSV or TSV (quoting off, as GLUE's), read strictly: a stray
    quote or a non-UTF-8 byte is one line naming its line, with ``fix`` (default: how to repair one's own file)."""
    dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if kind == "tsv" else {"delimiter": ","}
    with open(path, encoding="utf-8-sig", newline="") as handle:  # streamed: a full MNLI is hundreds of MB
        reader = csv.reader(handle, strict=True, **dialect)
        end = 0
        while True:
            start = end + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except UnicodeDecodeError:  # read whole only now, for the line of the first bad byte
                read_text_utf8(path, fix=fix or "save the file as UTF-8")
                raise
            except csv.Error as err:
                raise PeftlabError(f"malformed {kind.upper()} record: {err}", where=f"{path}:{start}",
                                   fix=fix or "close the quote (or quote the field), or remove the line") from None
            end = reader.line_num
            if row:
                yield start, row


def _rows(path: Path, task: Task):
    """(row, line) of every data row of a TSV, each with the expected number of columns (the header's unless the
    layout fixes it)."""
    layout = task.tsv
    expected = layout.columns
    for line, row in csv_rows(path, "tsv", fix=GLUE_FIX):
        if expected is None:  # the header row
            expected = len(row)
            if expected <= max(layout.text_a, layout.text_b or 0, layout.label if layout.label >= 0 else 0):
                raise PeftlabError(f"header has {expected} columns, too few for {task.glue_dir}",
                                   where=f"{path}:{line}", fix="use the GLUE glue_data files unchanged")
            continue
        if len(row) != expected:
            raise PeftlabError(f"row has {len(row)} tab-separated columns, expected {expected}",
                               where=f"{path}:{line}", fix=GLUE_FIX)
        yield row, line


def read_glue_tsv(path: Path, task: Task) -> dict[str, list]:
    """Parse one labelled GLUE TSV into ``{"text_a", ["text_b",] "label"}`` lists; raise on any bad row."""
    layout = task.tsv
    label_ids = {name: i for i, name in enumerate(task.label_names)}
    out: dict[str, list] = {"text_a": [], **({"text_b": []} if layout.text_b is not None else {}), "label": []}
    for row, line in _rows(path, task):
        out["label"].append(_label(row[layout.label].strip(), task, label_ids, f"{path}:{line}"))
        out["text_a"].append(row[layout.text_a])
        if layout.text_b is not None:
            out["text_b"].append(row[layout.text_b])
    if not out["label"]:
        raise PeftlabError("file has no data rows", where=str(path), fix="re-download the file (GLUE glue_data layout)")
    return out


def label_features(pair: bool, regression: bool):
    """The columns of every labelled split: ``text_a`` [, ``text_b``], ``label`` (a class id, or a score)."""
    from datasets import Features, Value

    return Features({"text_a": Value("string"), **({"text_b": Value("string")} if pair else {}),
                     "label": Value("float32") if regression else Value("int64")})


def _features(task: Task):
    return label_features(len(task.text_fields) > 1, task.kind == "regression")


def hub_offline() -> bool:
    """HF_DATASETS_OFFLINE or HF_HUB_OFFLINE is set: data missing locally is an error, not a download."""
    truthy = {"1", "ON", "YES", "TRUE"}
    return any(os.environ.get(v, "").upper() in truthy for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def _load_hub(task: Task, split: str):
    import datasets

    ds = datasets.load_dataset(HUB_DATASET, task.name, split=_named_split(task, split))
    ds = ds.filter(lambda label: label != -1, input_columns="label")  # unlabelled rows
    names = {task.text_fields[0]: "text_a"}
    if len(task.text_fields) > 1:
        names[task.text_fields[1]] = "text_b"
    ds = ds.select_columns(list(names) + ["label"]).rename_columns(names)
    return ds.cast(_features(task))


# 10k subsets in <root>/glue_subsets/<Task>/ of the tasks marked ``subsets`` (full training sets not offline).
SUBSET_DATASET = "glue_subsets"
_SUBSET_FILES = {"train": "train.json", "validation": "dev.json", "validation_matched": "dev.json"}


@dataclass(frozen=True)
class SplitSource:
    """Where one split is read from: ``dataset`` is ``glue`` (the full GLUE split), ``glue_subsets`` or ``hub``."""

    dataset: str
    path: Path | None  # None for the Hub


def locate_split(task: Task | str, split: str, data_dir: str | os.PathLike | None = None) -> tuple[SplitSource | None,
                                                                                          list[Path]]:
    """The local file a split comes from (full GLUE first, then the 10k subsets), and every path tried."""
    spec = _check_task_split(task, split)
    check_data_dir(data_dir)
    tried: list[Path] = []
    roots = candidate_roots(data_dir)
    for root in roots:
        # <root>/glue/<Task>/ (a data root), or <root>/<Task>/ (a glue_data folder) when there is no glue/
        folders = [root / "glue"] if (root / "glue").is_dir() or not root.is_dir() else [root / "glue", root]
        for folder in folders:
            path = folder / spec.glue_dir / _split_file(spec, split)
            tried.append(path)
            if path.is_file():
                return SplitSource("glue", path), tried
    if spec.subsets and split in _SUBSET_FILES:
        for root in roots:
            path = root / SUBSET_DATASET / spec.glue_dir / _SUBSET_FILES[split]
            tried.append(path)
            if path.is_file():
                return SplitSource(SUBSET_DATASET, path), tried
    return None, tried


def available_eval_splits(task: Task | str, data_dir: str | os.PathLike | None = None) -> tuple[str, ...]:
    """The task's evaluation splits that can be read: MNLI from the subsets has one dev set, not two."""
    spec = _check_task_split(task, "validation")
    if len(spec.eval_splits) > 1 and spec.subsets:
        source, _ = locate_split(spec, spec.eval_splits[0], data_dir)
        if source is not None and source.dataset == SUBSET_DATASET:
            return ("validation",)
    return spec.eval_splits


def read_subset_json(path: Path, spec: Task) -> dict[str, list]:
    """A glue_subsets file: ``{"0": {"text_a", "text_b", "label"}, ...}`` with the task's label names.

    Read with :mod:`json`, not datasets' ``json`` builder: that builder reads an object of records as one row
    with a column per key ("0", "1", ...), not as records."""
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise PeftlabError(f"cannot read {path}: {err}", fix="restore the file from the shared data") from None
    if not isinstance(records, dict):
        raise PeftlabError(f"{path}: expected a JSON object of records keyed by index",
                           fix="use the glue_subsets layout ({\"0\": {\"text_a\", \"text_b\", \"label\"}})")
    out: dict[str, list] = {"text_a": [], "text_b": [], "label": []}
    for index, record in records.items():
        try:
            label = spec.label_names.index(str(record["label"]))
            out["text_a"].append(str(record["text_a"]))
            out["text_b"].append(str(record["text_b"]))
        except (KeyError, ValueError, TypeError):
            raise PeftlabError(f"{path}: record {index!r} needs text_a, text_b and a label in "
                               f"{', '.join(spec.label_names)}", fix="fix or remove that record") from None
        out["label"].append(label)
    return out


def load_split(task: Task | str, split: str, data_dir: str | os.PathLike | None = None):
    """One labelled split of a GLUE task as a ``Dataset`` (``text_a``, [``text_b``,] ``label``).

    ``split``: ``train``, ``validation`` (MNLI: matched), ``validation_matched``, ``validation_mismatched``.
    """
    spec = _check_task_split(task, split)
    source, tried = locate_split(spec, split, data_dir)
    if source is not None:
        from datasets import Dataset

        read = read_glue_tsv if source.dataset == "glue" else read_subset_json
        return Dataset.from_dict(read(source.path, spec), features=_features(spec))
    return from_hub(lambda: _load_hub(spec, split), HUB_DATASET, what=f"{spec.glue_dir} {split}", tried=tried,
                    holding=f"glue/{spec.glue_dir}/{_split_file(spec, split)}")


# --------------------------------------------------------------------------- subsets


def subset(ds, n: int | None, seed: int):
    """``n`` examples drawn deterministically: a ``seed``-ed shuffle, then the first ``n``.

    ``n=None`` returns ``ds`` unchanged (original order). ``n >= len(ds)`` returns all rows in the
    seeded shuffled order, so a smaller ``n`` is always a prefix of a larger one.
    """
    if n is None:
        return ds
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise PeftlabError(f"subset size must be a positive integer, got {n!r}", fix="use a number such as 1000")
    return ds.shuffle(seed=seed).select(range(min(n, len(ds))))


def selection_split(ds, n: int, seed: int, *, regression: bool):
    """``ds`` split into (pool, selection): ``n`` examples held out for every choice a run makes (best epoch,
    early stopping, a study's rates), the rest the pool every training seed draws its subset from, so no seed
    ever trains on a selection example. Stratified by label (STS-B by its rounded score) with scikit-learn's
    ``train_test_split``, drawn with ``seed`` (``--eval-seed``): the same split for every training seed. Falls back
    to an unstratified draw only where a label has a single example (the split cannot be stratified then);
    the third value says which it was."""
    import numpy as np
    from sklearn.model_selection import train_test_split

    if n >= len(ds):
        raise PeftlabError(f"--selection-samples {n} leaves nothing to train on: the training split has "
                           f"{len(ds)} examples", fix=f"use --selection-samples well below {len(ds)}")
    labels = np.asarray(ds["label"], dtype=float)
    strata = np.rint(labels).astype(np.int64) if regression else labels.astype(np.int64)
    counts = np.bincount(strata - strata.min())
    stratified = bool((counts[counts > 0] >= 2).all()) and n >= len(counts[counts > 0])
    pool, selection = train_test_split(np.arange(len(ds)), test_size=n, random_state=seed, shuffle=True,
                                       stratify=strata if stratified else None)
    return ds.select(np.sort(pool)), ds.select(np.sort(selection)), stratified
