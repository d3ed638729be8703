"""The preflight (issue 38): what a command that trains can see in its first seconds is found before anything runs.

Each check has a sweep of several cells of which exactly one would fail: the sweep exits 2 before any run, in one
line naming that cell, and leaves no store and no run folder. Then the judge: a closed port is caught before
training, and a judge that answers the preflight's request but then accepts and never answers ends the run within
one request's bound of the answers being written, the training saved and the answers unjudged. The OSError
boundary of the command line, and `--dry-run` printing the findings with the plan, close it.

Only 127.0.0.1 is contacted (HF_HUB_OFFLINE is set by conftest; the judges are loopback listeners).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from conftest import DATA_DIR, needs_data
from peftlab.cli.main import main

LOOPBACK = "127.0.0.1"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def write_spec(tmp_path: Path, spec: dict, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "runs"), **spec}, sort_keys=False))
    return path


@pytest.fixture
def trained(monkeypatch):
    """Every run the commands would start, recorded instead of trained (none may start here)."""
    import peftlab.lab.runner as runner
    import peftlab.training.loop as loop

    calls: list = []

    def train(cfg, on_epoch_end=None):
        calls.append(cfg)
        raise AssertionError(f"a run started: {cfg.output_dir}")

    monkeypatch.setattr(loop, "train", train)
    monkeypatch.setattr(runner, "DEFAULT_TRAIN", "peftlab.training.loop:train")
    return calls


def refused(argv: list[str], capsys, trained: list) -> str:
    """Run ``peftlab ARGV``: exit 2, exactly one line on stderr (returned), no traceback, no run started."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("peftlab: error: preflight "), err[-3000:]
    assert "Traceback" not in err and trained == []
    return lines[0]


def nothing_written(tmp_path: Path) -> None:
    assert not (tmp_path / "runs").exists(), sorted(p.name for p in tmp_path.iterdir())


# --------------------------------------------------------------------------- one check each, one cell of several


@needs_data("glue", "RTE", "train.tsv")
@needs_data("glue", "MRPC", "train.tsv")
def test_data_missing_for_one_cell(tmp_path, capsys, trained):
    """A data folder that holds RTE and MRPC but not SST-2: the SST-2 cell alone, before any run (no model
    loads, no store): the issue's 6 runs x 6 identical errors become one line."""
    data = tmp_path / "data" / "glue"
    data.mkdir(parents=True)
    for task in ("RTE", "MRPC"):
        (data / task).symlink_to(DATA_DIR / "glue" / task)
    spec = write_spec(tmp_path, {"base": {"model": "tiny-bert", "epochs": 1, "data_dir": str(tmp_path / "data")},
                                 "grid": {"task": ["rte", "mrpc", "sst2"]}})
    line = refused(["sweep", str(spec)], capsys, trained)
    assert "preflight data: run 3 {task=sst2}: no local copy of SST-2 train" in line
    assert "run 1" not in line and "run 2" not in line and "fix: pass --data-dir" in line
    nothing_written(tmp_path)


@needs_data("glue", "RTE", "train.tsv")
def test_model_missing_for_one_cell(tmp_path, capsys, trained):
    """A Hub id neither local nor in the cache while offline: that cell alone (the others are registered)."""
    spec = write_spec(tmp_path, {"base": {"task": "rte", "epochs": 1},
                                 "grid": {"model": ["tiny-bert", "tiny-modernbert", "nobody/no-such-model"]}})
    line = refused(["sweep", str(spec)], capsys, trained)
    assert "preflight model: run 3 {model=nobody/no-such-model}: model 'nobody/no-such-model' is neither a local " \
           "folder nor in the local Hugging Face cache, and HF_HUB_OFFLINE is set" in line
    assert "run 1" not in line and "peftlab models" in line
    nothing_written(tmp_path)


@needs_data("glue", "RTE", "train.tsv")
def test_an_extra_missing_for_one_cell(tmp_path, capsys, trained, monkeypatch):
    """--report-to wandb without wandb installed (made so here, whatever this machine has): that cell alone."""
    from peftlab import extras

    real = extras.installed
    monkeypatch.setattr(extras, "installed", lambda module: module != "wandb" and real(module))
    spec = write_spec(tmp_path, {"base": {"model": "tiny-bert", "task": "rte", "epochs": 1},
                                 "zip": [{"seed": [0, 1, 2], "report_to": ["none", "tensorboard", "wandb"]}]})
    line = refused(["sweep", str(spec)], capsys, trained)
    assert "preflight extra: run 3 {seed=2 report_to=wandb}: --report-to wandb needs the 'wandb' package, " \
           "which is not installed" in line and "fix: pip install wandb" in line
    nothing_written(tmp_path)


@needs_data("glue", "RTE", "train.tsv")
def test_no_room_for_one_cell(tmp_path, capsys, trained, monkeypatch):
    """20 MB free: the LoRA runs of a tiny model fit, its full fine-tuning run (weights, checkpoint and Adam's
    moments: ~38 MB) does not; that cell alone is named."""
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=20_000_000))
    spec = write_spec(tmp_path, {"base": {"model": "tiny-bert", "task": "rte", "epochs": 1},
                                 "grid": {"method": ["lora", "full", "dora"]}})
    line = refused(["sweep", str(spec)], capsys, trained)
    assert "preflight room: run 2 {method=full}: not enough disk space under" in line
    assert "a run of model 'tiny-bert' (--method full" in line and "20.0 MB free" in line
    nothing_written(tmp_path)


