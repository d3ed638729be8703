"""The user's own labelled data as a task: ``--task classify`` and ``--task regress``.

Sources (read by :mod:`peftlab.tasks.labelled_files`): ``--train-file`` [``--eval-file``], or ``--dataset`` (a
save_to_disk folder, or online a Hub dataset) whose ``train`` split trains and whose ``--eval-split`` (default
``validation`` when it has one) evaluates. ``--text-fields A[,B]`` names one text column or a pair,
``--label-field`` the target.

* classify: labels are strings or integers (a float with a fraction is refused), class ids in sorted order
  (integers numerically, then strings); a datasets ``ClassLabel`` keeps its own. The mapping is the model's
  ``id2label`` (so the adapter, a merged export and ``peftlab predict`` name the classes) and result.json's.
* regress: numbers (numeric strings too), one output trained with MSE.
* Without eval data: a held-out :data:`HELDOUT_FRACTION` of the training data, scikit-learn's
  ``train_test_split`` with the fixed seed :data:`HELDOUT_SEED` (stratified for classify), so every ``--seed``
  trains and is scored on the same split.

Bad data is one line naming the file, row and column (``tickets.csv:7, column label``), found before the model
is loaded or anything is written.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peftlab.errors import PeftlabError, closest, unknown
from peftlab.tasks import labelled_files as files
from peftlab.tasks.table import METRIC_ALIASES, USER_METRICS, USER_TASKS, Task

HELDOUT_FRACTION = 0.1  # of the training data, when there is no eval file or split
HELDOUT_SEED = 0  # fixed: the held-out split is the same for every --seed
DEFAULT_TEXT_FIELD = "text"
DEFAULT_LABEL_FIELD = "label"
# The options only a user task reads, with their defaults: set for another task, they would be ignored.
USER_ONLY_OPTIONS = {"dataset": None, "text_fields": None, "eval_split": None, "metric": None, "data_digest": None,
                     "label_field": DEFAULT_LABEL_FIELD}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------- options (TrainConfig.__post_init__)


@dataclass(frozen=True)
class UserOptions:
    """A user task's options as resolved: what TrainConfig records (and the run key hashes)."""

    text_fields: str | None  # "a" or "a,b"
    metric: str | None
    data_digest: str | None  # sha256 of the data files' bytes (None: a Hub dataset)


def resolve_options(cfg, task: Task) -> UserOptions:
    """Check a TrainConfig's data options for its task and complete them: the text fields and metric defaults,
    and the data digest (computed from the files unless the config already carries one, e.g. a run's
    config.yaml). Another task with one of these options set is refused (it would be ignored)."""
    if not task.user_data:
        for name, default in USER_ONLY_OPTIONS.items():
            if getattr(cfg, name) != default:
                raise PeftlabError(f"{_flag(name)} is set, but task '{task.name}' reads its own data (it would be "
                                   "ignored)", fix=f"remove {_flag(name)}, or train on your own data with --task "
                                   "classify or --task regress")
        return UserOptions(None, None, None)
    if bool(cfg.train_file) == bool(cfg.dataset):
        both = "both --train-file and --dataset are set" if cfg.train_file else "no data given"
        raise PeftlabError(f"--task {task.name}: {both}", fix="pass --train-file FILE (CSV, TSV, JSON, JSONL, Parquet) "
                           "or --dataset FOLDER|NAME[:CONFIG], one of them")
    if cfg.eval_file and cfg.dataset:
        raise PeftlabError("--eval-file goes with --train-file",
                           fix="with --dataset, pick its split: --eval-split NAME")
    if cfg.eval_split and not cfg.dataset:
        raise PeftlabError("--eval-split picks a split of --dataset; files have none",
                           fix="pass --eval-file FILE (or leave it out for a held-out split of --train-file)")
    fields = [f.strip() for f in str(cfg.text_fields or DEFAULT_TEXT_FIELD).split(",")]
    if not all(fields) or len(fields) > 2 or len(set(fields)) != len(fields):
        raise PeftlabError(f"--text-fields '{cfg.text_fields}' must name one or two different columns",
                           fix="e.g. --text-fields text, or --text-fields question,passage for a pair")
    if not str(cfg.label_field).strip() or cfg.label_field in fields:
        raise PeftlabError(f"--label-field '{cfg.label_field}' must name a column, and not one of --text-fields "
                           f"({','.join(fields)})", fix="name the text column(s) and the label column apart")
    choices = USER_METRICS[task.name]
    metric = str(cfg.metric or choices[0]).strip().lower()
    metric = METRIC_ALIASES.get(metric, metric)
    if metric not in choices:
        other = next(t for t in USER_TASKS if t != task.name)
        hint = f" ({metric} is a --task {other} metric)" if metric in USER_METRICS[other] else ""
        raise PeftlabError(f"--metric {cfg.metric} cannot score --task {task.name}{hint}{closest(metric, choices)}",
                           fix=f"use one of: {', '.join(choices)}")
    digest = cfg.data_digest if cfg.data_digest is not None else current_digest(cfg)
    return UserOptions(",".join(fields), metric, digest)


