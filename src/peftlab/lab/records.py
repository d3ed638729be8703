"""Run records: the one place that collects what reports and plots read.

A *row* is one run as a results store holds it, from a store or a ``peftlab train`` run folder (:func:`load_rows`);
a :class:`RunRecord` is a finished (or failed) row with the reported metric picked out (:func:`collect`). A table or
figure reads a run from its record or the task table (:mod:`peftlab.tasks.table`), never from method or model code.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from peftlab.config import ROLES
from peftlab.errors import PeftlabError, closest
from peftlab.lab.store import STORE_NAME, Store, config_key, resolve_store_path
from peftlab.lab.store_schema import (
    COLUMNS, FINISHED, RESULT_STATUSES, epochs_run, implied_status, is_pruned_result, pruned_key)

RUN_RESULT = "result.json"  # a run folder written by ``peftlab train``
RUN_CONFIG = "config.yaml"
SOURCE_FIX = ("pass a sweep's results.sqlite (or its output folder), or run folders written by peftlab train "
              "(holding result.json), e.g. runs/*/")

# From the config's declarations (peftlab.config_roles): keys that never distinguish rows; keys that cannot change
# an untrained model's metrics (the before-fine-tuning rows pool over them); the order of varying label columns.
NON_RESULT_KEYS = ROLES.not_report_rows
TRAINING_ONLY_KEYS = ROLES.training_only
LABEL_ORDER = ROLES.label_order
UNSCALED_HINTS = ("loss", "perplexity", "ppl", "mt_bench")  # mt_bench_*: judge scores on a 1-10 scale
LM_EVAL_PREFIX = "lm_eval/"  # --metric lm_eval/<task>/<metric>: lm-evaluation-harness's numbers (lm_eval_value)


# --------------------------------------------------------------------------- rows: stores and run folders


def load_rows(paths: Iterable[str | os.PathLike]) -> list[dict]:
    """Rows of stores (or the folders holding them) and ``peftlab train`` run folders; of a key present in
    several, the finished row wins, and a complete run wins over a pruned trial older stores kept under its key."""
    merged: dict[str, dict] = {}
    for path in paths:
        for row in _source_rows(Path(path)):
            old = merged.get(row["key"])
            if old is None or (old["status"] not in FINISHED and row["status"] in FINISHED) or (
                    pruned_status(old["status"], old["result"]) and row["status"] in FINISHED
                    and not pruned_status(row["status"], row["result"])):
                merged[row["key"]] = row
    return list(merged.values())


def _source_rows(path: Path) -> list[dict]:
    if not path.exists():
        raise PeftlabError(f"results store not found: {path}", fix=SOURCE_FIX)
    if path.is_dir() and not (path / STORE_NAME).is_file():
        if (path / RUN_RESULT).is_file() or (path / RUN_CONFIG).is_file():
            return [run_folder_row(path)]
        raise PeftlabError(f"{path} is neither a results store nor a run folder "
                           f"(no {STORE_NAME}, {RUN_RESULT} or {RUN_CONFIG} in it)", fix=SOURCE_FIX)
    with Store(resolve_store_path(path), create=False) as store:
        return store.rows()


def run_folder_row(path: str | os.PathLike) -> dict:
    """One run folder as a store row, keyed by its result.json's config (else config.yaml's); without a
    result.json yet it is an unfinished ('running') run."""
    path = Path(path)
    result_file, config_file = path / RUN_RESULT, path / RUN_CONFIG
    result = None
    if result_file.is_file():
        try:
            result = json.loads(result_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PeftlabError(f"cannot read {result_file}: {err}",
                               fix="rerun the run (peftlab train --resume); result.json is written last") from None
        if not isinstance(result, dict):
            raise PeftlabError(f"{result_file} is not a JSON object", fix="pass a run folder written by peftlab train")
    config = (result or {}).get("config")
    if not isinstance(config, dict) and config_file.is_file():
        import yaml

        try:
            config = yaml.safe_load(config_file.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            raise PeftlabError(f"cannot read {config_file}: {err}", fix="pass a run folder written by peftlab train") \
                from None
    if not isinstance(config, dict):
        raise PeftlabError(f"no run config in {path}: neither a 'config' in {RUN_RESULT} nor a {RUN_CONFIG}",
                           fix="pass a run folder written by peftlab train")
    # no result yet: started (config.yaml is written first), not finished, so counted as unfinished
    status = "running" if result is None else implied_status(result)
    if status is None:
        raise PeftlabError(f"{result_file} has status {result.get('status')!r}, not {'/'.join(RESULT_STATUSES)}",
                           fix="pass finished run folders written by peftlab train")
    key = config_key(config)
    if is_pruned_result(result):  # a pruned trial's folder: never the key of the complete run of its config
        key = pruned_key(key, epochs_run(result))
    return dict.fromkeys(COLUMNS) | {
        "key": key, "status": status, "config": config, "result": result, "output_dir": str(path), "attempts": 1,
        "seconds": (result or {}).get("train_seconds"),
        "error": (result or {}).get("status_reason") if status == "failed" else None}


# --------------------------------------------------------------------------- key=value filters


def parse_filter(text: str | None, *, what: str = "--where") -> dict[str, Any]:
    """``"method=lora,targets=q,k,v,lr_ratio=1"`` -> ``{"method": "lora", "targets": "q,k,v", "lr_ratio": 1.0}``:
    a piece without ``=`` continues the previous value; values are typed and checked like the config's."""
    if not text or not text.strip():
        return {}
    from peftlab.config import TrainConfig, normalise_keys, option_names

    names = option_names(TrainConfig)  # flat, as config.yaml spells them (kasa_beta)
    pairs: list[list[str]] = []
    for piece in text.split(","):
        if "=" in piece:
            key, _, value = piece.partition("=")
            pairs.append([key.strip().replace("-", "_"), value.strip()])
        elif pairs and piece.strip():
            pairs[-1][1] += "," + piece.strip()
        elif piece.strip():
            raise PeftlabError(f"{what} '{text}': '{piece}' is not key=value",
                               fix=f'e.g. {what} "method=lora,lr_ratio=2"')
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key not in names:
            raise PeftlabError(f"unknown config key '{key}' in {what}{closest(key, names)}",
                               fix="use keys of `peftlab train --help` (method, targets, rank, lr, lr_ratio, task...)")
        typed = normalise_keys(TrainConfig, {key: value}, what)[key]
        if key == "targets":  # the config's canonical order (q,k,v,o,...), checked like --targets
            typed = ",".join(TrainConfig(targets=typed).targets)
        out[key] = typed
    return out


