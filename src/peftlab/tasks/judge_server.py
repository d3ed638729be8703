"""``peftlab serve-judge``: a local model behind an OpenAI-compatible chat endpoint, the offline MT-Bench judge.

Serves ``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /health`` (127.0.0.1:8000 by default) through
transformers' own serving (``transformers serve``'s chat handler: fastapi and uvicorn, the 'judge' extra),
one request at a time. Two things are peftlab's (:func:`_handler_class`): the model is loaded by peftlab's
registry and served under its registry name (``transformers serve <folder>`` pins a server to the folder's
path, so a registry name would get HTTP 400; another model name gets 404 here), and decoding is greedy
(FastChat's judge runs at temperature 0), stops at end of turn and caps ``max_tokens`` at
``--max-new-tokens``. The judge client labels such a judge *weak*.
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations (Request, dict)
# at runtime, and string annotations naming names imported inside build_app would not resolve.
import argparse
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from peftlab.argtypes import text
from peftlab.config_roles import INT64_MAX
from peftlab.errors import PeftlabError
from peftlab.extras import require

DEFAULT_HOST, DEFAULT_PORT, DEFAULT_MAX_NEW_TOKENS = "127.0.0.1", 8000, 512
STOP_SECONDS = 15.0  # Ctrl-C: how long the server may take to stop before the process ends anyway
SERVING = "peftlab serve-judge"  # its row of peftlab.extras.NEEDS
STARTUP_SECONDS = 30.0  # uvicorn binds in well under a second; this only bounds a wedged start


@dataclass(frozen=True)
class ServedModel:
    """The one model a judge server answers for."""

    name: str  # what clients send as ``model`` (the registry name, or the path/id given)
    model: Any  # a causal LM in eval mode, on its device
    tokenizer: Any  # with a chat template
    max_new_tokens: int  # cap on each reply's length


@dataclass
class RunningJudge:
    """A judge server running in a background thread: :attr:`url` is the base URL for ``--judge-url``."""

    url: str
    server: Any  # uvicorn.Server
    thread: threading.Thread
    generation_state: Any  # transformers' GenerationState (owns the inference thread)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.generation_state.shutdown()


# --------------------------------------------------------------------------- loading


def load_served_model(name: str, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, device: str = "auto") -> ServedModel:
    """Load ``name`` (a registry decoder, a local folder or a cached Hub id) for serving."""
    import torch

    from peftlab.models.registry import MODELS, load_model, load_tokenizer

    if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens <= INT64_MAX:  # generate() takes int64
        raise PeftlabError(f"--max-new-tokens must be a whole number >= 1 and <= {INT64_MAX}, got {max_new_tokens!r}")
    spec = MODELS.get(name)
    if spec is not None and spec.family != "decoder":
        decoders = ", ".join(n for n, s in MODELS.items() if s.family == "decoder")
        raise PeftlabError(f"model '{name}' is an encoder; a judge must generate text", fix=f"use a decoder: {decoders}")
    tokenizer = load_tokenizer(name)  # before the (slow) model: a tokenizer without a chat template fails fast
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise PeftlabError(f"model '{name}' has no chat template, so it cannot read chat messages",
                           fix="serve an instruction-tuned decoder, e.g. qwen2.5-coder-0.5b")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(name, head="causal-lm")
    try:
        model = model.to(device).eval()
    except (RuntimeError, AssertionError) as err:  # e.g. --device cuda on a machine without one
        raise PeftlabError(f"cannot use device '{device}': {str(err).strip().splitlines()[0]}",
                           fix="use --device cpu (or auto)") from None
    return ServedModel(name=name, model=model, tokenizer=tokenizer, max_new_tokens=max_new_tokens)


# --------------------------------------------------------------------------- transformers' server, adapted


def _require_transformers_server() -> None:
    require(SERVING)  # fastapi and uvicorn: the 'judge' extra
    try:
        import transformers.cli.serving.chat_completion  # noqa: F401 - present from transformers 5.x's serve rewrite
    except ImportError as err:
        raise PeftlabError(f"this transformers has no `transformers serve` module ({err})",
                           fix="pip install -U 'transformers>=5.24,<5.25'") from None


def _handler_class():
    """transformers' chat-completions handler serving one preloaded model with greedy, capped decoding."""
    from fastapi import HTTPException
    from transformers.cli.serving.chat_completion import ChatCompletionHandler

    from peftlab.tasks.generation import stop_token_ids

    class OneModelChatHandler(ChatCompletionHandler):
        def __init__(self, served: ServedModel, **kwargs):
            super().__init__(**kwargs)
            self.served = served

        def _resolve_model(self, body: dict):
            requested = body.get("model")
            if requested not in (None, self.served.name):
                raise HTTPException(status_code=404, detail=f"model '{requested}' is not served here; this "
                                                            f"server serves '{self.served.name}'")
            return self.served.name, self.served.model, self.served.tokenizer

        def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
            config = super()._build_generation_config(body, model_generation_config, use_cb=use_cb)
            config.max_new_tokens = min(config.max_new_tokens or self.served.max_new_tokens,
                                        self.served.max_new_tokens)
            # Greedy whatever the request asks; sampling knobs cleared so generate() does not warn about them.
            config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
            tokenizer = self.served.tokenizer
            config.eos_token_id = stop_token_ids(tokenizer) or config.eos_token_id  # EOS and end of turn
            config.pad_token_id = tokenizer.pad_token_id
            return config

    return OneModelChatHandler


