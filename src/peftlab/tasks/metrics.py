"""Task metrics, computed with scikit-learn and SciPy (the GLUE benchmark's definitions), and chance levels.

A GLUE task reports the metrics of its row (``Task.metrics``) and, where there are two, their mean ``combined``;
a user task gets every metric its ``--metric`` may pick. A correlation undefined because one side is constant
(an untrained regressor) is 0.0, its chance level, not NaN, so model selection never compares against NaN.
"""

from __future__ import annotations

import warnings

import numpy as np

from peftlab.tasks.table import Task


def _correlation(fn, x: np.ndarray, y: np.ndarray) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy's ConstantInputWarning
        value = float(fn(x, y)[0])
    return 0.0 if np.isnan(value) else value


def compute_label_metrics(kind: str, predictions, labels, num_labels: int = 1) -> dict[str, float]:
    """Every metric of ``kind`` (classification or regression) of ``predictions`` (logits ``(N, C)`` or class ids;
    scores ``(N,)`` or ``(N, 1)``) against ``labels``: accuracy, f1_macro, matthews_correlation and, with
    ``num_labels`` 2, f1 (binary, class id 1 positive); or pearson and spearman."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    predictions = np.asarray(predictions)
    labels = np.asarray(labels).reshape(-1)
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions but {len(labels)} labels")
    if len(labels) == 0:
        raise ValueError("no examples to evaluate")
    if kind == "regression":
        if predictions.ndim > 2 or predictions.shape[1:] not in ((), (1,)):
            raise ValueError(f"regression predictions must have shape (N,) or (N, 1), got {predictions.shape}")
        scores, gold = predictions.reshape(-1).astype(np.float64), labels.astype(np.float64)
        return {"pearson": _correlation(pearsonr, scores, gold), "spearman": _correlation(spearmanr, scores, gold)}
    if predictions.ndim != 2 and not (predictions.ndim == 1 and np.issubdtype(predictions.dtype, np.integer)):
        raise ValueError(f"classification predictions must be logits (N, C) or class ids, got {predictions.shape}")
    pred, gold = predictions.argmax(axis=-1) if predictions.ndim == 2 else predictions, labels.astype(np.int64)
    out = {"accuracy": float(accuracy_score(gold, pred)),
           "f1_macro": float(f1_score(gold, pred, average="macro", zero_division=0)),
           "matthews_correlation": float(matthews_corrcoef(gold, pred))}
    if num_labels == 2:
        out["f1"] = float(f1_score(gold, pred, pos_label=1, average="binary", zero_division=0))
    return out


def compute_metrics(task: Task, predictions, labels) -> dict[str, float]:
    """A GLUE task's metrics (its row's ``metrics``, and ``combined`` = their mean where there are two) of
    ``predictions`` (logits ``(N, C)``; STS-B scores ``(N,)`` or ``(N, 1)``) against ``labels``."""
    if not task.glue_dir:
        raise ValueError(f"compute_metrics handles GLUE tasks; '{task.name}' is a {task.kind} task")
    every = compute_label_metrics(task.kind, predictions, labels, task.num_labels)
    out = {name: every[name] for name in task.reported_metrics}
    if len(out) == 2:
        out["combined"] = sum(out.values()) / 2
    return out


def chance_level(kind: str, metric: str, eval_labels, num_labels: int) -> float:
    """The chance level a run must clear (result.json ``majority_baseline``): ``metric`` of predicting the *eval*
    set's most frequent class (ties: the lowest id) for every eval example, computed by
    :func:`compute_label_metrics` itself; 0.0 for regression and for an empty set.

    The one chance definition for every task: the eval set's own majority is the bar a model must clear on that
    set (the most frequent *training* class can understate it on small subsets: 0.375 where the eval set's majority
    scores 0.625). Matthews correlation of a constant prediction is 0.0; F1 is that of the majority class as
    positive. Committed stores keep the values their runs recorded (reports read result.json, never this)."""
    if kind == "regression":
        return 0.0
    evals = np.asarray(list(eval_labels), dtype=np.int64)
    if evals.size == 0:
        return 0.0
    majority = int(np.bincount(evals, minlength=num_labels).argmax())
    constant = np.zeros((len(evals), max(num_labels, majority + 1)))
    constant[:, majority] = 1.0  # logits that always pick the majority class
    return compute_label_metrics(kind, constant, evals, num_labels)[metric]
