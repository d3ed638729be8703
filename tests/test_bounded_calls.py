"""Every outside call bounded: a Ray address, a judge endpoint and the Hugging Face Hub that are dead (a closed
port), silent (a listener that accepts and never answers) or full (a listener whose backlog is full, so that
connecting hangs) end within their timeout with one line saying what was unreachable and how to fix it.

Only 127.0.0.1 is ever contacted: the commands run in a child process whose audit hook refuses (and records)
any connection to, or name lookup of, another address, and the test asserts that nothing was refused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
import pytest
import yaml

from peftlab.tasks import judge as judge_mod
from peftlab.tasks import mt_bench

LOOPBACK = "127.0.0.1"
# Runs `peftlab ARGS...` under an audit hook that refuses every non-loopback connection or lookup, and prints
# one JSON line: the exit status, the seconds main() took and what the hook refused.
GUARDED = r"""
import json, sys, time
refused = []
LOCAL = (None, "127.0.0.1", "localhost", "::1", "::ffff:127.0.0.1")
def hook(event, args):
    if event == "socket.connect" and isinstance(args[1], tuple) and args[1][0] not in LOCAL:
        refused.append(f"connect {args[1]}")
        raise PermissionError(f"test network guard: connect to {args[1]} refused")
    if event in ("socket.getaddrinfo", "socket.gethostbyname") and args[0] not in LOCAL:
        refused.append(f"lookup {args[0]}")
        raise PermissionError(f"test network guard: lookup of {args[0]} refused")
sys.addaudithook(hook)
import importlib, os
for name in filter(None, os.environ.get("GUARDED_PREIMPORT", "").split(",")):  # outside the timing
    importlib.import_module(name)
timed = {}
if os.environ.get("GUARDED_TIMED"):  # "module:function": how long that call took (the outside call itself)
    module_name, _, attr = os.environ["GUARDED_TIMED"].partition(":")
    module = importlib.import_module(module_name)
    real = getattr(module, attr)
    def timing(*args, **kwargs):
        began = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            timed["seconds"] = time.monotonic() - began
    setattr(module, attr, timing)
from peftlab.cli.main import main
start = time.monotonic()
code = main(sys.argv[1:])
print("GUARDED " + json.dumps({"code": code, "seconds": time.monotonic() - start, "refused": refused,
                               "call_seconds": timed.get("seconds")}))
"""


@contextmanager
def silent_listener():
    """A port on 127.0.0.1 that accepts every connection and never sends a byte."""
    server = socket.socket()
    server.bind((LOOPBACK, 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


@contextmanager
def full_listener():
    """A port on 127.0.0.1 whose accept queue is full (listen(0), one connection parked): connecting hangs."""
    server = socket.socket()
    server.bind((LOOPBACK, 0))
    server.listen(0)
    parked = socket.create_connection(server.getsockname())
    try:
        yield server.getsockname()[1]
    finally:
        parked.close()
        server.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@contextmanager
def no_listener():
    """A port on 127.0.0.1 where nothing listens: connecting is refused at once."""
    yield closed_port()


def endpoint(where: str):
    return {"closed": no_listener, "silent": silent_listener, "full": full_listener}[where]()


def guarded(args: list[str], *, env: dict | None = None, timeout: float = 240) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", GUARDED, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    marker = [line for line in proc.stdout.splitlines() if line.startswith("GUARDED ")]
    assert marker, proc.stdout[-2000:] + proc.stderr[-3000:]
    outcome = json.loads(marker[-1].removeprefix("GUARDED "))
    assert outcome["refused"] == [], f"something tried to reach another address: {outcome['refused']}"
    return outcome, proc.stderr


def the_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("peftlab: error: ")]
    assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr[-3000:]
    return errors[0]


# --------------------------------------------------------------------------- Ray addresses


@pytest.fixture
def specs(tmp_path):
    base = {"model": "tiny-bert", "task": "rte", "epochs": 1}
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "sweep"), "base": base, "grid": {"seed": [0, 1]}}))
    tune = tmp_path / "tune.yaml"
    tune.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "tune"), "base": base,
                                    "search": {"lr_ratio": [1, 2]}, "budget": {"grid_fraction": 1.0},
                                    "seeds": 1, "top_k": 1, "heldout_seeds": 0}))
    return {"sweep": sweep, "tune": tune}


@pytest.mark.parametrize("command, where, phrase", [
    ("sweep", "closed", "nothing listens there (connection refused)"),
    ("sweep", "silent", "it accepts connections but did not answer as a Ray cluster within --ray-timeout 2 s"),
    ("sweep", "full", "no connection within --ray-timeout 2 s"),
    ("tune", "silent", "it accepts connections but did not answer as a Ray cluster within --ray-timeout 2 s"),
])
def test_an_unreachable_ray_address_ends_within_its_timeout_with_one_line(specs, command, where, phrase):
    import ray  # noqa: F401 - the test extra installs it: a missing Ray is a failure here, never a skip
    with endpoint(where) as port:
        outcome, stderr = guarded([command, str(specs[command]), "--backend", "ray", "--address",
                                   f"{LOOPBACK}:{port}", "--ray-timeout", "2"],
                                  env={"GUARDED_TIMED": "peftlab.lab.ray_backend:probe_address"})
    line = the_error_line(stderr)
    assert outcome["code"] == 2 and outcome["call_seconds"] < 2 + 1.5, outcome  # connecting: within the timeout
    # the preflight asks the address (before any store or run folder exists), naming every run it concerns
    assert f"preflight ray: all 2 runs: cannot reach Ray at --address {LOOPBACK}:{port}: {phrase}" in line
    assert "fix: start the cluster" in line and "--ray-timeout" in line


@pytest.mark.parametrize("args, phrase", [
    (["--backend", "ray", "--address", "127.0.0.1:1", "--ray-timeout", "0"], "argument --ray-timeout: expected a finite number > 0, got 0"),
    (["--backend", "ray", "--address", "127.0.0.1:1", "--ray-timeout", "nan"], "argument --ray-timeout: expected a finite number > 0, got nan"),
    (["--ray-timeout", "5"], "--ray-timeout only applies to --backend ray"),
])
def test_ray_timeout_values_are_checked(specs, capsys, args, phrase):
    from peftlab.cli.main import main

    try:  # a value refused while parsing exits through argparse (SystemExit 2); a later check returns 2
        code = main(["sweep", str(specs["sweep"]), *args])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    assert phrase in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- judge endpoints


def stage(url: str, **overrides):
    """MT-Bench's judging stage (mt_bench.judge_answers) over 4 questions x 2 turns against ``url``."""
    templates = {"system_prompt": "You are a judge.", "prompt_template": "{question} {answer}"}
    turn2 = {"system_prompt": "You are a judge.", "prompt_template": "{question_1} {answer_1} {question_2} {answer_2}"}
    prompts = {name: (turn2 if turn == 2 else templates) for (_, turn), name in mt_bench.PROMPT_NAMES.items()}
    questions = [{"question_id": i, "category": "writing", "turn_1": f"q{i}", "turn_2": f"q{i}b"} for i in range(4)]
    values = dict(url=url, model="stub", api_key="EMPTY", timeout=1.0, retries=1, parallel=2,
                  max_consecutive_failures=2)
    settings = judge_mod.JudgeSettings(**{**values, **overrides})
    started = time.monotonic()
    judgments = mt_bench.judge_answers(settings, prompts, questions, [["a", "b"]] * 4)
    return judgments, time.monotonic() - started


