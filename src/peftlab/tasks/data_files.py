"""GLUE data: reading the ``glue_data`` TSV files (or the Hub), subsets, majority baselines.

Tokenisation, collation and length-grouped batching are in :mod:`peftlab.tasks.batching` (also importable
from here).

Every split becomes a :class:`datasets.Dataset` with the columns ``text_a`` (str), ``text_b`` (str; absent
for single-sentence tasks) and ``label`` (class id in ``Task.label_names`` order; float for STS-B).

Where the data comes from, in order:

1. a local GLUE ``glue_data`` layout: ``<root>/glue/<Task>/{train,dev}.tsv`` or ``<root>/<Task>/...``
   (MNLI: ``dev_matched.tsv``/``dev_mismatched.tsv``). ``<root>`` is ``--data-dir`` if given, else the
   first of ``$PEFTLAB_DATA_DIR``, ``./data``, ``../shared/data`` that holds the file;
2. for MNLI, QNLI and QQP only, whose full training sets are not available offline:
   ``<root>/glue_subsets/<Task>/{train,dev}.json``, 10k random subsets of GLUE *train* split 8,999/1,000
   (ZhengxiangShi/PowerfulPromptFT). They are never passed off as the full task: result.json records
   ``dataset: glue_subsets`` and the files read, and reports label the column. QNLI's real GLUE dev set
   (``glue/QNLI/dev.tsv``) is found first, so QNLI trains on the subset and is scored on the real dev set;
   MNLI from the subsets has one dev set (no matched/mismatched split);
3. the Hugging Face Hub (``nyu-mll/glue``), unless ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` is set;
4. otherwise a :class:`~peftlab.errors.PeftlabError` that lists the files it looked for.

The TSVs are read with quoting disabled (sentences contain unbalanced ``"``), a leading UTF-8 BOM is
dropped (MRPC dev has one), and every malformed row is reported as ``file:line``.

The JSON list / JSONL files of the other task kinds are read by :mod:`peftlab.tasks.json_files`.
"""

from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError, unknown
from peftlab.tasks.table import TASKS, Task


SPLITS = ("train", "validation", "validation_matched", "validation_mismatched")
HUB_DATASET = "nyu-mll/glue"

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


def resolve_data_dir(data_dir: str | os.PathLike | None) -> Path | None:
    """The data root: ``data_dir`` if given, else the first existing of ``$PEFTLAB_DATA_DIR``,
    ``./data`` and ``../shared/data`` (relative to the working directory); ``None`` if none exists.

    A root may hold ``glue/`` (and other data sets) or be a ``glue_data`` folder holding ``CoLA/`` etc.
    An explicit ``data_dir`` that does not exist is an error, not a silent fall-back.
    """
    check_data_dir(data_dir)
    for root in candidate_roots(data_dir):
        if root.is_dir():
            return root
    return None


def _split_files(task: Task, split: str) -> list[str]:
    if task.name == "mnli":
        return {"train": ["train.tsv"], "validation": ["dev_matched.tsv"],
                "validation_matched": ["dev_matched.tsv"], "validation_mismatched": ["dev_mismatched.tsv"]}[split]
    return {"train": ["train.tsv"], "validation": ["dev.tsv"]}[split]


def _check_task_split(task_name: str, split: str) -> Task:
    if task_name not in TASKS:
        raise unknown("task", task_name, TASKS)
    task = TASKS[task_name]
    if not task.glue_dir:
        raise PeftlabError(f"task '{task_name}' is not a GLUE task", fix="load instruction data with peftlab.tasks.instructions")
    allowed = ("train", "validation") + tuple(s for s in task.eval_splits if s != "validation")
    if split not in allowed:
        hint = " (GLUE test splits have no labels)" if split == "test" else ""
        raise PeftlabError(f"unknown split '{split}' for task '{task_name}'{hint}",
                           fix=f"use one of: {', '.join(allowed)}")
    return task


# --------------------------------------------------------------------------- reading the TSVs


@dataclass(frozen=True)
class _Layout:
    """Where a task's fields are in its TSV rows (column indices; negative counts from the end)."""

    text_a: int
    text_b: int | None
    label: int
    header: bool = True
    columns: int | None = None  # expected column count; None = the header's


_LAYOUTS: dict[str, _Layout] = {
    "cola": _Layout(3, None, 1, header=False, columns=4),  # source, label, original label, sentence
    "sst2": _Layout(0, None, 1),  # sentence, label
    "mrpc": _Layout(3, 4, 0),  # Quality, #1 ID, #2 ID, #1 String, #2 String
    "qqp": _Layout(3, 4, 5),  # id, qid1, qid2, question1, question2, is_duplicate
    "stsb": _Layout(7, 8, -1),  # index, genre, filename, year, old_index, source1, source2, s1, s2, score
    "mnli": _Layout(8, 9, -1),  # ..., sentence1, sentence2, label1[..label5], gold_label
    "qnli": _Layout(1, 2, 3),  # index, question, sentence, label
    "rte": _Layout(1, 2, 3),  # index, sentence1, sentence2, label
    "wnli": _Layout(1, 2, 3),  # index, sentence1, sentence2, label
}