def build_app(served: ServedModel):
    """The FastAPI app: chat completions through transformers' handler, the model list, a health check.
    Returns ``(app, generation_state)``."""
    _require_transformers_server()
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import GenerationState

    generation_state = GenerationState(continuous_batching=False, compile=False, cb_config=None)
    # The manager only classifies the model (text-only LLM); peftlab loaded the model, so it loads nothing.
    handler = _handler_class()(served, model_manager=ModelManager(), generation_state=generation_state)
    app = FastAPI(title=f"peftlab judge: {served.name}")

    @app.exception_handler(HTTPException)
    async def openai_shaped_error(_request: Request, exc: HTTPException):
        # OpenAI's error body, so clients show the reason (FastAPI's own {"detail": ...} reads "Error code: 404").
        return JSONResponse({"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                       "code": exc.status_code}}, status_code=exc.status_code)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: dict):
        return await handler.handle_request(body, request.headers.get("x-request-id") or str(uuid.uuid4()))

    @app.get("/v1/models")
    def list_models():
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": 0, "owned_by": "peftlab"}]})

    @app.get("/health")
    def health():
        return JSONResponse({"status": "ok"})

    return app, generation_state


def check_can_listen(host: str, port: int) -> None:
    """Fail before loading a model when the address cannot be bound (port in use, bad host)."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise PeftlabError(f"--port must be 0-65535 (0: any free port), got {port!r}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as err:
        raise PeftlabError(f"cannot listen on {host}:{port}: {err.strerror or err}",
                           fix="choose another --port (or stop the process using it), or another --host") from None


def start_judge_server(served: ServedModel, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                       log_level: str = "warning") -> RunningJudge:
    """Serve ``served`` from a background thread; returns once the server accepts connections."""
    import uvicorn

    check_can_listen(host, port)
    app, generation_state = build_app(served)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="peftlab-judge-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_SECONDS
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            generation_state.shutdown()
            raise PeftlabError(f"the judge server did not start on {host}:{port}",
                               fix="see the server's log above; choose another --port or --host")
        time.sleep(0.05)
    bound_port = server.servers[0].sockets[0].getsockname()[1]  # the real one when --port 0
    url_host = f"[{host}]" if ":" in host else host
    return RunningJudge(f"http://{url_host}:{bound_port}/v1", server, thread, generation_state)


# --------------------------------------------------------------------------- the subcommand


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "serve-judge", help="serve a local model as an OpenAI-compatible MT-Bench judge (a weak judge, offline)",
        description="Serve a local decoder at /v1/chat/completions (OpenAI-compatible, via transformers serve) "
                    "for `peftlab train --task mt-bench --judge-url`. Greedy decoding, one request at a time. "
                    "Scores from such a judge are labelled weak: they do not compare with GPT-4-judged MT-Bench.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, type=text,
                        help="a registered decoder with a chat template (e.g. qwen2.5-coder-0.5b, smollm2-135m; "
                             "see `peftlab models`) or a local model folder")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (keep it local: no auth)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on; 0 picks a free one")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help="cap on each reply's tokens (a request's max_tokens above it is lowered to it)")
    parser.add_argument("--device", type=text, default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                        help="uvicorn's log level (info logs each request)")
    parser.set_defaults(func=run)


def run(args) -> int:
    require(SERVING)  # the 'judge' extra: one line before anything else
    check_can_listen(args.host, args.port)  # before the model load, which takes a while for real models
    served = load_served_model(args.model, max_new_tokens=args.max_new_tokens, device=args.device)
    running = start_judge_server(served, host=args.host, port=args.port, log_level=args.log_level)
    device = next(served.model.parameters()).device
    print(f"serving {served.name} on {device} at {running.url} (OpenAI-compatible /chat/completions, /models; "
          f"greedy, at most {served.max_new_tokens} new tokens per reply); Ctrl-C stops it", flush=True)
    print(f"judge with: peftlab train --task mt-bench ... --judge-url {running.url} --judge-model {served.name} "
          "(the API key variable may hold any non-empty value, e.g. OPENAI_API_KEY=EMPTY; the scores are a "
          "weak judge's)", flush=True)
    # Ctrl-C (and a plain `kill`) stop the server even when this process was started with SIGINT ignored, as
    # a shell does for background jobs (`peftlab serve-judge ... &`): Python then installs no handler of its own.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        while running.thread.is_alive():
            running.thread.join(0.5)
    except KeyboardInterrupt:
        print("peftlab serve-judge: stopping", flush=True)
    finally:
        # transformers' serving can leave its inference thread blocked (seen on a loaded CPU: Ctrl-C printed
        # "stopping" and the process stayed): stop the server from a helper thread, wait a bounded time, and
        # end the process here. Nothing is left to write: replies are sent, the server keeps no files.
        stopper = threading.Thread(target=running.stop, name="peftlab-judge-stop", daemon=True)
        stopper.start()
        stopper.join(STOP_SECONDS)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
