"""The OpenAI-compatible HTTP adapter: a Starlette app the daemon serves with uvicorn.

    POST /v1/chat/completions   chat, streamed (SSE) or not
    POST /v1/completions        raw prompt; `suffix` makes it fill-in-the-middle
    POST /v1/embeddings         mean-pooled trunk states, float or base64
    GET  /v1/models[/{id}]      the one loaded model (id: its checkpoint folder name)
    GET  /health                open even with an API key; 200 only when ready
    GET  /metrics               Prometheus text, this app's own registry
    GET  /v1/status[/stream]    the live status document, once or every second (adapters/http/status.py)
    GET  /                      the daemon's page (adapters/http/page.py), open without the key

Chat completions take `tools`, `tool_choice`, `parallel_tool_calls`, tool turns in
the history and `response_format` json_object / json_schema (checked, reported as
`response_format_check`); replies carry `tool_calls` and `reasoning_content`
(adapters/http/openai_chat.py). The Anthropic Messages API (`/v1/messages`) is mounted
here too (adapters/http/anthropic.py).

Extensions: request fields `generation_mode` ("mtp" | "ar"), `depth` and `profile`
("sustained" | "burst" | "turbo"; unset, the daemon's profile picks the measured best
mode and depth, engine/profiles.py);
responses carry `mtp` {depth, drafted, accepted, acceptance_by_depth} and
`timings` besides `usage`. Header `X-Mtplx-Priority: interactive|normal|background`
picks the scheduling class (default normal). Header `X-Mtplx-Workspace: /abs/folder`
(or `metadata.workspace`) names the session-bank namespace; `usage.prompt_tokens_details.
cached_tokens` says how much of the prompt it restored. GET/DELETE /v1/sessions:
adapters/http/sessions.py. Refused with a 400 rather than
ignored: n != 1, logprobs, penalties, logit_bias, echo, best_of, non-text
content parts, legacy `functions`.

The adapter is thin: it validates (adapters/http/openai_schema.py), submits one
request to the scheduler and turns the ticket's events into OpenAI shapes
(adapters/http/openai_stream.py).
Every job it submits is released on every path out: when the client goes away
mid-stream or mid-request its ticket is cancelled, so the engine drops the job
before its next step.

Model names: openai clients always send one. The loaded model's id and
"default" are accepted (and a request without `model` means the loaded one);
any other name is a 404 model_not_found.
"""

from __future__ import annotations

import base64
import hmac
import time
from dataclasses import asdict
from typing import Any

import numpy as np
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.http.anthropic import anthropic_routes, is_anthropic_path
from adapters.http.anthropic_schema import error_body as anthropic_error_body
from adapters.http.body_limit import BodyLimit
from adapters.http.guard import HostOriginGuard, cors_options
from adapters.http.metrics import CONTENT_TYPE, Metrics, RequestCounter
from adapters.http.openai_chat import ChatReader, chat_message, parse_chat
from adapters.common.errors import ApiError
from adapters.http.openai_schema import TextParams, parse_completion, parse_embeddings, parse_json, parse_priority
from adapters.http.openai_stream import Releasing, Run, Shape, TokenMarks, collect, final, sse
from adapters.http.page import is_page_path, page_routes
from adapters.http.sessions import session_routes, with_workspace
from adapters.http.status import StatusBoard, status_routes
from mtplxd.config import Settings
from mtplxd.requests import Done, Embeddings, TextDelta
from mtplxd.runtime import ModelInfo, Runtime
from mtplxd.requests import NotReady, QueueFull, Ticket

PRIORITY_HEADER = "x-mtplx-priority"
MCP_PATH = "/mcp"  # adapters/mcp/server.py serves it in this app
INVALID_REQUEST = -32600  # JSON-RPC
OPEN_PATHS = ("/health",)  # reachable without the API key (liveness probes)
HEALTH_STATUS = {"loading": "loading", "ready": "ok", "failed": "failed", "stopping": "stopping", "stopped": "stopping"}
SSE_PING_S = 15  # keeps proxies from closing a stream while a long prompt prefills


def create_app(runtime: Runtime, settings: Settings) -> Starlette:
    metrics = Metrics()
    metrics.attach(runtime)
    api = _Api(runtime, settings, metrics)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/embeddings", api.embeddings, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics_text, methods=["GET"]),
        *session_routes(runtime),
        *anthropic_routes(api),
        *status_routes(StatusBoard(runtime)),
        *page_routes(settings.api_key is not None),
    ]
    middleware = [  # outermost first: refusals are counted too; CORS preflights need no key
        Middleware(RequestCounter, metrics=metrics),
        Middleware(HostOriginGuard, settings=settings, refuse=_refuse),
        Middleware(CORSMiddleware, **cors_options(settings)),
        Middleware(_ApiKey, key=settings.api_key),
        Middleware(BodyLimit, max_bytes=settings.max_body_bytes, refuse=_refuse),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)
    app.state.metrics = metrics
    return app


