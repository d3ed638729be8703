"""MT-Bench: FastChat's judge prompts, the judge client against a real HTTP server, and a tiny run end to end.

The judge is a stub OpenAI-compatible server on 127.0.0.1 (``http.server`` in a thread). What it answers
depends on a marker in the prompt it receives: a normal request gets a completion ending "Rating: [[7]]";
``GARBAGE`` gets a reply without a rating, ``SLOW`` a reply after longer than the client's timeout, ``FAIL500``
an HTTP 500. Every failure must come back as an unjudged answer with its reason, never an exception.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

import jsonschema
import pytest

from conftest import DATA_DIR, needs_data
from peftlab.config import TrainConfig
from peftlab.resolve import build_run_config
from peftlab.errors import PeftlabError
from peftlab.tasks import judge as judge_mod
from peftlab.tasks import mt_bench
from peftlab.tasks.prepare import build_pipeline

SLOW_SECONDS = 3.0


class StubJudge(BaseHTTPRequestHandler):
    requests: Counter  # marker -> requests received (set per server)
    bodies: list

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        text = body["messages"][-1]["content"]
        marker = next((m for m in ("GARBAGE", "SLOW", "FAIL500") if m in text), "GOOD")
        self.requests[marker] += 1
        if marker == "FAIL500":
            return self._send(500, {"error": {"message": "stub judge is down", "type": "server_error"}})
        if marker == "SLOW":
            time.sleep(SLOW_SECONDS)
        content = "I will not rate this." if marker == "GARBAGE" else "A fine answer. Rating: [[7]]"
        self._send(200, {"id": "stub-1", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": content}}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on a SLOW reply
            pass

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture
def stub_judge():
    handler = type("Handler", (StubJudge,), {"requests": Counter(), "bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.handler = handler
    yield server
    server.shutdown()
    server.server_close()


def settings(url: str, **overrides) -> judge_mod.JudgeSettings:
    values = dict(url=url, model="stub", api_key="EMPTY", timeout=0.5, retries=1, parallel=2)
    values.update(overrides)
    return judge_mod.JudgeSettings(**values)


# --------------------------------------------------------------------------- parsing (FastChat's rules)


@pytest.mark.parametrize("reply, score", [
    ("Rating: [[7]]", 7.0), ("[[8.5]] is my verdict", 8.5), ("first [[3]] then [[9]]", 3.0),
    ("Rating: [6]", 6.0),  # FastChat's backup pattern
])
def test_ratings_parse_like_fastchat(reply, score):
    verdict = judge_mod.verdict_from_reply(reply)
    assert verdict.judged and verdict.score == score and verdict.reason is None


@pytest.mark.parametrize("reply, reason", [
    ("no rating here", "no [[rating]]"), ("", "no message content"), (None, "no message content"),
    ("Rating: [[0]]", "outside 1-10"), ("Rating: [[11]]", "outside 1-10"),
])
def test_replies_without_a_valid_rating_are_unjudged(reply, reason):
    verdict = judge_mod.verdict_from_reply(reply)
    assert not verdict.judged and verdict.score is None and reason in verdict.reason
    assert verdict.reply == reply  # kept, so the failure can be read


def test_weak_judge_labels():
    assert judge_mod.judge_strength("https://api.openai.com/v1", "gpt-4")[0] is False
    assert judge_mod.judge_strength("https://api.openai.com/v1", "gpt-4o-2024-08-06")[0] is False
    assert judge_mod.judge_strength("https://api.openai.com/v1", "meta-llama/Llama-3-8B")[0] is True
    weak, why = judge_mod.judge_strength("http://127.0.0.1:8000/v1", "gpt-4")
    assert weak and "local address" in why
    assert judge_mod.judge_strength("http://localhost:8000/v1", "qwen2.5-0.5b")[0] is True
    assert judge_mod.normalise_url("http://h:1/v1/chat/completions/") == "http://h:1/v1"


# --------------------------------------------------------------------------- the client over real HTTP


def test_client_records_every_failure_and_finishes(stub_judge):
    client = judge_mod.JudgeClient(settings(stub_judge.url, parallel=1))
    # one at a time, SLOW second last: a request that times out opens the circuit breaker, nothing is sent after it
    verdicts = client.judge_all([("sys", "GOOD answer"), ("sys", "GARBAGE"), ("sys", "FAIL500"),
                                 ("sys", "another good one"), ("sys", "SLOW"), ("sys", "GOOD, never sent")])
    good, garbage, failed, good_again, slow, not_sent = verdicts
    assert good.judged and good.score == 7.0 and good_again.score == 7.0
    assert not not_sent.judged and not_sent.reason.startswith("not sent: the judge stopped answering (a request "
                                                              "failed: timeout")
    assert not garbage.judged and garbage.reason == "no [[rating]] in the judge's reply"
    assert garbage.reply == "I will not rate this."
    assert not slow.judged and slow.reason.startswith("timeout: no reply within 0.5 s (2 attempt(s))")
    assert not failed.judged and failed.reason.startswith("HTTP 500") and "(2 attempt(s))" in failed.reason
    requests = stub_judge.handler.requests
    assert requests["FAIL500"] == 2 and requests["SLOW"] == 2  # retried once each (retries=1)
    assert requests["GARBAGE"] == 1  # a reply without a rating is an answer, not a transport failure
    sent = stub_judge.handler.bodies[0]
    assert sent["model"] == "stub" and sent["temperature"] == 0 and sent["max_tokens"] == 2048
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]


def test_unreachable_judge_is_recorded_and_then_not_asked_again():
    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = judge_mod.JudgeClient(settings(f"http://127.0.0.1:{port}/v1", retries=0, parallel=1,
                                            max_consecutive_failures=2))
    verdicts = client.judge_all([("sys", f"answer {i}") for i in range(4)])
    assert not any(v.judged for v in verdicts)
    assert verdicts[0].reason.startswith("connection failed (1 attempt(s))")  # the breaker opens at once
    assert all(v.reason.startswith("not sent: the judge stopped answering (a request failed: connection failed")
               for v in verdicts[1:])


def test_http_failures_below_the_cap_do_not_open_the_breaker(stub_judge):
    """An HTTP 500 is an answer (the judge is there): only max_consecutive_failures of them in a row stop it."""
    client = judge_mod.JudgeClient(settings(stub_judge.url, retries=0, parallel=1, max_consecutive_failures=2))
    verdicts = client.judge_all([("sys", "FAIL500"), ("sys", "good"), ("sys", "FAIL500"), ("sys", "FAIL500"),
                                 ("sys", "good")])
    assert [v.judged for v in verdicts] == [False, True, False, False, False]
    assert verdicts[4].reason.startswith("not sent: the judge failed 2 times in a row (last: HTTP 500")


def test_parallel_http_failures_send_no_more_than_the_cap(stub_judge):
    """4 requests at a time, a cap of 2, a judge that fails every request: at most the first 4 go out together
    (fewer when a failure comes back before the last of them starts, on a loaded machine), and after the first
    failure no request goes out while those in flight could still reach the cap: 2 to 4 sent, never more (a
    breaker that did not count the requests in flight sends a 5th as soon as the first failure is back)."""
    client = judge_mod.JudgeClient(settings(stub_judge.url, retries=0, parallel=4, max_consecutive_failures=2))
    verdicts = client.judge_all([("sys", "FAIL500")] * 12)
    sent = stub_judge.handler.requests["FAIL500"]
    assert 2 <= sent <= 4
    assert sum(v.reason.startswith("not sent: the judge failed") for v in verdicts) == 12 - sent


# --------------------------------------------------------------------------- FastChat's prompts and the scores


@needs_data("mt_bench", "question.jsonl")
def test_questions_and_judge_prompts_follow_fastchat():
    folder = DATA_DIR / "mt_bench"
    questions = mt_bench.load_questions(folder)
    assert len(questions) == 80 and Counter(q["category"] for q in questions) == {
        c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    prompts = mt_bench.load_judge_prompts(folder)
    writing = next(q for q in questions if q["category"] == "writing")
    name, system, user = mt_bench.judge_prompt(prompts, writing, ["ANSWER-1", "ANSWER-2"], 1)
    assert name == "single-v1" and system == "You are a helpful assistant."
    assert f"[Question]\n{writing['turn_1']}\n\n[The Start of Assistant's Answer]\nANSWER-1\n" in user
    assert "ANSWER-2" not in user
    name, system, user = mt_bench.judge_prompt(prompts, writing, ["ANSWER-1", "ANSWER-2"], 2)
    assert name == "single-v1-multi-turn" and "focus on the assistant's answer to the second user question" in system
    assert user.index("ANSWER-1") < user.index(writing["turn_2"]) < user.index("ANSWER-2")
    math_q = next(q for q in questions if q["category"] == "math")
    reference = json.loads(next(line for line in (folder / mt_bench.REFERENCES).open()
                                if json.loads(line)["question_id"] == math_q["question_id"]))
    name, _, user = mt_bench.judge_prompt(prompts, math_q, ["A1", "A2"], 2)
    assert name == "single-math-v1-multi-turn"
    assert reference["choices"][0]["turns"][0] in user and reference["choices"][0]["turns"][1] in user
    assert mt_bench.judge_prompt(prompts, math_q, ["A1", "A2"], 1)[0] == "single-math-v1"


def test_scores_average_only_judged_answers():
    rows = [dict(category="math", turn=1, judged=True, score=8.0), dict(category="math", turn=2, judged=True, score=4.0),
            dict(category="stem", turn=1, judged=True, score=6.0), dict(category="stem", turn=2, judged=False, score=None)]
    metrics = mt_bench.summarise(rows)
    assert metrics == {"mt_bench_judged": 3, "mt_bench_unjudged": 1, "mt_bench_score": 6.0, "mt_bench_turn1": 7.0,
                       "mt_bench_turn2": 4.0, "mt_bench_math": 6.0, "mt_bench_stem": 6.0}
    assert mt_bench.summarise([dict(category="stem", turn=1, judged=False, score=None)]) == {
        "mt_bench_judged": 0, "mt_bench_unjudged": 1}  # no score without a judged answer


def test_second_turn_prompt_holds_the_first_answer():
    from peftlab.models.registry import load_tokenizer
    from peftlab.tasks.instructions import encode_prompt

    tokenizer = load_tokenizer("tiny-llama")
    text = tokenizer.decode(encode_prompt(tokenizer, "Q two", history=[("Q one", "first answer")]))
    assert text.index("Q one") < text.index("first answer") < text.index("Q two")
    assert text.rstrip().endswith("assistant")  # ends with the header of the answer to generate


def test_judge_options_are_checked_before_any_work(tmp_path, monkeypatch):
    monkeypatch.delenv("PEFTLAB_TEST_NO_KEY", raising=False)
    cfg = build_run_config(overrides=dict(task="mt-bench", model="tiny-llama", judge_url="http://x/v1",
                                                   judge_api_key_env="PEFTLAB_TEST_NO_KEY",
                                                   output_dir=str(tmp_path / "run")))
    with pytest.raises(PeftlabError, match="PEFTLAB_TEST_NO_KEY .* is empty") as err:
        build_pipeline(cfg, object(), None)
    assert "export PEFTLAB_TEST_NO_KEY=" in err.value.fix
    with pytest.raises(PeftlabError, match="task 'rte' has no judge"):
        build_run_config(overrides=dict(task="rte", judge_url="http://x/v1"))
    with pytest.raises(PeftlabError, match="--judge-timeout"):
        build_run_config(overrides=dict(task="mt-bench", judge_timeout=0))
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- end to end


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@needs_data("mt_bench", "question.jsonl")
@needs_data("alpaca", "alpaca_data_1k.json")
def test_tiny_run_is_judged_by_the_stub_and_reported(tmp_path, stub_judge, monkeypatch, capsys):
    from peftlab.cli.main import main

    monkeypatch.setenv("STUB_JUDGE_KEY", "EMPTY")
    run = tmp_path / "run"
    code = main(["train", "--task", "mt-bench", "--model", "tiny-llama", "--method", "lora", "--targets", "q,v",
                 "--rank", "4", "--max-train-samples", "8", "--batch-size", "4", "--max-steps", "2",
                 "--max-length", "64", "--max-eval-samples", "2", "--max-new-tokens", "6", "--eval-batch-size", "4",
                 "--judge-url", stub_judge.url, "--judge-model", "stub-judge", "--judge-api-key-env", "STUB_JUDGE_KEY",
                 "--judge-timeout", "10", "--report-to", "none", "--output-dir", str(run)])
    assert code == 0
    result = json.loads((run / "result.json").read_text())
    jsonschema.validate(result, json.loads(resources.files("peftlab").joinpath("schemas/result.schema.json").read_text()))
    metrics = result["final"]["metrics"]
    assert result["primary_metric"] == "mt_bench_score" and metrics["mt_bench_score"] == 7.0
    assert metrics["mt_bench_turn1"] == metrics["mt_bench_turn2"] == 7.0
    assert (metrics["mt_bench_judged"], metrics["mt_bench_unjudged"]) == (4, 0)
    judge = result["judge"]
    assert judge["url"] == stub_judge.url and judge["model"] == "stub-judge" and judge["weak"] is True
    answers = read_jsonl(run / result["mt_bench_answers"]["epoch1"])
    judgments = read_jsonl(run / result["mt_bench_judgments"]["epoch1"])
    # 4 judgments, and the preflight's one short request before training (issue 38)
    assert len(answers) == 2 and len(judgments) == 4 and stub_judge.handler.requests["GOOD"] == 5
    categories = {a["category"] for a in answers}
    assert {f"mt_bench_{c}" for c in categories} <= set(metrics)
    for answer in answers:
        assert len(answer["choices"][0]["turns"]) == 2 and answer["model_id"].startswith("tiny-llama-lora")
    for record in judgments:
        assert record["judged"] and record["score"] == 7.0 and record["judgment"].endswith("[[7]]")
    second = [j for j in judgments if j["turn"] == 2]
    for record, answer in zip(second, answers):
        assert record["judge"][1] in ("single-v1-multi-turn", "single-math-v1-multi-turn")
        assert answer["choices"][0]["turns"][1] in record["user_prompt"]
        assert "### Assistant A:\n" + answer["choices"][0]["turns"][0] in record["user_prompt"]

    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    report = capsys.readouterr().out
    assert "MT-BENCH" in report and "7.0" in report and "700" not in report  # 1-10, not scaled x100
    assert "mt-bench: judged by stub-judge" in report and "WEAK judge" in report
    assert main(["report", str(run), "--metric", "mt_bench_turn2"]) == 0  # the other MT-Bench columns
    report = capsys.readouterr().out
    assert "mt_bench_turn2 at the best epoch" in report and "7.0" in report


@needs_data("mt_bench", "question.jsonl")
@needs_data("alpaca", "alpaca_data_1k.json")
def test_without_a_judge_the_answers_are_saved_and_marked_not_judged(tmp_path):
    from peftlab.training.loop import train

    cfg = build_run_config(overrides=dict(
        task="mt-bench", model="tiny-llama", epochs=0, max_train_samples=4, max_length=64, max_eval_samples=2,
        max_new_tokens=4, report_to="none", output_dir=str(tmp_path / "run")))
    result = train(cfg)
    assert result["judge"]["status"] == "not judged" and result["judge"]["weak"] is None
    metrics = result["before"]["metrics"]
    assert metrics == {"mt_bench_judged": 0, "mt_bench_unjudged": 4}
    judgments = read_jsonl(tmp_path / "run" / result["mt_bench_judgments"]["before"])
    assert [j["reason"] for j in judgments] == [mt_bench.NOT_JUDGED] * 4
    assert len(read_jsonl(tmp_path / "run" / result["mt_bench_answers"]["before"])) == 2