def current_digest(cfg) -> str | None:
    """sha256 of the bytes ``cfg``'s data comes from now (None for a Hub dataset), after one-line errors for a
    missing, empty or unknown file, or a folder where a file is expected."""
    if cfg.dataset:
        parts = files.hub_or_folder_parts(cfg.dataset)
    else:
        parts = [("train", files.check_file(cfg.train_file, "--train-file"))]
        if cfg.eval_file:
            parts.append(("eval", files.check_file(cfg.eval_file, "--eval-file")))
    return files.data_digest(parts) if parts else None


# --------------------------------------------------------------------------- the data


@dataclass(frozen=True)
class LabelledData:
    """A user task's data, read and checked: ``text_a`` [, ``text_b``], ``label`` (class id or number)."""

    train: Any  # datasets.Dataset, in source order (what the held-out split left)
    eval: Any
    label_names: tuple[str, ...]  # classify: the class of each id; regress: ()
    sources: dict[str, str]  # result.json data_files: train / validation -> where it was read
    dataset: str  # result.json "dataset": the file, folder or Hub dataset read
    heldout: dict | None  # the held-out split's fraction, seed and stratification, when there was one


def load_labelled(cfg, task: Task) -> LabelledData:
    """``cfg``'s data for ``task`` (read once per process and data content). A run's config carries the digest of its
    data: data that changed since (config.yaml of an older run) is refused rather than silently used."""
    digest = current_digest(cfg)
    if cfg.data_digest and digest and digest != cfg.data_digest:
        source = cfg.dataset or ", ".join(filter(None, (cfg.train_file, cfg.eval_file)))
        raise PeftlabError(f"the data changed since this run was configured: its bytes hash to {digest[:12]}, the "
                           f"config's data_digest is {cfg.data_digest[:12]}", where=source,
                           fix="restore the data the run was trained on, or train a new run on it (a new run key)")
    return _load(os.getcwd(), task, cfg.train_file, cfg.eval_file, cfg.dataset, cfg.eval_split, cfg.text_fields,
                 cfg.label_field, cfg.metric, digest)


@functools.lru_cache(maxsize=4)  # keyed on the working directory too (paths may be relative) and the data digest
def _load(cwd, task: Task, train_file, eval_file, dataset, eval_split, text_fields: str, label_field: str,
          metric: str, digest) -> LabelledData:
    fields = text_fields.split(",")
    if dataset:
        splits = files.read_dataset(dataset)
        if "train" not in splits:
            raise PeftlabError(f"--dataset {dataset} has no train split", where=f"splits: {', '.join(splits)}",
                               fix="save the training examples as the split 'train'")
        wanted = eval_split or ("validation" if "validation" in splits else None)
        if wanted is not None and wanted not in splits:
            raise unknown(f"split of {dataset}", wanted, splits, where="--eval-split")
        train_table, eval_table, shown = splits["train"], splits[wanted] if wanted else None, dataset
    else:
        train_table = files.read_file(Path(train_file).expanduser())
        eval_table = files.read_file(Path(eval_file).expanduser()) if eval_file else None
        shown = Path(train_file).name
    for table in filter(None, (train_table, eval_table)):
        _check_columns(table, fields, label_field)
    regression = task.kind == "regression"
    names: tuple[str, ...] = ()
    if regression:
        train_labels = _targets(train_table, label_field)
        eval_labels = _targets(eval_table, label_field) if eval_table else None
    else:
        names, train_labels, eval_labels = _classes(train_table, eval_table, label_field)
        if metric == "f1" and len(names) != 2:
            raise PeftlabError(f"--metric f1 is binary F1, but the data has {len(names)} classes "
                               f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''})",
                               where=f"{train_table.name}, column {label_field}", fix="use --metric f1_macro")
    train_texts = [column_texts(train_table, f) for f in fields]
    train_rows, heldout = list(range(len(train_table))), None
    if eval_table is None:
        train_rows, eval_rows = heldout_split(train_labels, stratify=not regression, table=train_table,
                                              column=label_field, names=names)
        eval_texts = [[texts[i] for i in eval_rows] for texts in train_texts]
        eval_labels = [train_labels[i] for i in eval_rows]
        heldout = {"fraction": HELDOUT_FRACTION, "seed": HELDOUT_SEED, "stratified": not regression}
        eval_source = f"held-out {HELDOUT_FRACTION:.0%} of {train_table.name} (seed {HELDOUT_SEED}" + \
            (", stratified)" if not regression else ")")
    else:
        eval_texts, eval_source = [column_texts(eval_table, f) for f in fields], eval_table.name
    train = _dataset([[texts[i] for i in train_rows] for texts in train_texts],
                     [train_labels[i] for i in train_rows], regression)
    return LabelledData(train, _dataset(eval_texts, eval_labels, regression), names,
                        {"train": train_table.name, "validation": eval_source}, shown, heldout)