@needs_data("glue", "RTE", "train.tsv")
@pytest.mark.parametrize("where", ["below a file", "a name too long"])
def test_an_output_folder_that_cannot_be_made(tmp_path, capsys, trained, where):
    """The spec's own output_dir (not a flag, so no argparse check saw it) below a regular file, or with a name
    longer than the filesystem allows: every run shares it, so all of them are named; nothing is made."""
    (tmp_path / "a-file").write_text("x")
    root = tmp_path / "a-file" / "runs" if where == "below a file" else tmp_path / ("n" * 300)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({"output_dir": str(root), "base": {"model": "tiny-bert", "task": "rte"},
                                    "grid": {"seed": [0, 1, 2]}}))
    line = refused(["sweep", str(spec)], capsys, trained)
    assert "preflight output: all 3 runs: cannot write the runs' folder (output_dir)" in line
    assert ("which is a file, not a folder" if where == "below a file" else "File name too long") in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "spec.yaml"]


@needs_data("glue", "RTE", "train.tsv")
@needs_data("mt_bench", "question.jsonl")
@needs_data("alpaca", "alpaca_data_1k.json")
def test_a_judge_on_a_closed_port_for_one_cell(tmp_path, capsys, trained, monkeypatch):
    monkeypatch.setenv("PREFLIGHT_JUDGE_KEY", "EMPTY")
    url = f"http://{LOOPBACK}:{closed_port()}/v1"
    spec = write_spec(tmp_path, {"base": {"epochs": 1, "judge_api_key_env": "PREFLIGHT_JUDGE_KEY"},
                                 "zip": [{"task": ["rte", "rte", "mt-bench"],
                                          "model": ["tiny-bert", "tiny-modernbert", "tiny-llama"],
                                          "judge_url": [None, None, url]}]})
    line = refused(["sweep", str(spec)], capsys, trained)
    assert f"preflight judge: run 3 {{task=mt-bench model=tiny-llama judge_url={url}}}: the MT-Bench judge at " \
           f"--judge-url {url} did not answer one short request" in line and "Connection refused" in line
    nothing_written(tmp_path)


@needs_data("glue", "RTE", "train.tsv")
@needs_data("glue", "SST-2", "train.tsv")
def test_a_tune_point_and_a_study_task_are_named_too(tmp_path, capsys, trained):
    """The same checks through tune (a search point) and study (a task), before any trial or stage."""
    spec = write_spec(tmp_path, {"base": {"task": "rte", "epochs": 1}, "budget": {"grid_fraction": 1.0},
                                 "search": {"model": ["tiny-bert", "nobody/no-such-model"]}, "seeds": 1, "top_k": 1,
                                 "heldout_seeds": 0}, "tune.yaml")
    line = refused(["tune", str(spec)], capsys, trained)
    assert "preflight model: point {model=nobody/no-such-model}: model 'nobody/no-such-model'" in line
    data = tmp_path / "data" / "glue"
    data.mkdir(parents=True)
    (data / "RTE").symlink_to(DATA_DIR / "glue" / "RTE")
    line = refused(["study", "lambda", "--task", "rte,sst2", "--model", "tiny-bert", "--ratios", "2",
                    "--no-key-ablation", "--set", f"data_dir={tmp_path / 'data'}", "--output-dir",
                    str(tmp_path / "runs")], capsys, trained)
    assert "preflight data: study run {task=sst2 method=lora lr_ratio=1.0}, study run {task=sst2 method=lora " \
           "lr_ratio=2.0}: no local copy of SST-2 train" in line and "task=rte" not in line
    nothing_written(tmp_path)


