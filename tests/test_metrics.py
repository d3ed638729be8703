"""peftlab.tasks.metrics: GLUE metric definitions against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from peftlab.errors import PeftlabError
from peftlab.tasks.metrics import compute_metrics
from peftlab.tasks.table import GLUE_TASKS, TASKS, task as registered


def logits_for(classes, num_classes: int = 2) -> np.ndarray:
    """Logits whose argmax is ``classes``."""
    out = np.zeros((len(classes), num_classes), dtype=np.float32)
    out[np.arange(len(classes)), classes] = 1.0
    return out


def test_cola_matthews_hand_computed():
    # labels 1,1,0,0; predictions 1,0,0,0: TP=1 TN=2 FP=0 FN=1
    # MCC = (1*2 - 0*1) / sqrt((1+0)(1+1)(2+0)(2+1)) = 2/sqrt(12)
    out = compute_metrics(registered("cola"), logits_for([1, 0, 0, 0]), np.array([1, 1, 0, 0]))
    assert out == {"matthews_correlation": pytest.approx(2 / math.sqrt(12))}
    assert compute_metrics(registered("cola"), logits_for([1, 0, 1]), np.array([1, 0, 1]))["matthews_correlation"] == 1.0
    assert compute_metrics(registered("cola"), logits_for([0, 1]), np.array([1, 0]))["matthews_correlation"] == -1.0
    # a constant prediction has no correlation
    assert compute_metrics(registered("cola"), logits_for([1, 1, 1]), np.array([1, 0, 1]))["matthews_correlation"] == 0.0


def test_mrpc_accuracy_f1_combined():
    # labels 1,1,1,0; predictions 1,1,0,1: acc 2/4; TP=2 FP=1 FN=1 -> F1 = 4/6
    out = compute_metrics(registered("mrpc"), logits_for([1, 1, 0, 1]), np.array([1, 1, 1, 0]))
    assert out == {"accuracy": pytest.approx(0.5), "f1": pytest.approx(2 / 3), "combined": pytest.approx(7 / 12)}
    # no positive predictions: F1 is 0, not a warning-and-NaN
    assert compute_metrics(registered("qqp"), logits_for([0, 0]), np.array([1, 0]))["f1"] == 0.0


def test_stsb_pearson_spearman():
    # x = 1,2,3; y = 1,2,4: r = 3 / (sqrt(2) * sqrt(42)/3) = 9/sqrt(84); ranks agree -> spearman 1
    x, y = np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 4.0])
    out = compute_metrics(registered("stsb"), x, y)
    assert out["pearson"] == pytest.approx(9 / math.sqrt(84))
    assert out["spearman"] == pytest.approx(1.0)
    assert out["combined"] == pytest.approx((9 / math.sqrt(84) + 1) / 2)
    assert compute_metrics(registered("stsb"), x.reshape(-1, 1).astype(np.float32), y) == pytest.approx(out)
    reverse = compute_metrics(registered("stsb"), np.array([3.0, 2.0, 1.0]), np.array([1.0, 2.0, 3.0]))
    assert reverse["pearson"] == pytest.approx(-1.0) and reverse["spearman"] == pytest.approx(-1.0)
    # an untrained regressor predicting a constant: undefined correlation reported as 0.0 (chance)
    flat = compute_metrics(registered("stsb"), np.full((4, 1), 2.5), np.array([0.0, 1.0, 2.0, 5.0]))
    assert flat == {"pearson": 0.0, "spearman": 0.0, "combined": 0.0}


@pytest.mark.parametrize("task", ["sst2", "rte", "qnli", "wnli"])
def test_accuracy_tasks(task):
    out = compute_metrics(registered(task), logits_for([0, 1, 1, 0, 1]), np.array([0, 1, 0, 0, 0]))
    assert out == {"accuracy": pytest.approx(0.6)}


def test_mnli_three_classes_and_class_ids():
    logits = np.array([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0], [0.0, 0.5, 0.4], [0.1, 0.2, 0.3]])
    assert compute_metrics(registered("mnli"), logits, np.array([0, 1, 2, 2])) == {"accuracy": pytest.approx(0.75)}
    assert compute_metrics(registered("mnli"), np.array([0, 1, 1, 2]), np.array([0, 1, 2, 2]))["accuracy"] == pytest.approx(0.75)


def test_returns_plain_floats():
    for task in GLUE_TASKS:
        preds = np.array([0.1, 0.9, 0.4]) if task == "stsb" else logits_for([0, 1, 1], TASKS[task].num_labels)
        labels = np.array([0.0, 5.0, 2.0]) if task == "stsb" else np.array([0, 1, 0])
        out = compute_metrics(registered(task), preds, labels)
        assert registered(task).primary_metric in out
        assert all(type(v) is float for v in out.values())


def test_primary_metric_of_each_row():
    assert registered("cola").primary_metric == "matthews_correlation"
    assert registered("stsb").primary_metric == "pearson"
    assert registered("mrpc").primary_metric == "accuracy" and registered("mnli").primary_metric == "accuracy"
    with pytest.raises(PeftlabError, match="unknown task"):
        registered("colaa")


def test_errors():
    with pytest.raises(ValueError, match="2 predictions but 3 labels"):
        compute_metrics(registered("rte"), logits_for([0, 1]), np.array([0, 1, 1]))
    with pytest.raises(PeftlabError, match="did you mean 'sst2'"):
        registered("sst")
    with pytest.raises(ValueError):
        compute_metrics(registered("stsb"), np.zeros((3, 2)), np.zeros(3))
    with pytest.raises(ValueError):
        compute_metrics(registered("gsm8k"), np.zeros(1), np.zeros(1))
    with pytest.raises(ValueError):
        compute_metrics(registered("rte"), np.zeros((0, 2)), np.zeros(0))