def _where(table, row: int, column: str) -> str:
    return f"{table.locate(row)}, column {column}"


def _check_columns(table, fields: list[str], label_field: str) -> None:
    for flag, column in [("--text-fields", f) for f in fields] + [("--label-field", label_field)]:
        if column not in table.columns:
            present = ", ".join(table.columns)
            raise PeftlabError(f"no column '{column}'{closest(column, table.columns)}", where=f"{table.name}, {flag}",
                               fix=f"the columns are: {present}; pass {flag} with one of them")


def column_texts(table, column: str) -> list[str]:
    """A text column as strings (numbers as written); one line for a missing text or a non-text value."""
    values = table.columns[column]
    for row, value in enumerate(values):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            raise PeftlabError("empty text", where=_where(table, row, column), fix="give every row its text, or "
                               "remove the row")
        if isinstance(value, (dict, list)):
            raise PeftlabError(f"text is a {type(value).__name__}, not a string", where=_where(table, row, column),
                               fix="put the text itself in this column")
    return [value if isinstance(value, str) else str(value) for value in values]


def _class_name(value, table, row: int, column: str) -> str:
    """The class a raw label names: integers (and integral floats) by their digits, strings stripped."""
    if isinstance(value, int):  # bool too: True, False
        return str(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    if isinstance(value, str) and value.strip():
        return value.strip()
    if value is None or (isinstance(value, float) and math.isnan(value)) or isinstance(value, str):
        raise PeftlabError("empty label", where=_where(table, row, column), fix="give every row a label, or remove "
                           "the row")
    if isinstance(value, float):
        raise PeftlabError(f"label {value!r} is not a class (a number with a fraction)",
                           where=_where(table, row, column), fix="use --task regress for a numeric target, or integer "
                           "/ string class labels")
    raise PeftlabError(f"label is a {type(value).__name__}, not a class name", where=_where(table, row, column),
                       fix="use one string or integer label per row")


def _row_names(table, column: str) -> list[str]:
    declared = table.class_names.get(column)
    names = []
    for row, value in enumerate(table.columns[column]):
        if declared is not None and isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value < len(declared):  # datasets marks an unlabelled row -1
                what = "empty label (class id -1: unlabelled)" if value == -1 else f"label id {value} has no class"
                raise PeftlabError(what, where=_where(table, row, column),
                                   fix="use a labelled split (--eval-split), or give every row a label")
            names.append(declared[value])
        else:
            names.append(_class_name(value, table, row, column))
    return names


def _sort_key(name: str):
    return (0, int(name), "") if re.fullmatch(r"[+-]?\d+", name) else (1, 0, name)


def _classes(train_table, eval_table, column: str) -> tuple[tuple[str, ...], list[int], list[int] | None]:
    """Class names (by id) and the train / eval class ids; one-line errors for one class, unseen eval labels."""
    train_names = _row_names(train_table, column)
    present = sorted(set(train_names), key=_sort_key)
    if len(present) < 2:
        raise PeftlabError(f"every training label is '{present[0]}': one class only, nothing to learn",
                           where=f"{train_table.name}, column {column}", fix="add examples of the other classes "
                           "(or check --label-field)")
    names = train_table.class_names.get(column) or tuple(present)
    ids = {name: i for i, name in enumerate(names)}
    eval_ids = None
    if eval_table is not None:
        eval_names = _row_names(eval_table, column)
        seen = set(present)
        for row, name in enumerate(eval_names):
            if name not in seen:
                raise PeftlabError(f"eval label '{name}' never occurs in the training data, whose labels are "
                                   f"{', '.join(present[:8])}{', ...' if len(present) > 8 else ''}",
                                   where=_where(eval_table, row, column),
                                   fix="add training examples of it, or remove the row from the eval data")
        eval_ids = [ids[name] for name in eval_names]
    return tuple(names), [ids[name] for name in train_names], eval_ids


def _targets(table, column: str) -> list[float]:
    out = []
    for row, value in enumerate(table.columns[column]):
        number = math.nan
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and value.strip():
            try:
                number = float(value.strip())
            except ValueError:
                pass
        if not math.isfinite(number):
            shown = "empty target" if value is None or (isinstance(value, str) and not value.strip()) \
                else f"target {value!r} is not a number"
            raise PeftlabError(shown, where=_where(table, row, column),
                               fix="give every row a finite number (--task classify for class labels)")
        out.append(number)
    if len(set(out)) < 2:
        raise PeftlabError(f"every target is {out[0]:g}: a constant (nothing to learn, and its correlation with any "
                           "prediction is undefined)", where=f"{table.name}, column {column}",
                           fix="check --label-field, or give the data varied targets")
    return out


def heldout_split(labels: list, *, stratify: bool, table=None, column: str = "",
                  names: tuple = ()) -> tuple[list[int], list[int]]:
    """Row indices (each in source order) of the training and held-out parts: scikit-learn's
    ``train_test_split`` of :data:`HELDOUT_FRACTION` with the fixed seed :data:`HELDOUT_SEED`, stratified by
    class when ``stratify`` (at least one held-out example per class)."""
    import numpy as np
    from sklearn.model_selection import train_test_split

    n = len(labels)
    classes = len(set(labels)) if stratify else 1
    n_eval = max(1, round(HELDOUT_FRACTION * n), classes)
    if stratify:
        single = sorted(label for label, count in Counter(labels).items() if count < 2)
        if single:
            row = labels.index(single[0])
            raise PeftlabError(f"label '{names[single[0]] if names else single[0]}' has only one example; a "
                               "stratified held-out split needs two of each class",
                               where=_where(table, row, column) if table is not None else None,
                               fix="add examples of it, remove the row, or pass --eval-file")
    if n - n_eval < classes:
        raise PeftlabError(f"{n} examples are too few for a held-out split", where=table.name if table else None,
                           fix="add examples, or pass --eval-file")
    train_rows, eval_rows = train_test_split(np.arange(n), test_size=n_eval, random_state=HELDOUT_SEED, shuffle=True,
                                             stratify=labels if stratify else None)
    return sorted(int(i) for i in train_rows), sorted(int(i) for i in eval_rows)


def _dataset(texts: list[list[str]], labels: list, regression: bool):
    from datasets import Dataset

    from peftlab.tasks.data_files import label_features

    columns = {"text_a": texts[0], **({"text_b": texts[1]} if len(texts) > 1 else {}), "label": labels}
    return Dataset.from_dict(columns, features=label_features(len(texts) > 1, regression))


# --------------------------------------------------------------------------- the model's head


@dataclass(frozen=True)
class HeadLabels:
    """What a run's head outputs: ``num_labels`` and the class names by id (() for regression)."""

    num_labels: int
    names: tuple[str, ...] = ()

    def config_values(self) -> dict:
        """transformers config values naming the outputs (``model.config.update(...)``): id2label, label2id."""
        if not self.names:
            return {}
        return {"id2label": dict(enumerate(self.names)), "label2id": {n: i for i, n in enumerate(self.names)}}


def head_labels(cfg, task: Task, saved: dict | None = None) -> HeadLabels:
    """The head a run of ``cfg`` on ``task`` trains: a table task's labels; a user task's from its data (read and
    checked here, before the model is loaded) or, for a saved run, from its adapter's ``saved`` labels (id2label)."""
    if task.kind == "regression":
        return HeadLabels(1)
    if saved and saved.get("id2label"):
        id2label = {int(k): str(v) for k, v in saved["id2label"].items()}
        return HeadLabels(len(id2label), tuple(id2label[i] for i in range(len(id2label))))
    if task.user_data:
        names = load_labelled(cfg, task).label_names
        return HeadLabels(len(names), names)
    return HeadLabels(task.num_labels, task.label_names if task.kind == "classification" else ())
