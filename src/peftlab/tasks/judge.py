"""LLM-as-a-judge client: FastChat's single-answer grading over any OpenAI-compatible chat endpoint.

The ``openai`` client (``base_url`` = ``--judge-url``) already retries what is worth retrying and bounds each
request (``--judge-timeout``, ``--judge-retries``). This module adds what a benchmark run needs: **no judgment
ever raises**; each request ends as a :class:`Verdict`, judged 1-10 or unjudged with the reason, so a flaky
judge costs scores, never the run. **A circuit breaker**: the first request that timed out or could not connect
opens it (other failures after ``max_consecutive_failures`` in a row): nothing more is sent, the rest is
recorded unjudged, and one line on stderr names the judge and the fix. So a dead or silent judge costs at most
one request's time, ``(retries + 1) * timeout`` plus back-off, whatever the number of questions.

Ratings are parsed as FastChat's ``llm_judge/common.py`` does (the first ``[[N]]``, else ``[N]``); one outside
1-10 is unjudged (the judge did not follow the format). :func:`judge_strength` labels a judge *weak* unless it
is a strong API model at a non-local address: a small local model's scores do not compare with published
MT-Bench numbers. :func:`probe` is the preflight's one short request.
"""

from __future__ import annotations

import ipaddress
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence
from urllib.parse import urlparse

from peftlab.extras import require

# FastChat's patterns (one_score_pattern, one_score_pattern_backup).
RATING = re.compile(r"\[\[(\d+\.?\d*)\]\]")
RATING_BACKUP = re.compile(r"\[(\d+\.?\d*)\]")
SCORE_RANGE = (1.0, 10.0)
JUDGING = "MT-Bench judging (--judge-url)"  # its row of peftlab.extras.NEEDS (the 'judge' extra: openai)
# Model-name prefixes of API judges strong enough for MT-Bench numbers to mean what they mean in the
# literature (FastChat's default judge is gpt-4). Anything else is labelled a weak judge.
STRONG_JUDGE_PREFIXES = ("gpt-4", "gpt-5", "o1", "o3", "o4", "chatgpt-4o", "claude-3-5", "claude-3-7",
                         "claude-3-opus", "claude-sonnet-4", "claude-opus-4", "claude-4", "gemini-1.5-pro",
                         "gemini-2", "gemini-3")


@dataclass(frozen=True)
class JudgeSettings:
    url: str  # the OpenAI-compatible base URL (ending in /v1 for most servers)
    model: str
    api_key: str
    timeout: float = 120.0  # seconds per request (each retry gets its own)
    retries: int = 3  # retries after the first attempt (the openai client's max_retries)
    parallel: int = 4  # requests in flight at once
    max_tokens: int = 2048  # FastChat's judge setting
    temperature: float = 0.0  # FastChat's judge setting
    max_consecutive_failures: int = 8


@dataclass
class Verdict:
    """One judgment: ``score`` (1-10) when ``judged``, else ``reason`` says why not."""

    judged: bool
    score: float | None = None
    reason: str | None = None
    reply: str | None = None  # the judge's text (kept for unparseable replies too)
    attempts_seconds: float = 0.0  # wall time of the request, retries included


def verdict_from_reply(text: str | None) -> Verdict:
    if text is None or not str(text).strip():
        return Verdict(False, reason="the judge's reply has no message content", reply=text)
    match = RATING.search(text) or RATING_BACKUP.search(text)  # as FastChat parses it
    if match is None:
        return Verdict(False, reason="no [[rating]] in the judge's reply", reply=text)
    rating, (low, high) = float(match.group(1)), SCORE_RANGE
    if not low <= rating <= high:
        return Verdict(False, reason=f"rating {rating:g} is outside {low:g}-{high:g}", reply=text)
    return Verdict(True, score=rating, reply=text)