def read_glue_tsv(path: Path, task_name: str) -> dict[str, list]:
    """Parse one labelled GLUE TSV into ``{"text_a", ["text_b",] "label"}`` lists; raise on any bad row."""
    task = TASKS[task_name]
    layout = _LAYOUTS[task_name]
    regression = task.kind == "regression"
    label_ids = {name: i for i, name in enumerate(task.label_names)}
    text_a: list[str] = []
    text_b: list[str] = []
    labels: list[Any] = []
    expected = layout.columns
    try:
        with open(path, encoding="utf-8-sig", newline="") as fh:
            reader = csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
            for row in reader:
                line = reader.line_num
                if not row or row == [""]:
                    continue  # blank line (e.g. a trailing one)
                if expected is None:  # the header row
                    expected = len(row)
                    if expected <= max(layout.text_a, layout.text_b or 0, layout.label if layout.label >= 0 else 0):
                        raise PeftlabError(
                            f"header has {expected} columns, too few for {task.glue_dir}",
                            where=f"{path}:{line}", fix="use the GLUE glue_data files unchanged",
                        )
                    continue
                if len(row) != expected:
                    raise PeftlabError(
                        f"row has {len(row)} tab-separated columns, expected {expected}",
                        where=f"{path}:{line}", fix="repair or re-download the file (GLUE glue_data layout)",
                    )
                raw = row[layout.label].strip()
                if regression:
                    try:
                        value = float(raw)
                    except ValueError:
                        value = math.nan
                    if not math.isfinite(value):
                        raise PeftlabError(
                            f"score '{raw}' is not a number", where=f"{path}:{line}",
                            fix="STS-B scores must be numbers between 0 and 5",
                        )
                    labels.append(value)
                else:
                    if raw not in label_ids:
                        raise PeftlabError(
                            f"unknown label '{raw}'", where=f"{path}:{line}",
                            fix=f"{task.glue_dir} labels are: {', '.join(task.label_names)}",
                        )
                    labels.append(label_ids[raw])
                text_a.append(row[layout.text_a])
                if layout.text_b is not None:
                    text_b.append(row[layout.text_b])
    except UnicodeDecodeError as err:
        raise PeftlabError(f"file is not valid UTF-8 ({err.reason} at byte {err.start})", where=str(path),
                           fix="re-download the file") from None
    if not labels:
        raise PeftlabError("file has no data rows", where=str(path), fix="re-download the file (GLUE glue_data layout)")
    out: dict[str, list] = {"text_a": text_a}
    if layout.text_b is not None:
        out["text_b"] = text_b
    out["label"] = labels
    return out


def _features(task: Task):
    from datasets import Features, Value

    cols = {"text_a": Value("string")}
    if len(task.text_fields) > 1:
        cols["text_b"] = Value("string")
    cols["label"] = Value("float32") if task.kind == "regression" else Value("int64")
    return Features(cols)


def _load_local(path: Path, task: Task):
    from datasets import Dataset

    # The token cache keys on the rows' content (batching.content_digest), so an edited file is re-tokenised.
    return Dataset.from_dict(read_glue_tsv(path, task.name), features=_features(task))


