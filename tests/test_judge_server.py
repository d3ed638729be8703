"""``peftlab serve-judge``: a tiny random decoder served over real HTTP on 127.0.0.1, called by the real clients.

The served model is ``tiny-llama`` (random weights), so its replies are garbage: the point is that the server
answers well-formed OpenAI chat completions and that the judge client records such replies as unjudged
("no rating"), never crashing, up to a whole ``peftlab train --task mt-bench`` run judged by it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import openai
import pytest

from conftest import REPO, needs_data
from peftlab.cli.main import main
from peftlab.tasks import judge as judge_mod
from peftlab.tasks import judge_server

CAP = 8  # --max-new-tokens of the served tiny model: keeps every reply short and the tests fast
UNRATED = {"no [[rating]] in the judge's reply", "the judge's reply has no message content"}


@pytest.fixture(scope="module")
def served():
    model = judge_server.load_served_model("tiny-llama", max_new_tokens=CAP, device="cpu")
    running = judge_server.start_judge_server(model, host="127.0.0.1", port=0)
    yield running
    running.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=60)


def test_models_endpoint_lists_the_served_model_under_its_registry_name(served):
    assert served.url.startswith("http://127.0.0.1:") and served.url.endswith("/v1")
    assert [m.id for m in client(served.url).models.list().data] == ["tiny-llama"]
    with urllib.request.urlopen(served.url.removesuffix("/v1") + "/health", timeout=10) as reply:
        assert json.loads(reply.read()) == {"status": "ok"}


def test_chat_completion_is_well_formed_greedy_and_capped(served):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Rate this answer from 1 to 10: 2 + 2 = 4."}]
    # FastChat's judge settings: temperature 0 and max_tokens 2048, which the server caps at CAP.
    first, second = (client(served.url).chat.completions.create(
        model="tiny-llama", messages=messages, temperature=0, max_tokens=2048) for _ in range(2))
    choice = first.choices[0]
    assert first.object == "chat.completion" and first.model == "tiny-llama" and len(first.choices) == 1
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= first.usage.completion_tokens <= CAP and first.usage.prompt_tokens > 10
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.choices[0].message.content == choice.message.content  # greedy: the same reply twice
    # A sampling request is decoded greedily too (a judge server is deterministic).
    sampled = client(served.url).chat.completions.create(model="tiny-llama", messages=messages, temperature=1.0,
                                                          top_p=0.5, max_tokens=2048)
    assert sampled.choices[0].message.content == choice.message.content
    short = client(served.url).chat.completions.create(model="tiny-llama", messages=messages, max_tokens=2)
    assert short.usage.completion_tokens <= 2  # a request below the cap keeps its own limit


def test_streaming_reply_comes_in_chunks(served):
    stream = client(served.url).chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "Hello"}], temperature=0, stream=True)
    chunks = list(stream)
    assert chunks and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_the_judge_client_records_the_random_models_garbage_as_unjudged(served):
    settings = judge_mod.JudgeSettings(url=served.url, model="tiny-llama", api_key="EMPTY", timeout=60, retries=0,
                                       parallel=3)
    prompts = [("You are a helpful assistant.", f"[Question]\n{q}\n\n[The Start of Assistant's Answer]\n{a}\n"
                "[The End of Assistant's Answer]\nRate it as [[rating]].") for q, a in
               [("What is 2+2?", "4"), ("Name a colour.", "Blue"), ("Say hi.", "Hi")]]
    verdicts = judge_mod.JudgeClient(settings).judge_all(prompts)
    assert len(verdicts) == 3
    for verdict in verdicts:
        assert not verdict.judged and verdict.score is None and verdict.reason in UNRATED
        assert verdict.attempts_seconds > 0
    assert judge_mod.judge_strength(served.url, "tiny-llama")[0] is True  # a local model is a weak judge


def test_a_request_for_another_model_is_404_and_recorded_by_the_client(served):
    settings = judge_mod.JudgeSettings(url=served.url, model="gpt-4", api_key="EMPTY", timeout=30, retries=0)
    verdict = judge_mod.JudgeClient(settings).judge("system", "user")
    assert not verdict.judged and verdict.reason.startswith("HTTP 404") and "tiny-llama" in verdict.reason


def test_bad_options_are_one_line_errors_before_any_model_load(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve-judge", "--model", "tiny-llama", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["serve-judge", "--model", "tiny-llama", "--port", "70000"]) == 2
    assert "--port must be 0-65535" in capsys.readouterr().err
    assert main(["serve-judge", "--model", "minilm-l6", "--port", "0"]) == 2
    assert "is an encoder" in capsys.readouterr().err
    assert main(["serve-judge", "--model", "tiny-lama", "--port", "0"]) == 2
    assert "did you mean 'tiny-llama'" in capsys.readouterr().err
    assert main(["serve-judge", "--model", "tiny-llama", "--port", "0", "--max-new-tokens", "0"]) == 2
    assert "--max-new-tokens must be" in capsys.readouterr().err


def test_the_command_serves_until_interrupted():
    """The real `peftlab serve-judge` process: it prints its URL, answers, and stops cleanly on Ctrl-C."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")}
    process = subprocess.Popen([sys.executable, "-m", "peftlab.cli", "serve-judge", "--model", "tiny-llama",
                                "--port", "0", "--device", "cpu", "--max-new-tokens", "4"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        banner = process.stdout.readline()
        assert banner.startswith("serving tiny-llama on cpu at http://127.0.0.1:"), process.stderr.read()
        url = banner.split(" at ", 1)[1].split()[0]
        assert "--judge-model tiny-llama" in process.stdout.readline()
        reply = client(url).chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens <= 4
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@needs_data("mt_bench", "question.jsonl")
@needs_data("alpaca", "alpaca_data_1k.json")
def test_an_mt_bench_run_finishes_against_the_served_judge(served, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_JUDGE_KEY", "EMPTY")
    run = tmp_path / "run"
    code = main(["train", "--task", "mt-bench", "--model", "tiny-llama", "--method", "lora", "--targets", "q,v",
                 "--rank", "4", "--max-train-samples", "4", "--batch-size", "4", "--max-steps", "1",
                 "--max-length", "64", "--max-eval-samples", "1", "--max-new-tokens", "4", "--eval-batch-size", "2",
                 "--judge-url", served.url, "--judge-model", "tiny-llama", "--judge-api-key-env", "LOCAL_JUDGE_KEY",
                 "--judge-timeout", "60", "--report-to", "none", "--output-dir", str(run)])
    assert code == 0
    result = json.loads((run / "result.json").read_text())
    judge = result["judge"]
    assert judge["status"] == "judged" and judge["model"] == "tiny-llama" and judge["weak"] is True
    metrics = result["final"]["metrics"]
    assert (metrics["mt_bench_judged"], metrics["mt_bench_unjudged"]) == (0, 2)  # one question, two turns
    assert "mt_bench_score" not in metrics  # nothing judged: no score, rather than a made-up one
    judgments = [json.loads(line) for line in (run / result["mt_bench_judgments"]["epoch1"]).read_text().splitlines()]
    assert [j["turn"] for j in judgments] == [1, 2]
    for record in judgments:
        assert not record["judged"] and record["score"] is None and record["reason"] in UNRATED
