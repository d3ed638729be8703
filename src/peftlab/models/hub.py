"""Calls to the Hugging Face Hub bounded in time, and a Hub that cannot be reached said in one line.

Some of huggingface_hub's API calls (``model_info`` / ``repo_info``, which transformers calls to resolve a
revision) pass ``timeout=None``, so a Hub that accepts the connection and never answers hangs ``from_pretrained``
for ever. :func:`bound_hub_calls` (before every model or tokenizer load, once per process) installs a client whose
transport caps every request's waits at ``HF_HUB_DOWNLOAD_TIMEOUT`` (10 s unless set); a client factory the user
set is left alone. :func:`hub_error`: a load that failed for want of the Hub, as one line with the offline fix."""

from __future__ import annotations

import os

from peftlab.errors import PeftlabError

HUB_TIMEOUT_SECONDS = 10  # huggingface_hub's own default for downloads and ETag requests
TIMEOUT_VARIABLES = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")
_bound = False


def hub_timeout() -> float:
    try:
        value = float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT") or HUB_TIMEOUT_SECONDS)
    except ValueError:
        value = HUB_TIMEOUT_SECONDS
    return value if value > 0 else HUB_TIMEOUT_SECONDS


def bound_hub_calls() -> None:
    """Give every Hub request of this process a timeout (see the module docstring); idempotent."""
    global _bound
    if _bound:
        return
    for name in TIMEOUT_VARIABLES:  # read when huggingface_hub is imported: effective if it is not yet
        os.environ.setdefault(name, str(HUB_TIMEOUT_SECONDS))
    import huggingface_hub
    from huggingface_hub.utils import _http

    _bound = True
    if _http._GLOBAL_CLIENT_FACTORY is not _http.default_client_factory:
        return  # the user's own client factory: theirs to bound
    timeout = hub_timeout()

    def factory():
        client = _http.default_client_factory()
        client._transport = _TimeoutCapping(client._transport, timeout)
        return client

    huggingface_hub.set_client_factory(factory)


class _TimeoutCapping:
    """An httpx transport wrapper: no phase of a request (connect, each read, each write, the pool) waits longer
    than ``seconds``, whether the caller set no timeout or a longer one (huggingface_hub retries a timed-out
    HEAD with 60 s, five times)."""

    def __init__(self, inner, seconds: float):
        self.inner, self.seconds = inner, seconds

    def handle_request(self, request):
        given = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {
            phase: self.seconds if given.get(phase) is None else min(given[phase], self.seconds)
            for phase in ("connect", "read", "write", "pool")}
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)


NETWORK_WORDS = ("couldn't connect", "could not connect", "timed out", "timeout", "connection refused",
                 "connecterror", "connection error", "network is unreachable", "name or service not known",
                 "temporary failure in name resolution")


def hub_error(name: str, err: BaseException, kind: str = "model") -> PeftlabError | None:
    """One line for a load of ``name`` (``kind``: model, dataset) failed by an unreachable Hub; None for others."""
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or err.__context__
    text = " | ".join(f"{type(e).__name__}: {e}" for e in chain).lower()
    if not any(word in text for word in NETWORK_WORDS):
        return None
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    first = next((str(e).strip().splitlines()[0] for e in chain if str(e).strip()), type(chain[0]).__name__)
    return PeftlabError(
        f"cannot reach the Hugging Face Hub ({endpoint}) to load {kind} '{name}' within {hub_timeout():g} s per "
        f"request: {first[:200]}",
        fix="connect to the network (HF_HUB_DOWNLOAD_TIMEOUT raises the timeout); offline, download the model "
            "once and set HF_HUB_OFFLINE=1, pass a local folder, or use a registered model (`peftlab models`)")