@pytest.mark.parametrize("where, reason", [
    ("closed", "connection failed (2 attempt(s))"),
    ("silent", "timeout: no reply within 1 s (2 attempt(s))"),
    ("full", "timeout: no reply within 1 s (2 attempt(s))"),  # connecting itself is bounded
])
def test_a_dead_or_silent_judge_ends_the_stage_within_its_bound_with_one_line(capsys, where, reason):
    with endpoint(where) as port:
        url = f"http://{LOOPBACK}:{port}/v1"
        judgments, seconds = stage(url)
    # bound: one request's, 2 attempts x 1 s, plus the client's back-off (< 1 s here): the breaker opens at the
    # first timeout or refusal, so the 2 requests sent at once are all that is ever sent
    assert seconds < 2 * 1.0 + 3, seconds
    assert len(judgments) == 8 and not any(j["judged"] for j in judgments)
    assert all(j["reason"].startswith(reason) for j in judgments[:2]), [j["reason"] for j in judgments]
    assert all(j["reason"].startswith(f"not sent: the judge stopped answering (a request failed: {reason}")
               for j in judgments[2:]), [j["reason"] for j in judgments]
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.strip()]
    assert len(notes) == 1, err
    assert notes[0].startswith(f"peftlab: warning: judge {url} given up after a request that timed out or could not "
                               f"connect ({reason}")
    assert "8 of 8 answers unjudged" in notes[0] and "fix: start the judge" in notes[0]


def test_the_breaker_opens_at_the_first_timeout_however_many_questions_and_slots(capsys):
    """40 answers, 1 in flight at a time, a cap of 8 failures in a row: a silent judge still costs one request
    (2 attempts x 1 s), not 8 (the bound before the breaker: ceil(8 / 1) x 2 x 1 s = 16 s)."""
    with silent_listener() as port:
        started = time.monotonic()
        client = judge_mod.JudgeClient(judge_mod.JudgeSettings(url=f"http://{LOOPBACK}:{port}/v1", model="stub",
                                                               api_key="EMPTY", timeout=1.0, retries=1, parallel=1,
                                                               max_consecutive_failures=8))
        verdicts = client.judge_all([("sys", f"answer {i}") for i in range(40)])
        seconds = time.monotonic() - started
    assert seconds < 2 * 1.0 + 3, seconds
    assert verdicts[0].reason.startswith("timeout: no reply within 1 s (2 attempt(s))")
    assert all(v.reason.startswith("not sent: the judge stopped answering") for v in verdicts[1:])
    assert "40 of 40 answers unjudged" in capsys.readouterr().err


