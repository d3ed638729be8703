"""One report table recomputed without report's code path: the store read with sqlite3 + json, the rows matched by
the CSV's label columns, the seeds paired by hand, and the paired t-test's p-value and 95 % CI computed with plain
numpy (the t distribution integrated numerically; no scipy). Every finished run is paired at its value, also those
labelled no_learning, collapsed or diverged; where one is in the pairs, the comparison without them (the CSV's
``_without_labels`` columns) is recomputed too. Any mismatch with `peftlab report --format csv` fails.

``CASES`` lists the tables checked. The first builds a small store here; a committed study store is checked by
adding a case naming it (path relative to the repository root), its baseline, --where and --seeds, e.g.
``Case("docs/study/lambda/results.sqlite", "lr=0.001,lr_ratio=1,targets=q,v", "task=stsb,epochs=2", HELDOUT)``.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from peftlab.cli.main import main
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.lab.store import Store
from fake_results import checked  # noqa: E402 - tests/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
BUILT = "built here"


@dataclass(frozen=True)
class Case:
    store: str  # relative to the repository root, or BUILT
    baseline: str
    where: str = ""  # --where K=V,...: applied by report, and here by hand to the runs read with sqlite3
    seeds: tuple[int, ...] = ()  # --seeds: likewise
    at_least: int = 4  # comparisons the table must hold (so that a case that compares nothing fails)

    @property
    def flags(self) -> list[str]:
        return ([*("--where", self.where)] if self.where else []) + \
            (["--seeds", ",".join(map(str, self.seeds))] if self.seeds else [])

    def keeps(self, config: dict) -> bool:
        pairs = [piece.split("=", 1) for piece in self.where.split(",") if piece]
        return all(label(config.get(k)) == v for k, v in pairs) and \
            (not self.seeds or int(config.get("seed", 0)) in self.seeds)


LAMBDA_STUDY = "docs/study/lambda/results.sqlite"  # the redone study of docs/RESULTS.md
KASA_STUDY = "docs/study/kasa/results.sqlite"  # its head and paper-KaSA rows hold no_learning seeds
HELDOUT = tuple(range(100, 110))
FINISHED = ("ok", "no_learning", "collapsed", "diverged")  # paired at their value; failed and pruned are not
CASES = [Case(BUILT, "method=lora,lr_ratio=1"),
         Case(LAMBDA_STUDY, "lr=0.001,lr_ratio=1,targets=q,v", "task=stsb,epochs=2", HELDOUT, at_least=3),
         Case(LAMBDA_STUDY, "lr=0.008,lr_ratio=1,targets=q,v", "task=sst2,epochs=2", HELDOUT, at_least=3),
         Case(KASA_STUDY, "method=lora", "task=stsb,epochs=2", HELDOUT, at_least=4)]


# --------------------------------------------------------------------------- the store built here


def build_store(path: Path) -> Path:
    """Three configs x two tasks; seeds shared (0-3), except that kasa misses seed 3 (3 pairs there)."""
    rng = np.random.default_rng(7)
    seed_effect = {seed: rng.normal(0, 0.03) for seed in range(4)}  # what pairs the rows
    shift = {("lora", 1.0): 0.0, ("lora", 4.0): 0.012, ("kasa", 1.0): -0.006}
    with Store(path) as store:
        for (method, ratio), delta in shift.items():
            for task, level in (("rte", 0.65), ("mrpc", 0.80)):
                for seed in range(3 if method == "kasa" else 4):
                    cfg = build_run_config(overrides=dict(model="tiny-bert", task=task, method=method,
                                                                   lr_ratio=ratio, seed=seed, epochs=2)).to_dict()
                    value = float(level + delta + seed_effect[seed] + rng.normal(0, 0.004))
                    store.add(cfg, result=checked({
                        "status": "ok", "config": cfg, "primary_metric": "accuracy",
                        "majority_baseline": {"rte": 0.527, "mrpc": 0.684}[task], "best": {"epoch": 2, "metrics": {
                            "accuracy": value}}, "final": {"metrics": {"accuracy": value}},
                        "trainable_params": {"adapter": 1000, "head": 600, "total": 1600}}))
    return path


# --------------------------------------------------------------------------- plain numpy


def t_two_sided_p(t: float, df: int) -> float:
    """2 P(T > |t|) for Student's t with ``df`` degrees of freedom: the density integrated from |t| to infinity
    by Simpson's rule after x = tan(theta), where it reads c cos^(df-1) (cos^2 + sin^2 / df)^(-(df+1)/2)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    theta = np.linspace(math.atan(abs(t)), math.pi / 2, 20_001)
    cos, sin = np.cos(theta), np.sin(theta)
    density = c * cos ** (df - 1) * (cos ** 2 + sin ** 2 / df) ** (-(df + 1) / 2)
    h = theta[1] - theta[0]
    tail = h / 3 * (density[0] + density[-1] + 4 * density[1:-1:2].sum() + 2 * density[2:-1:2].sum())
    return float(2 * tail)