def hub_offline() -> bool:
    """HF_DATASETS_OFFLINE or HF_HUB_OFFLINE is set: data missing locally is an error, not a download."""
    truthy = {"1", "ON", "YES", "TRUE"}
    return any(os.environ.get(v, "").upper() in truthy for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def _load_hub(task: Task, split: str):
    import datasets

    hub_split = "validation_matched" if (task.name == "mnli" and split == "validation") else split
    ds = datasets.load_dataset(HUB_DATASET, task.name, split=hub_split)
    ds = ds.filter(lambda label: label != -1, input_columns="label")  # unlabelled rows
    names = {task.text_fields[0]: "text_a"}
    if len(task.text_fields) > 1:
        names[task.text_fields[1]] = "text_b"
    ds = ds.select_columns(list(names) + ["label"]).rename_columns(names)
    return ds.cast(_features(task))


# Tasks with 10k subsets in <root>/glue_subsets/<Task>/ (the full training sets are not available offline).
SUBSET_TASKS = ("mnli", "qnli", "qqp")
SUBSET_DATASET = "glue_subsets"
_SUBSET_FILES = {"train": "train.json", "validation": "dev.json", "validation_matched": "dev.json"}


@dataclass(frozen=True)
class SplitSource:
    """Where one split is read from: ``dataset`` is ``glue`` (the full GLUE split), ``glue_subsets`` or ``hub``."""

    dataset: str
    path: Path | None  # None for the Hub


def locate_split(task: str, split: str, data_dir: str | os.PathLike | None = None) -> tuple[SplitSource | None,
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
            for name in _split_files(spec, split):
                path = folder / spec.glue_dir / name
                tried.append(path)
                if path.is_file():
                    return SplitSource("glue", path), tried
    if spec.name in SUBSET_TASKS and split in _SUBSET_FILES:
        for root in roots:
            path = root / SUBSET_DATASET / spec.glue_dir / _SUBSET_FILES[split]
            tried.append(path)
            if path.is_file():
                return SplitSource(SUBSET_DATASET, path), tried
    return None, tried


def available_eval_splits(task: str, data_dir: str | os.PathLike | None = None) -> tuple[str, ...]:
    """The task's evaluation splits that can be read: MNLI from the subsets has one dev set, not two."""
    spec = TASKS[task]
    if spec.name == "mnli":
        source, _ = locate_split(task, "validation_matched", data_dir)
        if source is not None and source.dataset == SUBSET_DATASET:
            return ("validation",)
    return spec.eval_splits


def read_subset_json(path: Path, task_name: str) -> dict[str, list]:
    """A glue_subsets file: ``{"0": {"text_a", "text_b", "label"}, ...}`` with the task's label names.

    Read with :mod:`json`, not datasets' ``json`` builder: that builder reads an object of records as one row
    with a column per key ("0", "1", ...), not as records."""
    spec = TASKS[task_name]
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


def load_split(task: str, split: str, data_dir: str | os.PathLike | None = None):
    """One labelled split of a GLUE task as a ``Dataset`` (``text_a``, [``text_b``,] ``label``).

    ``split``: ``train``, ``validation`` (MNLI: matched), ``validation_matched``, ``validation_mismatched``.
    """
    spec = _check_task_split(task, split)
    source, tried = locate_split(task, split, data_dir)
    if source is not None and source.dataset == "glue":
        return _load_local(source.path, spec)
    if source is not None:
        from datasets import Dataset

        return Dataset.from_dict(read_subset_json(source.path, spec.name), features=_features(spec))
    hub_error = ""
    if not hub_offline():
        try:
            return _load_hub(spec, split)
        except Exception as err:  # noqa: BLE001 - any Hub failure becomes the message below
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            hub_error = f"; the Hub ({HUB_DATASET}) failed: {first}"
    else:
        hub_error = "; not trying the Hub (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set)"
    raise PeftlabError(
        f"no local copy of {spec.glue_dir} {split}{hub_error}",
        where="looked for " + ", ".join(str(p) for p in tried),
        fix=f"pass --data-dir (or set PEFTLAB_DATA_DIR) to a folder holding glue/{spec.glue_dir}/"
        f"{_split_files(spec, split)[0]}, or run with network access (HF_DATASETS_OFFLINE and HF_HUB_OFFLINE "
        "unset) to load it from the Hub",
    )


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


# --------------------------------------------------------------------------- baselines


def majority_baseline(task: str, train_labels, eval_labels) -> float:
    """Chance level of ``task``'s primary metric on the eval labels: the eval set's own majority class.

    Accuracy: predicting the eval set's most frequent class (ties: lowest class id) for every eval example,
    the bar a model must clear on that set. (The most frequent *training* class can understate it on small
    subsets: 0.375 where the eval set's majority scores 0.625.) ``train_labels`` is only checked to be
    non-empty. Matthews correlation and Pearson: 0.0 (a constant prediction has no correlation).
    """
    import numpy as np

    if task not in TASKS:
        raise unknown("task", task, TASKS)
    metric = TASKS[task].primary_metric
    if metric in ("matthews_correlation", "pearson", "spearman", "combined"):
        return 0.0
    if TASKS[task].kind != "classification":
        raise ValueError(f"no majority baseline for {TASKS[task].kind} task '{task}'")
    train = np.asarray(list(train_labels), dtype=np.int64)
    evals = np.asarray(list(eval_labels), dtype=np.int64)
    if train.size == 0 or evals.size == 0:
        return 0.0
    majority = int(np.bincount(evals).argmax())
    if metric == "accuracy":
        return float(np.mean(evals == majority))
    if metric == "f1":
        from sklearn.metrics import f1_score

        return float(f1_score(evals, np.full_like(evals, majority), zero_division=0))
    raise ValueError(f"no majority baseline for metric '{metric}'")