def test_a_judge_that_answers_says_nothing_extra(capsys):
    """The one line is for a judge given up on: failures below the cap (then a reply) print nothing."""
    from test_mt_bench import StubJudge  # the suite's stub OpenAI-compatible server
    from http.server import ThreadingHTTPServer
    from collections import Counter

    handler = type("Handler", (StubJudge,), {"requests": Counter(), "bodies": []})
    server = ThreadingHTTPServer((LOOPBACK, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        judgments, _ = stage(f"http://{LOOPBACK}:{server.server_address[1]}/v1")
    finally:
        server.shutdown()
        server.server_close()
    assert all(j["judged"] and j["score"] == 7.0 for j in judgments)
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- the Hub


@pytest.mark.slow
def test_an_unreachable_hub_ends_with_one_line_naming_the_model_and_the_offline_fix(tmp_path):
    """HF_ENDPOINT points at a silent listener and HF_HUB_OFFLINE is unset: without bounded Hub calls,
    `from_pretrained` waits for ever on repo_info (no timeout) and then 60 s per retried HEAD."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                            "TRANSFORMERS_OFFLINE")}
    with silent_listener() as port:
        env.update(HF_ENDPOINT=f"http://{LOOPBACK}:{port}", HF_HOME=str(tmp_path / "hf"),
                   HF_HUB_DOWNLOAD_TIMEOUT="1", HF_HUB_DISABLE_TELEMETRY="1")
        proc = subprocess.run([sys.executable, "-c", GUARDED, "train", "--model", "nobody/no-such-model",
                               "--task", "rte", "--output-dir", str(tmp_path / "run"), "--epochs", "1"],
                              capture_output=True, text=True, timeout=240, env=env)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("GUARDED ")]
    assert marker, proc.stderr[-3000:]
    outcome = json.loads(marker[-1].removeprefix("GUARDED "))
    assert outcome["refused"] == [] and outcome["code"] == 2, outcome
    # 1 s a try; huggingface_hub's five retries with back-off (1+2+4+8+8 s) are most of it
    assert outcome["seconds"] < 120, outcome
    line = the_error_line(proc.stderr)
    assert f"cannot reach the Hugging Face Hub (http://{LOOPBACK}:{port}) to load model 'nobody/no-such-model'" in line
    assert "HF_HUB_OFFLINE=1" in line and "peftlab models" in line
    assert not (tmp_path / "run").exists()  # nothing written


@pytest.mark.slow
def test_glue_data_neither_local_nor_on_a_reachable_hub_is_one_line_naming_the_local_data_fix(tmp_path):
    """No local RTE under --data-dir and the Hub refused at once: the preflight's line names the dataset and
    where it looked, and its fix is a data folder (not the model's HF_HUB_OFFLINE advice)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                                                            "TRANSFORMERS_OFFLINE")}
    empty = tmp_path / "data"
    empty.mkdir()
    with no_listener() as port:
        env.update(HF_ENDPOINT=f"http://{LOOPBACK}:{port}", HF_HOME=str(tmp_path / "hf"),
                   HF_HUB_DOWNLOAD_TIMEOUT="1", HF_HUB_DISABLE_TELEMETRY="1")
        proc = subprocess.run([sys.executable, "-c", GUARDED, "train", "--model", "tiny-bert", "--task", "rte",
                               "--data-dir", str(empty), "--output-dir", str(tmp_path / "run"), "--epochs", "1"],
                              capture_output=True, text=True, timeout=240, env=env)
    marker = [line for line in proc.stdout.splitlines() if line.startswith("GUARDED ")]
    assert marker, proc.stderr[-3000:]
    outcome = json.loads(marker[-1].removeprefix("GUARDED "))
    assert outcome["refused"] == [] and outcome["code"] == 2, outcome
    line = the_error_line(proc.stderr)
    assert "no local copy of RTE train; cannot reach the Hugging Face Hub" in line
    assert "to load dataset 'nyu-mll/glue'" in line and f"looked under {empty}" in line
    assert "--data-dir" in line.split("fix:")[1] and "peftlab models" not in line
    assert not (tmp_path / "run").exists()  # nothing written


def test_hub_calls_keep_the_users_timeouts_and_client(monkeypatch):
    from peftlab.models import hub

    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "7")
    assert hub.hub_timeout() == 7
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "oops")
    assert hub.hub_timeout() == hub.HUB_TIMEOUT_SECONDS

    class Inner:
        def handle_request(self, request):
            return request.extensions["timeout"]

    class Request:
        extensions = {"timeout": {"connect": None, "read": 60, "write": 2}}

    capped = hub._TimeoutCapping(Inner(), 10).handle_request(Request())
    assert capped == {"connect": 10, "read": 10, "write": 2, "pool": 10}