@functools.lru_cache(maxsize=None)
def t_critical(df: int, level: float = 0.95) -> float:
    """The t with two-sided p = 1 - level, by bisection."""
    low, high = 0.0, 1000.0
    for _ in range(64):
        middle = (low + high) / 2
        low, high = (middle, high) if t_two_sided_p(middle, df) > 1 - level else (low, middle)
    return (low + high) / 2


def label(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def store_runs(path: Path) -> list[tuple[dict, dict]]:
    """(config, result) of the finished, complete runs (ok or labelled), read with sqlite3 and json only."""
    with sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT status, config, result FROM runs").fetchall()
    runs = []
    for status, config, result in rows:
        result = json.loads(result) if result else None
        if status in FINISHED and result and not result.get("stopped_early"):
            config = result.get("config") or json.loads(config)
            if int(config.get("epochs", 1)) > 0:
                runs.append((config, result))
    return runs


def per_seed(runs, labels: dict[str, str], task: str, ok_only: bool = False) -> dict[int, float]:
    out = {}
    for config, result in runs:
        if ok_only and result["status"] != "ok":
            continue
        if config["task"] == task and all(label(config.get(k)) == v for k, v in labels.items()):
            seed = int(config.get("seed", 0))
            assert seed not in out, f"two runs of {labels} {task} at seed {seed}: pairing is ambiguous"
            out[seed] = float(result["best"]["metrics"][result["primary_metric"]])
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.store)
def test_paired_p_values_and_cis_recomputed_with_numpy(case, tmp_path, capsys):
    path = build_store(tmp_path / "results.sqlite") if case.store == BUILT else ROOT / case.store
    out = tmp_path / "table.csv"
    assert main(["report", str(path), "--baseline", case.baseline, "--test", "paired", "--correction", "none",
                 "--scale", "1", "--format", "csv", "--out", str(out), *case.flags]) == 0
    lines = list(csv.DictReader(io.StringIO(out.read_text())))
    head = list(lines[0])
    label_keys = head[:head.index("before_fine_tuning")]
    tasks = [name[:-len("_mean")] for name in head if name.endswith("_mean")]
    runs = [(config, result) for config, result in store_runs(path) if case.keeps(config)]
    base_line = next(line for line in lines if line["baseline"] == "1")
    base_labels = {k: base_line[k] for k in label_keys}
    checked = sensitive = 0
    for line in lines:
        if line["baseline"] == "1" or line["before_fine_tuning"] == "1":
            continue
        labels = {k: line[k] for k in label_keys}
        for task in tasks:
            if not line[f"{task}_p"]:
                continue
            n, mean, low, high, p = paired_t(per_seed(runs, labels, task), per_seed(runs, base_labels, task))
            assert int(line[f"{task}_n_pairs"]) == n, (labels, task)
            assert float(line[f"{task}_diff"]) == pytest.approx(mean, rel=1e-9, abs=1e-12), (labels, task)
            assert float(line[f"{task}_ci_low"]) == pytest.approx(low, rel=1e-6, abs=1e-9), (labels, task)
            assert float(line[f"{task}_ci_high"]) == pytest.approx(high, rel=1e-6, abs=1e-9), (labels, task)
            assert float(line[f"{task}_p"]) == pytest.approx(p, rel=1e-6, abs=1e-12), (labels, task)
            if line[f"{task}_p_without_labels"]:  # labelled runs in the pairs: the same test without them
                n, mean, _, _, p = paired_t(per_seed(runs, labels, task, ok_only=True),
                                            per_seed(runs, base_labels, task, ok_only=True))
                assert int(line[f"{task}_n_pairs_without_labels"]) == n, (labels, task)
                assert float(line[f"{task}_diff_without_labels"]) == pytest.approx(mean, rel=1e-9, abs=1e-12)
                assert float(line[f"{task}_p_without_labels"]) == pytest.approx(p, rel=1e-6, abs=1e-12)
                sensitive += 1
            checked += 1
    assert checked >= case.at_least  # the case really compares something
    if case.store == KASA_STUDY:  # head (7 no_learning) and paper-KaSA (4) against LoRA
        assert sensitive == 2
    if case.store == BUILT:
        assert checked == 4 and {line["rte_n_pairs"] for line in lines if line["method"] == "kasa"} == {"3"}


def paired_t(mine: dict[int, float], base: dict[int, float]) -> tuple[int, float, float, float, float]:
    """Pairs, mean difference, its 95 % t interval and the two-sided p, over the seeds both ran."""
    seeds = sorted(set(mine) & set(base))
    d = np.array([mine[s] - base[s] for s in seeds])
    n = len(d)
    mean = d.sum() / n
    sd = math.sqrt(((d - mean) ** 2).sum() / (n - 1))
    half = t_critical(n - 1) * sd / math.sqrt(n)
    return n, mean, mean - half, mean + half, t_two_sided_p(mean / (sd / math.sqrt(n)), n - 1)