@needs_data("glue", "RTE", "train.tsv")
def test_dry_run_prints_the_findings_with_the_plan(tmp_path, capsys, trained):
    spec = write_spec(tmp_path, {"base": {"model": "tiny-bert", "task": "rte", "epochs": 1},
                                 "grid": {"seed": [0, 1]}})
    assert main(["sweep", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 runs: 0 finished, 0 failed, 2 to run" in out
    for line in ("preflight data: ok: rte: ", "preflight model: ok: model tiny-bert: random weights (all 2 runs)",
                 "preflight room: ok: disk under", "preflight output: ok: the store", "preflight: no problem found"):
        assert line in out, out
    spec = write_spec(tmp_path, {"base": {"model": "nobody/no-such-model", "task": "rte", "epochs": 1},
                                 "grid": {"seed": [0, 1]}})
    line = refused(["sweep", str(spec), "--dry-run"], capsys, trained)
    assert "preflight model: all 2 runs: model 'nobody/no-such-model'" in line
    nothing_written(tmp_path)


# --------------------------------------------------------------------------- a lone run and the judge


@needs_data("mt_bench", "question.jsonl")
@needs_data("alpaca", "alpaca_data_1k.json")
def test_train_with_a_judge_on_a_closed_port_stops_before_training(tmp_path, capsys, trained, monkeypatch):
    monkeypatch.setenv("PREFLIGHT_JUDGE_KEY", "EMPTY")
    url = f"http://{LOOPBACK}:{closed_port()}/v1"
    line = refused(["train", "--task", "mt-bench", "--model", "tiny-llama", "--judge-url", url,
                    "--judge-api-key-env", "PREFLIGHT_JUDGE_KEY", "--output-dir", str(tmp_path / "runs" / "run")],
                   capsys, trained)
    assert line.startswith(f"peftlab: error: preflight judge: the MT-Bench judge at --judge-url {url} did not answer")
    assert "connection failed (1 attempt(s))" in line and "nothing was trained" in line
    nothing_written(tmp_path)


class AnswersOnceJudge(BaseHTTPRequestHandler):
    """An OpenAI-compatible judge that answers the first request (the preflight's) and then falls silent: it
    accepts every later connection and request and never sends a byte, until the test ends."""

    served: Counter
    silent: threading.Event  # set by the test at its end: the held handlers return

    def do_POST(self):  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers["Content-Length"]))
        self.served["requests"] += 1
        if self.served["requests"] > 1:
            self.silent.wait()
            return
        data = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "stub",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "[[1]]"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.slow
@needs_data("mt_bench", "question.jsonl")
@needs_data("alpaca", "alpaca_data_1k.json")
def test_a_judge_that_goes_silent_after_the_preflight_costs_one_request_bound(tmp_path, capsys, monkeypatch):
    """10 answers to judge one at a time (--judge-parallel 1), each request 3 s x 2 attempts: the breaker opens at
    the first timeout, so the run ends within (timeout x (retries + 1)) + 30 s of its answers being written
    (before: 8 failures in a row, about 8 x 6.5 s), its training saved and every answer unjudged, with the reason."""
    handler = type("Handler", (AnswersOnceJudge,), {"served": Counter(), "silent": threading.Event()})
    server = ThreadingHTTPServer((LOOPBACK, 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PREFLIGHT_JUDGE_KEY", "EMPTY")
    run = tmp_path / "run"
    timeout, retries = 3.0, 1
    try:
        code = main(["train", "--task", "mt-bench", "--model", "tiny-llama", "--method", "lora", "--rank", "4",
                     "--max-train-samples", "8", "--batch-size", "4", "--max-steps", "2", "--max-length", "64",
                     "--max-eval-samples", "5", "--max-new-tokens", "4", "--eval-batch-size", "5",
                     "--judge-url", f"http://{LOOPBACK}:{server.server_address[1]}/v1", "--judge-model", "stub",
                     "--judge-api-key-env", "PREFLIGHT_JUDGE_KEY", "--judge-timeout", str(timeout),
                     "--judge-retries", str(retries), "--judge-parallel", "1", "--report-to", "none",
                     "--output-dir", str(run)])
        ended = time.time()
    finally:
        handler.silent.set()
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    result = json.loads((run / "result.json").read_text())
    answers = [json.loads(line) for line in (run / result["mt_bench_answers"]["epoch1"]).read_text().splitlines()]
    judgments = [json.loads(line) for line in (run / result["mt_bench_judgments"]["epoch1"]).read_text().splitlines()]
    assert ended - max(a["tstamp"] for a in answers) < timeout * (retries + 1) + 30
    assert code == 0 and result["status"] in ("ok", "no_learning"), (code, result["status"], err[-2000:])
    assert (run / "adapter" / "adapter_model.safetensors").is_file()  # the training is saved
    assert len(judgments) == 10 and not any(j["judged"] for j in judgments)
    assert judgments[0]["reason"].startswith(f"timeout: no reply within {timeout:g} s (2 attempt(s))")
    assert all(j["reason"].startswith("not sent: the judge stopped answering") for j in judgments[1:])
    assert result["final"]["metrics"]["mt_bench_unjudged"] == 10
    assert handler.served["requests"] == 1 + (retries + 1)  # the preflight's, then one request's two attempts
    warnings = [line for line in err.splitlines() if "peftlab: warning: judge" in line]
    assert len(warnings) == 1 and "given up after a request that timed out or could not connect" in warnings[0]


# --------------------------------------------------------------------------- the command line's OSError boundary


def test_an_oserror_at_the_command_boundary_is_one_line_unless_debugging(tmp_path, capsys, monkeypatch):
    """An OSError no check caught (here a store path with a name too long for the filesystem, read by `report`):
    one line with the OS's words and the path, exit 2; PEFTLAB_DEBUG=1 lets the traceback through."""
    path = str(tmp_path / ("n" * 300))
    monkeypatch.delenv("PEFTLAB_DEBUG", raising=False)
    assert main(["report", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("peftlab: error: File name too long (ENAMETOOLONG): ")
    assert path in err and "(peftlab report)" in err and "PEFTLAB_DEBUG=1" in err
    monkeypatch.setenv("PEFTLAB_DEBUG", "1")
    with pytest.raises(OSError, match="File name too long"):
        main(["report", path])