class _Api:
    def __init__(self, runtime: Runtime, settings: Settings, metrics: Metrics):
        self.runtime = runtime
        self.settings = settings
        self.metrics = metrics
        self.started = time.monotonic()

    # -- text ------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Any:
        body = parse_json(await request.body())
        model = self.ready_model()
        params = parse_chat(body, model, parse_priority(request.headers.get(PRIORITY_HEADER)))
        params = with_workspace(params, request, body)
        return await self._text(request, params, Shape(model.id, chat=True))

    async def completions(self, request: Request) -> Any:
        body = parse_json(await request.body())
        model = self.ready_model()
        params = parse_completion(body, model, parse_priority(request.headers.get(PRIORITY_HEADER)))
        params = with_workspace(params, request, body)
        return await self._text(request, params, Shape(model.id, chat=False))

    async def _text(self, request: Request, params: TextParams, shape: Shape) -> Any:
        run = Run(self.submit(params.request), self.metrics, request.url.path)
        if params.stream:
            reader = ChatReader(params.turn, params.response_format) if params.turn else None
            marks = TokenMarks(self.ready_model().tokenizer) if params.token_marks else None
            stream = sse(run, shape, params.include_usage, reader, marks)
            return Releasing(EventSourceResponse(stream, ping=SSE_PING_S), run)
        try:
            events = await collect(request, run)
        finally:
            run.release()
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        done = final(events, Done)
        if params.turn is None:
            return JSONResponse(shape.full(text, done))
        message, finish_reason, extra = chat_message(params.turn, text, done.finish_reason, params.response_format)
        return JSONResponse(shape.chat_full(message, finish_reason, done, **extra))

    # -- embeddings ------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Any:
        body = parse_json(await request.body())
        model = self.ready_model()
        embed, encoding = parse_embeddings(body, model, parse_priority(request.headers.get(PRIORITY_HEADER)))
        run = Run(self.submit(embed), self.metrics, request.url.path)
        try:
            result = final(await collect(request, run), Embeddings)
        finally:
            run.release()
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v, encoding)}
                for i, v in enumerate(result.vectors)]
        usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
        return JSONResponse({"object": "list", "data": data, "model": model.id, "usage": usage})

    # -- models, health, metrics -----------------------------------------------------

    async def models(self, request: Request) -> Any:
        model_id = self._model_id()
        data = [_model_card(model_id, self.started)] if model_id else []
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Any:
        name, model_id = request.path_params["model"], self._model_id()
        if name not in (model_id, "default") or model_id is None:
            raise ApiError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return JSONResponse(_model_card(model_id, self.started))

    async def health(self, request: Request) -> Any:
        stats = self.runtime.stats()
        status = HEALTH_STATUS.get(stats.state, stats.state)
        body: dict[str, Any] = {
            "status": status,
            "model": self.runtime.model_id(),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "queue": asdict(stats),
            "memory": self.runtime.memory(),
        }
        decoding = self.runtime.decoding()
        if decoding is not None:  # the profile and the mode/depth it picks per temperature
            body["decoding"] = decoding
        ranks = self.runtime.ranks()
        if ranks is not None:  # the model is split over several processes (mtplxd/ranks/)
            body["ranks"] = ranks
        if stats.state == "failed":
            body["error"] = self.runtime.load_error
        # What it serves degraded under and the user should fix (a full disk), one line each.
        body["warnings"] = self.runtime.warnings()
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics_text(self, request: Request) -> Any:
        return Response(self.metrics.render(self.runtime.stats(), self.runtime.decoding()), media_type=CONTENT_TYPE)

    # -- helpers ---------------------------------------------------------------------

    def ready_model(self) -> ModelInfo:
        state = self.runtime.state
        if state == "loading":
            raise ApiError(503, "the model is still loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "2"})
        if state == "failed":
            raise ApiError(503, self.runtime.failure(), code="model_failed")
        model = self.runtime.model()
        if state != "ready" or model is None:
            raise ApiError(503, "the daemon is shutting down", code="shutting_down")
        return model

    def _model_id(self) -> str | None:
        return self.runtime.model_id()

    def submit(self, request: Any, client: str = "openai") -> Ticket:
        try:
            return self.runtime.submit(request, client)
        except QueueFull as e:
            raise ApiError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after_s)}) from None
        except NotReady as e:
            raise ApiError(503, str(e), code="model_unavailable") from None


def _model_card(model_id: str, started: float) -> dict:
    created = int(time.time() - (time.monotonic() - started))
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mtplxd"}


def _encode_vector(vector: list[float], encoding: str) -> Any:
    if encoding == "float":
        return vector
    # openai-python asks for base64 by default and decodes it as little-endian float32
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")



# -- auth and errors ----------------------------------------------------------------------


class _ApiKey:
    """ASGI middleware: with an API key set, every path but /health and the page's files needs
    `Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's clients send
    the latter), compared in constant time."""

    def __init__(self, app: Any, key: str | None):
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.key is None or scope["path"] in OPEN_PATHS or is_page_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, bearer = headers.get("authorization", "").partition(" ")
        offered = [bearer.strip()] if scheme.lower() == "bearer" else []
        offered += [headers["x-api-key"].strip()] if "x-api-key" in headers else []
        if any(hmac.compare_digest(token.encode(), self.key) for token in offered):
            await self.app(scope, receive, send)
            return
        message = ("incorrect API key provided" if any(offered)
                   else "missing API key: send Authorization: Bearer <key> or x-api-key: <key>")
        error = ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await _error_response(scope["path"], error)(scope, receive, send)


def _error_response(path: str, error: ApiError, headers: dict[str, str] | None = None) -> Response:
    """OpenAI's error shape; Anthropic's on the Messages API paths; a JSON-RPC error
    (no request id known) on /mcp, for the refusals made before the MCP server reads."""
    if is_anthropic_path(path):
        body = anthropic_error_body(error)
    elif path == MCP_PATH:
        body = {"jsonrpc": "2.0", "id": None, "error": {"code": INVALID_REQUEST, "message": error.message}}
    else:
        body = error.body()
    return JSONResponse(body, status_code=error.status, headers=headers if headers is not None else error.headers)


def _refuse(path: str, status: int, message: str, code: str) -> Response:
    """A refusal by a middleware, before any route: in the route's own error form."""
    return _error_response(path, ApiError(status, message, code=code))


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error_response(request.url.path, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    error = ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", code=code)
    return _error_response(request.url.path, error, dict(exc.headers or {}))


async def _internal_error(request: Request, exc: Exception) -> Response:
    error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
    return _error_response(request.url.path, error)
