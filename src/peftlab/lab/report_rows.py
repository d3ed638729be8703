"""The rows of ``peftlab report``'s table: run records grouped by their config without the seed (pandas), each
group's cells per task, the majority-class row, the labels that tell the rows apart and their order. The module
docstring of :mod:`peftlab.lab.report` says what a row and a cell hold."""

from __future__ import annotations

import math
from collections import Counter

import pandas as pd

from peftlab.errors import PeftlabError
from peftlab.lab.records import TRAINING_ONLY_KEYS, RunRecord, fmt_value, hashable, is_pruned, varying_keys
from peftlab.lab.table_model import Cell, Row
from peftlab.lab.tables import MAJORITY

# Task kinds with a majority class (the instruction tasks' majority_baseline is a placeholder 0).
MAJORITY_KINDS = ("classification", "regression")


def param_count(trainable: dict | None, convention: str, method: str | None) -> int | None:
    """A run's #Param under ``convention`` (total, adapter or yao) from result.json's ``trainable_params``."""
    trainable = trainable or {}
    if convention == "yao":
        if method == "full":  # Yao et al.'s full FT: every trainable weight, the head once
            return trainable.get("total")
        adapter, head = trainable.get("adapter"), trainable.get("head")
        return None if adapter is None or head is None else int(adapter) + 2 * int(head)
    return trainable.get(convention)


def records_frame(records: list[RunRecord], *, drop: set[str], params: str) -> tuple[pd.DataFrame, list[dict]]:
    """One line per record: its group (the config without ``drop``; before-fine-tuning runs also pool over
    TRAINING_ONLY_KEYS), task, seed, status, value (nan without one), #Param and majority-class score; and each
    group's config (indexed by the frame's ``group``)."""
    group_ids: dict[tuple, int] = {}
    configs: list[dict] = []
    lines = []
    for rec in records:
        left_out = set(drop) | (set(TRAINING_ONLY_KEYS) if rec.before else set())
        config = {k: v for k, v in rec.config.items() if k not in left_out}
        frozen = (rec.before, tuple(sorted((k, hashable(v)) for k, v in config.items())))
        if frozen not in group_ids:
            group_ids[frozen] = len(configs)
            configs.append(config)
        result = rec.result or {}
        count = param_count(result.get("trainable_params"), params, rec.config.get("method")) \
            if rec.result and not rec.before else None
        # a pruned trial stopped after a few epochs: not a full run, whatever status it ended with
        lines.append({"group": group_ids[frozen], "before": rec.before, "task": rec.task, "seed": rec.seed,
                      "status": "pruned" if is_pruned(rec) else rec.status,
                      "value": math.nan if rec.value is None else rec.value, "params": count,
                      "majority": majority_value(rec)})
    return pd.DataFrame(lines), configs


def require_one_test_set(records: list[RunRecord]) -> None:
    """Runs of one task scored on different evaluation examples cannot be compared (result.json
    ``eval_examples_digest``: the dev / test examples each run was scored on); refused in one line."""
    digests: dict[str, Counter] = {}
    for rec in records:
        if digest := (rec.result or {}).get("eval_examples_digest"):
            digests.setdefault(rec.task, Counter())[digest] += 1
    for task, by_digest in digests.items():
        if len(by_digest) > 1:
            counts = ", ".join(f"{n} runs on {d}" for d, n in by_digest.most_common())
            raise PeftlabError(f"the {task} runs were scored on different test examples ({counts}): their numbers "
                               "cannot be compared", fix="select runs scored on the same examples with --where "
                               "(e.g. max_eval_samples=..., eval_seed=...), or rerun them on one test split")


def majority_value(rec: RunRecord) -> float | None:
    """The run's majority-class score, when it scores the reported metric of a GLUE-style task."""
    from peftlab.tasks.table import find_task

    result = rec.result or {}
    # the config's task, not rec.task: a user task's column is named after its data (tickets), not "classify"
    value, task = result.get("majority_baseline"), find_task(str(rec.config.get("task")))
    if (value is None or task is None or task.kind not in MAJORITY_KINDS
            or rec.metric != result.get("primary_metric", task.primary_metric)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def majority_row(frame: pd.DataFrame) -> tuple[Row | None, list[tuple]]:
    """The majority-class row (None when no task has one: :func:`majority_value`) and the ``(task, lowest,
    highest)`` of the tasks whose runs disagree (different dev examples)."""
    scores = frame.dropna(subset=["majority"]).groupby("task", sort=False)["majority"].agg(list)
    if scores.empty:
        return None, []
    row = Row(config={}, label={}, majority=True, name=MAJORITY,
              cells={task: Cell(values=[float(v) for v in values]) for task, values in scores.items()})
    differ = [(task, min(cell.values), max(cell.values)) for task, cell in row.cells.items()
              if min(cell.values) != max(cell.values)]
    return row, differ


def grouped_rows(frame: pd.DataFrame, configs: list[dict]) -> list[Row]:
    """One :class:`Row` per group of ``frame`` (in run order), its cells filled in run order by
    :meth:`Cell.add_run`, and its #Param counts (trained rows only)."""
    # identical untrained models repeated across a training grid count once per seed
    frame = frame[~(frame["before"] & frame.duplicated(["group", "task", "seed"]))]
    groups = {gid: Row(config=configs[gid], label={}, before=bool(before))
              for gid, before in frame.groupby("group", sort=False)["before"].first().items()}
    for line in frame.itertuples(index=False):
        groups[line.group].cells.setdefault(line.task, Cell()).add_run(line.status, line.seed, line.value)
    trained_frame = frame[~frame["before"]]
    for gid, counts in trained_frame.groupby("group", sort=False)["params"].agg(lambda s: set(s.dropna())).items():
        groups[gid].params = {int(c) for c in counts}
    return list(groups.values())


def labelled_rows(rows: list[Row], method_order: list[str]) -> tuple[list[Row], list[Row], list[str]]:
    """The before-fine-tuning rows and the trained rows, labelled by the keys their configs vary in and sorted
    (methods in ``method_order``, the sweep's grid order; other keys by value); and those label keys."""
    trained_rows = [r for r in rows if not r.before]
    before_rows = [r for r in rows if r.before]
    label_keys = varying_keys([r.config for r in trained_rows])
    if not label_keys and trained_rows:  # a single row still says what it is
        label_keys = ["method"]
    for row in trained_rows:
        row.label = {k: row.config.get(k) for k in label_keys}
    before_keys = varying_keys([r.config for r in before_rows])
    for row in before_rows:
        extra = ", ".join(f"{k}={fmt_value(row.config.get(k))}" for k in before_keys)
        row.name = "before fine-tuning" + (f" ({extra})" if extra else "")
        row.label = {k: None for k in label_keys}
    trained_rows.sort(key=lambda r: tuple(sort_value(k, r.label.get(k), method_order) for k in label_keys))
    before_rows.sort(key=lambda r: r.name)
    return before_rows, trained_rows, label_keys


def sort_value(key: str, value, method_order: list[str]):
    if key == "method":
        return (0, method_order.index(str(value)) if str(value) in method_order else len(method_order), str(value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0, str(value))
