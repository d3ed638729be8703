"""A `peftlab tune` study opens in optuna-dashboard: its WSGI app, started in-process on the tune's Optuna
storage (``optuna-dashboard sqlite:///<output dir>/study.sqlite`` is the command), serves the trials the tune
ran, with their parameters, states and values, through its own HTTP API."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from wsgiref.util import setup_testing_defaults

import pytest

from peftlab.lab.tune.run import run_tune
from peftlab.lab.tune.spec import load_tune_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tune import FAKE, spec_for  # noqa: E402

import optuna_dashboard  # noqa: E402  (the test extra installs it: pip install "peftlab[dashboard]")


def get(app, path: str):
    environ: dict = {}
    setup_testing_defaults(environ)
    environ.update(PATH_INFO=path, REQUEST_METHOD="GET", QUERY_STRING="", **{"wsgi.input": io.BytesIO()})
    answer: dict = {}

    def start_response(status, headers, exc_info=None):
        answer["status"] = status

    body = b"".join(app(environ, start_response))
    assert answer["status"].startswith("200"), (path, answer["status"], body[:300])
    return json.loads(body)


def test_dashboard_reads_the_tunes_trials_through_its_api(tmp_path):
    tune = load_tune_spec(spec_for(tmp_path, search={"lr_ratio": [1, 2, 4, 8]}, seeds=2, top_k=1, heldout_seeds=0,
                                   budget={"epochs": 14}))
    summary = run_tune(tune, train_fn=FAKE, progress=False)
    app = optuna_dashboard.wsgi(f"sqlite:///{tune.study_path}")
    studies = get(app, "/api/studies")["study_summaries"]
    assert len(studies) == 1
    detail = get(app, f"/api/studies/{studies[0]['study_id']}")
    served = {json.dumps({p["name"]: float(p["param_external_value"]) for p in t["params"]}, sort_keys=True):
              (t["state"].lower(), t["values"]) for t in detail["trials"]}
    ours = {json.dumps({k: float(v) for k, v in t["params"].items()}, sort_keys=True): t for t in summary["trials"]}
    assert set(served) == set(ours)  # every trial the tune ran, and no other
    for point, trial in ours.items():
        state, values = served[point]
        assert state == {"complete": "complete", "pruned": "pruned"}.get(trial["outcome"], "fail")
        if trial["value"] is not None:  # a pruned trial: its last reported epoch's value
            assert values == [pytest.approx(trial["value"])]
    assert {t["outcome"] for t in summary["trials"]} == {"complete", "pruned"}  # both kinds were served