def _target_set(value) -> frozenset[str]:
    items = value.split(",") if isinstance(value, str) else value
    return frozenset(str(t).strip().lower() for t in items if str(t).strip())


def _same(key: str, have, value) -> bool:
    if key == "targets" and have is not None and value is not None:
        return _target_set(have) == _target_set(value)  # a projection set: order never matters
    if isinstance(value, float) and isinstance(have, (int, float)) and not isinstance(have, bool):
        return math.isclose(float(have), value, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(value, str) and isinstance(have, str):
        return have.lower() == value.lower()
    return have == value


def matches(config: dict, wanted: dict[str, Any]) -> bool:
    return all(_same(key, config.get(key), value) for key, value in wanted.items())


# --------------------------------------------------------------------------- records


@dataclass
class RunRecord:
    key: str
    status: str
    config: dict
    result: dict | None
    task: str
    seed: int
    metric: str | None
    value: float | None
    before: bool  # an epochs-0 run: the untrained model


def collect(rows: Iterable[dict], *, which: str = "best", metric: str | None = None,
            where: dict[str, Any] | None = None) -> tuple[list[RunRecord], Counter]:
    """Finished/failed runs as records; also counts of the rows left out (pending, running). A record's task is
    its column's name: the task, or for a user task (classify, regress) its file's or dataset's name."""
    from peftlab.tasks.table import task_label

    records, skipped = [], Counter()
    for row in rows:
        config = (row["result"] or {}).get("config") or row["config"] or {}
        before = int(config.get("epochs", 1)) == 0
        if where:  # the before-fine-tuning reference ignores filters on settings that only affect training
            wanted = {k: v for k, v in where.items() if not (before and k in TRAINING_ONLY_KEYS)}
            if not matches(config, wanted):
                continue
        if row["status"] in ("pending", "running"):
            skipped[row["status"]] += 1
            continue
        result = row["result"]
        name, value = None, None
        if result:
            name = metric or result.get("primary_metric")
            section = ((result.get("before") or result.get("final")) if before else result.get(which)) or {}
            value = (lm_eval_value(result, name) if str(name).startswith(LM_EVAL_PREFIX)
                     else (section.get("metrics") or {}).get(name))
            if value is not None:
                value = float(value)
        records.append(RunRecord(key=row["key"], status=row["status"], config=config, result=result,
                                 task=task_label(config), seed=int(config.get("seed", 0)), metric=name,
                                 value=value, before=before))
    return records, skipped


def lm_eval_value(result: dict, path: str):
    """``--metric lm_eval/<task>/<metric>``: the harness's number in result.json's ``lm_eval`` section, or None
    (it scores the weights adapter/ holds, so --which best and final alike)."""
    task, _, metric = path[len(LM_EVAL_PREFIX):].partition("/")
    return (((result.get("lm_eval") or {}).get("results") or {}).get(task) or {}).get(metric)


def pruned_status(status: str, result: dict | None) -> bool:
    """A tune trial stopped before its last epoch (also as older stores recorded it: lab/store_schema)."""
    return status == "pruned" or (status != "failed" and is_pruned_result(result))


def is_pruned(rec: RunRecord) -> bool:
    return pruned_status(rec.status, rec.result)


def run_identity(rec: RunRecord) -> tuple:
    """What a run computes: its config without bookkeeping, with task and seed."""
    return rec.task, rec.seed, hashable({k: v for k, v in rec.config.items() if k not in NON_RESULT_KEYS})


def drop_superseded_pruned(records: list[RunRecord]) -> tuple[list[RunRecord], int]:
    """The records without the pruned trials whose config and seed also have a complete run, and how many were
    dropped. A pruned trial alone stays (counted, never averaged)."""
    complete = {run_identity(rec) for rec in records if not is_pruned(rec)}
    kept = [rec for rec in records if not (is_pruned(rec) and run_identity(rec) in complete)]
    return kept, len(records) - len(kept)


# --------------------------------------------------------------------------- what varies across records


def hashable(value):
    """A config value usable as a dict key or set member (YAML/JSON lists and mappings become tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((k, hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    return value


def fmt_value(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def varying_keys(configs: list[dict]) -> list[str]:
    """Keys whose value differs between ``configs``: LABEL_ORDER first, then alphabetically."""
    keys = sorted({k for c in configs for k in c})
    varying = [k for k in keys if len({hashable(c.get(k)) for c in configs}) > 1]
    ordered = [k for k in LABEL_ORDER if k in varying]
    return ordered + [k for k in varying if k not in ordered]


def task_determined_keys(records: list[RunRecord]) -> dict[str, dict[str, Any]]:
    """Keys that take one value per task but differ across tasks (per-task settings): key -> {task: value}."""
    tasks = {rec.task for rec in records}
    if len(tasks) < 2:
        return {}
    by_key: dict[str, dict[str, set]] = {}
    for rec in records:
        for key, value in rec.config.items():
            if key not in NON_RESULT_KEYS:
                by_key.setdefault(key, {}).setdefault(rec.task, set()).add(hashable(value))
    out = {}
    for key, per_task in sorted(by_key.items()):
        one_per_task = per_task.keys() == tasks and all(len(values) == 1 for values in per_task.values())
        if one_per_task and len({next(iter(v)) for v in per_task.values()}) > 1:
            out[key] = {task: next(iter(values)) for task, values in per_task.items()}
    return out


def task_order(tasks: Iterable[str]) -> list[str]:
    """Tasks in the task table's (GLUE) order, unknown ones after, alphabetically."""
    from peftlab.tasks.table import TASK_NAMES

    order = list(TASK_NAMES)
    return sorted(set(tasks), key=lambda t: (order.index(t) if t in order else len(order), t))


def auto_scale(metric_names: Iterable[str]) -> float:
    """100 (percent) when every metric is accuracy-like; 1 when any is a loss or perplexity."""
    names = [m for m in metric_names if m]
    if names and all(not any(h in m.lower() for h in UNSCALED_HINTS) for m in names):
        return 100.0
    return 1.0


def parse_seeds(text: str) -> list[tuple[int, int]]:
    """``"100-109,3"`` -> [(100, 109), (3, 3)]: ``--seeds`` of report and plot (inclusive ranges, never expanded)."""
    seeds: list[tuple[int, int]] = []
    for piece in (p.strip() for p in text.split(",")):
        low, dash, high = piece.partition("-")
        try:
            first, last = int(low), int(high) if dash else int(low)
        except ValueError:
            raise PeftlabError(f"--seeds '{text}': '{piece}' is not a seed or a range A-B",
                               fix="e.g. --seeds 100-109 or --seeds 0,1,2") from None
        if first < 0 or last < first:
            raise PeftlabError(f"--seeds '{text}': '{piece}' is not a range of seeds >= 0 (A-B with A <= B)",
                               fix="e.g. --seeds 100-109")
        seeds.append((first, last))
    return seeds


def rows_of_seeds(rows: Iterable[dict], seeds: list[tuple[int, int]]) -> list[dict]:
    """The rows whose config's seed lies in one of the inclusive ``seeds`` ranges (:func:`parse_seeds`)."""
    return [row for row in rows if any(lo <= int((row.get("config") or {}).get("seed", 0)) <= hi for lo, hi in seeds)]
