"""GLUE metrics, computed with scikit-learn and SciPy (the definitions of the GLUE benchmark).

* CoLA: ``matthews_correlation``
* STS-B: ``pearson``, ``spearman`` and ``combined`` (their mean)
* MRPC, QQP: ``accuracy``, ``f1`` (positive class 1) and ``combined`` (their mean)
* SST-2, MNLI, QNLI, RTE, WNLI: ``accuracy``

A correlation that is undefined because one side is constant (an untrained regressor predicting a constant)
is reported as 0.0, its chance level, rather than NaN, so model selection never compares against NaN.

The user's own tasks (``--task classify`` / ``regress``, :func:`compute_label_metrics`) get every metric their
``--metric`` may pick, with the same libraries: ``accuracy``, ``f1`` (binary: two classes, class id 1 positive),
``f1_macro`` and ``matthews_correlation``; ``pearson`` and ``spearman``. Their chance level
(:func:`constant_baseline`) is the metric of always predicting the most frequent training class.
"""

from __future__ import annotations

import warnings

import numpy as np

from peftlab.errors import unknown
from peftlab.tasks.table import TASKS


def primary(task: str) -> str:
    """The metric the papers' tables report for ``task``."""
    if task not in TASKS:
        raise unknown("task", task, TASKS)
    return TASKS[task].primary_metric


def _class_ids(predictions: np.ndarray) -> np.ndarray:
    if predictions.ndim == 2:
        return predictions.argmax(axis=-1)
    if predictions.ndim == 1 and np.issubdtype(predictions.dtype, np.integer):
        return predictions  # already class ids
    raise ValueError(f"classification predictions must be logits of shape (N, C) or class ids, got {predictions.shape}")


def _scores(predictions: np.ndarray) -> np.ndarray:
    if predictions.ndim == 2 and predictions.shape[1] == 1:
        return predictions[:, 0]
    if predictions.ndim == 1:
        return predictions
    raise ValueError(f"regression predictions must have shape (N,) or (N, 1), got {predictions.shape}")


def _correlation(fn, x: np.ndarray, y: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy's ConstantInputWarning
        value = float(fn(x, y)[0])
    return 0.0 if np.isnan(value) else value


def compute_metrics(task: str, predictions, labels) -> dict[str, float]:
    """GLUE metrics of ``predictions`` (logits ``(N, C)``; STS-B scores ``(N,)`` or ``(N, 1)``) against ``labels``."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    if task not in TASKS:
        raise unknown("task", task, TASKS)
    spec = TASKS[task]
    if not spec.glue_dir:
        raise ValueError(f"compute_metrics handles GLUE tasks; '{task}' is a {spec.kind} task")
    predictions = np.asarray(predictions)
    labels = np.asarray(labels).reshape(-1)
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions but {len(labels)} labels")
    if len(labels) == 0:
        raise ValueError("no examples to evaluate")

    if spec.kind == "regression":
        scores = _scores(predictions).astype(np.float64)
        gold = labels.astype(np.float64)
        p = _correlation(pearsonr, scores, gold)
        s = _correlation(spearmanr, scores, gold)
        return {"pearson": p, "spearman": s, "combined": (p + s) / 2}

    pred = _class_ids(predictions)
    gold = labels.astype(np.int64)
    if task == "cola":
        return {"matthews_correlation": float(matthews_corrcoef(gold, pred))}
    acc = float(accuracy_score(gold, pred))
    if task in ("mrpc", "qqp"):
        f1 = float(f1_score(gold, pred, pos_label=1, average="binary", zero_division=0))
        return {"accuracy": acc, "f1": f1, "combined": (acc + f1) / 2}
    return {"accuracy": acc}


def compute_label_metrics(kind: str, predictions, labels, num_labels: int = 1) -> dict[str, float]:
    """A user task's metrics (``kind``: classification or regression) of ``predictions`` (logits ``(N, C)`` or
    class ids; scores ``(N,)`` or ``(N, 1)``) against ``labels``: accuracy, f1_macro, matthews_correlation and,
    with ``num_labels`` 2, f1 (binary, class id 1 positive); or pearson and spearman."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    predictions = np.asarray(predictions)
    labels = np.asarray(labels).reshape(-1)
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions but {len(labels)} labels")
    if len(labels) == 0:
        raise ValueError("no examples to evaluate")
    if kind == "regression":
        scores, gold = _scores(predictions).astype(np.float64), labels.astype(np.float64)
        return {"pearson": _correlation(pearsonr, scores, gold), "spearman": _correlation(spearmanr, scores, gold)}
    pred, gold = _class_ids(predictions), labels.astype(np.int64)
    out = {"accuracy": float(accuracy_score(gold, pred)),
           "f1_macro": float(f1_score(gold, pred, average="macro", zero_division=0)),
           "matthews_correlation": float(matthews_corrcoef(gold, pred))}
    if num_labels == 2:
        out["f1"] = float(f1_score(gold, pred, pos_label=1, average="binary", zero_division=0))
    return out


def constant_baseline(kind: str, metric: str, train_labels, eval_labels, num_labels: int) -> float:
    """A user task's chance level: ``metric`` of predicting the most frequent *training* class (ties: the lowest
    id) for every eval example, computed by :func:`compute_label_metrics` itself; 0.0 for regression (a
    constant prediction has no correlation)."""
    if kind == "regression":
        return 0.0
    train = np.asarray(train_labels, dtype=np.int64)
    evals = np.asarray(eval_labels, dtype=np.int64)
    if train.size == 0 or evals.size == 0:
        return 0.0
    majority = int(np.bincount(train, minlength=num_labels).argmax())
    constant = np.zeros((len(evals), num_labels))
    constant[:, majority] = 1.0  # logits that always pick the majority class
    return compute_label_metrics(kind, constant, evals, num_labels)[metric]
