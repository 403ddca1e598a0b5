"""The Anthropic Messages API, mounted in the same Starlette app as the OpenAI one.

    POST /v1/messages               a message, streamed (SSE events) or not
    POST /v1/messages/count_tokens  {"input_tokens": N} for the same body, without generating

Same scheduler, same session bank and headers as the OpenAI side
(`X-Mtplx-Workspace`, `X-Mtplx-Priority`); the API key may come as
`x-api-key` (Anthropic's clients) or `Authorization: Bearer` (adapters/http/app.py
checks both). Errors on these paths come in Anthropic's shape
{"type": "error", "error": {"type", "message"}}. Request conversion:
adapters/http/anthropic_schema.py; response shapes: adapters/http/anthropic_stream.py.
"""

from __future__ import annotations

from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from adapters.http.anthropic_schema import parse_messages, with_text
from adapters.http.anthropic_stream import TOOL_ID_PREFIX, MessageShape, message_events
from adapters.common.errors import ApiError
from adapters.http.openai_schema import parse_json, parse_priority
from adapters.http.openai_stream import Releasing, Run, collect, final
from adapters.http.sessions import with_workspace
from mtplxd.requests import Done, TextDelta

MESSAGES_PATH = "/v1/messages"
PRIORITY_HEADER = "x-mtplx-priority"
SSE_PING_S = 15


def anthropic_routes(api: Any) -> list[Route]:
    """`api`: the OpenAI adapter's _Api (ready_model, submit, metrics)."""
    messages = _Messages(api)
    return [Route(MESSAGES_PATH, messages.create, methods=["POST"]),
            Route(f"{MESSAGES_PATH}/count_tokens", messages.count_tokens, methods=["POST"])]


def is_anthropic_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


class _Messages:
    def __init__(self, api: Any):
        self.api = api

    async def create(self, request: Request) -> Any:
        body = parse_json(await request.body())
        model = self.api.ready_model()
        params = parse_messages(body, model, parse_priority(request.headers.get(PRIORITY_HEADER)))
        params = with_text(params, with_workspace(params.text, request, body))
        shape = MessageShape(model.id, params.thinking)
        turn, prompt_tokens = params.text.turn, len(params.text.request.prompt_ids)
        if turn is None:  # parse_messages renders every conversation as a chat turn
            raise ApiError(500, "the messages were not rendered as a chat turn", code="internal_error")
        run = Run(self.api.submit(params.text.request, "anthropic"), self.api.metrics, request.url.path)
        if params.text.stream:
            stream = message_events(run, shape, turn, prompt_tokens)
            return Releasing(EventSourceResponse(stream, ping=SSE_PING_S), run)
        try:
            events = await collect(request, run)
        finally:
            run.release()
        output = turn.output(TOOL_ID_PREFIX)
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        content = shape.blocks(output.feed(text) + output.finish())
        return JSONResponse(shape.message(content, final(events, Done)))

    async def count_tokens(self, request: Request) -> Any:
        body = parse_json(await request.body())
        model = self.api.ready_model()
        params = parse_messages(body, model, parse_priority(request.headers.get(PRIORITY_HEADER)), count_only=True)
        return JSONResponse({"input_tokens": len(params.text.request.prompt_ids)})