def normalise_url(url: str) -> str:
    """The base URL the openai client wants: a full ``.../chat/completions`` URL is cut back to its base."""
    url = url.strip().rstrip("/")
    for suffix in ("/chat/completions", "/completions"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url


def is_local(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host in ("localhost", "") or host.endswith(".local"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private or address.is_link_local


def judge_strength(url: str, model: str) -> tuple[bool, str]:
    """(weak, why): a judge is strong only if its model is a known strong API model at a non-local address."""
    name = model.lower().rsplit("/", 1)[-1]
    if not name.startswith(STRONG_JUDGE_PREFIXES):
        return True, (f"'{model}' is not a strong API judge (MT-Bench scores are calibrated on GPT-4); "
                      "its scores do not compare with published MT-Bench numbers")
    if is_local(url):
        return True, f"served from a local address ({urlparse(url).hostname}), not the vendor's API"
    return False, f"'{model}' is a strong API judge"


class JudgeClient:
    """Sends (system, user) prompts to the judge; :meth:`judge_all` never raises for a failed request."""

    def __init__(self, settings: JudgeSettings):
        self.settings = settings
        self.client = _openai(settings)
        self._lock = threading.Condition()
        self._failures_in_a_row = 0
        self._in_flight = 0
        self._last_failure = ""
        self._broken = ""  # the failure that opened the circuit breaker (a timeout, a refused connection)

    def _may_send(self) -> bool:
        """Whether a request may go out now: never once the breaker is open. After an HTTP failure, no more
        requests are in flight than could still succeed before the cap, and a request is held (not dropped)
        while those in flight may yet reset the count."""
        cap = self.settings.max_consecutive_failures
        with self._lock:
            while not self._broken and 0 < self._failures_in_a_row < cap \
                    and self._failures_in_a_row + self._in_flight >= cap:
                self._lock.wait()
            if self._broken or self._failures_in_a_row >= cap:
                return False
            self._in_flight += 1
            return True

    def _done(self, failure: str | None, *, unreachable: bool = False) -> None:
        with self._lock:
            self._in_flight -= 1
            self._lock.notify_all()
            if failure is None:
                self._failures_in_a_row = 0
            else:
                self._failures_in_a_row += 1
                self._last_failure = failure
                if unreachable and not self._broken:
                    self._broken = failure

    def judge(self, system: str, user: str) -> Verdict:
        """One judgment; a transport failure (after the client's retries) is an unjudged Verdict."""
        if not self._may_send():
            if self._broken:
                return Verdict(False, reason="not sent: the judge stopped answering (a request failed: "
                                             f"{self._broken})")
            return Verdict(False, reason=f"not sent: the judge failed {self._failures_in_a_row} times in a row "
                                         f"(last: {self._last_failure})")
        started = time.monotonic()
        try:
            reply = self._complete(system, user)
        except Exception as err:  # noqa: BLE001 - every failure becomes a recorded reason, never a crash
            reason = describe_error(err, self.settings)
            self._done(reason, unreachable=unreachable(err))
            return Verdict(False, reason=reason, attempts_seconds=time.monotonic() - started)
        self._done(None)
        verdict = verdict_from_reply(reply)
        verdict.attempts_seconds = time.monotonic() - started
        return verdict

    def _complete(self, system: str, user: str) -> str | None:
        response = self.client.chat.completions.create(
            model=self.settings.model, temperature=self.settings.temperature, max_tokens=self.settings.max_tokens,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
        choices = getattr(response, "choices", None)
        if not choices:
            raise ValueError("the judge's reply has no choices")
        return choices[0].message.content

    def judge_all(self, prompts: Sequence[tuple[str, str]]) -> list[Verdict]:
        """Verdicts in the order of ``prompts`` ((system, user) pairs), ``parallel`` requests at a time."""
        if not prompts:
            return []
        workers = max(1, min(self.settings.parallel, len(prompts)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            verdicts = list(pool.map(lambda p: self.judge(*p), prompts))
        note = self.gave_up_note(verdicts)
        if note:
            print(note, file=sys.stderr, flush=True)
        return verdicts

    def gave_up_note(self, verdicts: Sequence[Verdict]) -> str | None:
        """The one line that says the judge was given up on (dead or silent), or None when it was not."""
        if self._broken:
            why = f"a request that timed out or could not connect ({self._broken})"
        elif self._failures_in_a_row >= self.settings.max_consecutive_failures:
            why = f"{self._failures_in_a_row} failed requests in a row (last: {self._last_failure})"
        else:
            return None
        unjudged = sum(1 for v in verdicts if not v.judged)
        return (f"peftlab: warning: judge {normalise_url(self.settings.url)} given up after {why}: {unjudged} of "
                f"{len(verdicts)} answers unjudged; "
                "fix: start the judge (e.g. peftlab serve-judge) or correct --judge-url, or raise --judge-timeout "
                "for a slow one; then `peftlab evaluate` the run again")


def unreachable(err: Exception) -> bool:
    """A judge that timed out or refused the connection (the breaker opens at once), not one that answered badly."""
    import openai

    return isinstance(err, (openai.APITimeoutError, openai.APIConnectionError))


PROBE_TIMEOUT = 10.0  # seconds the preflight's one request may wait to connect, and for each read


def _openai(settings: JudgeSettings):
    """The openai client of the judge: a float timeout bounds each phase (connect, each read and write, the wait for
    a pooled connection); the client retries what is worth retrying."""
    require(JUDGING)
    from openai import OpenAI

    return OpenAI(base_url=normalise_url(settings.url), api_key=settings.api_key, timeout=settings.timeout,
                  max_retries=settings.retries)


def probe(settings: JudgeSettings, timeout: float = PROBE_TIMEOUT) -> str | None:
    """One short request to the judge, no retry, each phase at most ``min(timeout, settings.timeout)`` seconds:
    None when it answers (any completion: the rating format is not checked), else why not (one line)."""
    from dataclasses import replace

    bounded = replace(settings, timeout=min(timeout, settings.timeout), retries=0)
    client = _openai(bounded)
    try:
        client.chat.completions.create(model=settings.model, temperature=0.0, max_tokens=8, messages=[
            {"role": "user", "content": "peftlab preflight: is the judge there? Reply [[1]]."}])
    except Exception as err:  # noqa: BLE001 - any failure is the reason the preflight names
        return describe_error(err, bounded)
    finally:
        client.close()
    return None


def describe_error(err: Exception, settings: JudgeSettings) -> str:
    """A one-line reason for an unjudged answer."""
    import openai

    attempts = settings.retries + 1
    if isinstance(err, openai.APITimeoutError):
        return f"timeout: no reply within {settings.timeout:g} s ({attempts} attempt(s))"
    if isinstance(err, openai.APIConnectionError):
        cause = err.__cause__ or err
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        return f"connection failed ({attempts} attempt(s)): {first}"
    if isinstance(err, openai.APIStatusError):
        body = str(getattr(err, "message", "") or "").strip().splitlines()
        return f"HTTP {err.status_code}" + (f": {body[0][:200]}" if body else "") + \
            (f" ({attempts} attempt(s))" if err.status_code in (408, 409, 429) or err.status_code >= 500 else "")
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__
