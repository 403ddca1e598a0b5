"""One submitted job as the OpenAI adapter sees it, and the shapes its events become.

`Run` wraps a scheduler Ticket and remembers whether the job finished, so
every way out of a request (done, client gone, error) can `release()` it and
an unfinished job is cancelled before its next engine step. `Shape` builds
OpenAI's chat.completion / text_completion bodies and stream chunks; `sse`
turns a run into the event stream, which always ends with `[DONE]` or one
final error event, never a hung client.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Protocol

import anyio
from starlette.requests import Request
from starlette.responses import Response

from adapters.http.metrics import Metrics
from adapters.common.errors import ApiError
from mtplxd.requests import Done, Embeddings, Failed, TextDelta
from mtplxd.requests import Ticket


class Run:
    """A ticket plus whether it finished; `release()` cancels it unless it did."""

    def __init__(self, ticket: Ticket, metrics: Metrics, endpoint: str):
        self.ticket = ticket
        self.metrics = metrics
        self.endpoint = endpoint
        self.finished = False
        self._released = False

    async def events(self) -> AsyncIterator[Any]:
        async for event in self.ticket.coalesced():
            if isinstance(event, (Done, Embeddings, Failed)):
                self.finished = True
            yield event

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if not self.finished:
            self.ticket.cancel()  # the scheduler drops the job before its next step
            self.metrics.cancelled.labels(self.endpoint).inc()


class Releasing:
    """ASGI wrapper: releases the run however the response ends (finished, client
    gone, or the response never started), so no job outlives its client."""

    def __init__(self, response: Response, run: Run):
        self.response = response
        self.run = run

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.run.release()


async def collect(request: Request, run: Run) -> list[Any]:
    """All events of a non-streamed job, giving up as soon as the client disconnects."""
    events: list[Any] = []
    gone = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def watch_disconnect() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone.set()
            tg.cancel_scope.cancel()

        tg.start_soon(watch_disconnect)
        async for event in run.events():
            events.append(event)
        tg.cancel_scope.cancel()
    if gone.is_set() and not run.finished:
        # Nobody reads this answer; 499 (nginx's "client closed request") keeps
        # such requests apart from server errors in the request metrics.
        raise ApiError(499, "the client closed the request", code="client_closed_request")
    return events


def final(events: list[Any], kind: type) -> Any:
    for event in events:
        if isinstance(event, Failed):
            raise failure(event)
        if isinstance(event, kind):
            return event
    raise ApiError(500, "the job ended without a result", code="internal_error")


def failure(event: Failed) -> ApiError:
    if event.kind == "invalid":
        return ApiError(400, event.message)
    if event.kind == "shutdown":
        return ApiError(503, event.message, code="shutting_down")
    return ApiError(500, event.message, code="internal_error")


# -- response shapes ------------------------------------------------------------------


class Shape:
    """OpenAI's chat.completion / text_completion bodies and their stream chunks."""

    def __init__(self, model_id: str, chat: bool):
        self.model_id = model_id
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def chunk(self, choices: list[dict], **extra: Any) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                "choices": choices, **extra}
        return json.dumps(body)

    def delta(self, text: str, finish_reason: str | None = None, role: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def full(self, text: str, done: Done) -> dict:
        if self.chat:
            return self.chat_full({"role": "assistant", "content": text, "refusal": None}, done.finish_reason, done)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_id,
                "choices": [choice], **stats_body(done)}

    def chat_full(self, message: dict, finish_reason: str, done: Done, **extra: Any) -> dict:
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model_id,
                "choices": [choice], **stats_body(done), **extra}


def stats_body(done: Done) -> dict:
    """usage (OpenAI's fields) plus this daemon's `mtp` and `timings` extensions."""
    u, m = done.usage, done.mtp
    return {
        "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                  "total_tokens": u.prompt_tokens + u.completion_tokens,
                  "prompt_tokens_details": {"cached_tokens": u.cached_tokens}},
        "mtp": {"depth": m.depth, "drafted": m.drafted, "accepted": m.accepted,
                "acceptance_by_depth": m.acceptance_by_depth()},
        "timings": {"time_to_first_token_s": done.time_to_first_token_s,
                    "decode_tokens_per_s": done.decode_tokens_per_s},
    }


class Reader(Protocol):
    """Turns streamed text into chat choices (adapters/http/openai_chat.ChatReader)."""

    def feed(self, text: str) -> list[dict]: ...
    def finish(self) -> list[dict]: ...
    def finish_reason(self, reason: str) -> str: ...
    def final_fields(self) -> dict: ...


class TokenMarks:
    """The `token_marks` extension: how each streamed token was produced. A mark is
    {"text", "source"}: source k >= 1 a draft of head position k the trunk accepted, 0
    the trunk's own token; text: the token's own spelling after the tokens before it.
    Joined, the texts spell the raw output: the content may lag them by a few characters
    (held while a word or a stop string is undecided) and leaves control tokens out."""

    CONTEXT = 4  # tokens decoded before each one: a tokenizer spells a word's leading space by context

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.pending: list[dict] = []
        self.context: list[int] = []

    def add(self, delta: TextDelta) -> None:
        ids = delta.token_ids
        sources = delta.sources or (0,) * len(ids)
        pieces = [self._piece(t) for t in ids]
        self.pending += [{"text": p, "source": k} for p, k in zip(pieces, sources)]

    def _piece(self, token: int) -> str:
        """The text `token` adds after the few tokens before it."""
        before_ids = self.context[-(self.CONTEXT - 1):]
        self.context = [*before_ids, token]
        before = self.tokenizer.decode(before_ids, skip_special_tokens=True)
        after = self.tokenizer.decode(self.context, skip_special_tokens=True)
        return after[len(before):] if after.startswith(before) else self.tokenizer.decode([token])

    def take(self) -> dict:
        """The chunk field with the marks not yet sent ({} when none are waiting)."""
        marks, self.pending = self.pending, []
        return {"token_marks": marks} if marks else {}


async def sse(run: Run, shape: Shape, include_usage: bool, reader: Reader | None = None,
              marks: TokenMarks | None = None) -> AsyncIterator[str]:
    """The event stream; always ends with `[DONE]` or one final error event. A chat
    stream's text goes through `reader` (reasoning, tool calls) when there is one; with
    `marks`, chunks carry the `token_marks` of their tokens (none without: unchanged)."""
    extra = {"usage": None} if include_usage else {}  # OpenAI: usage null until the last chunk
    take = marks.take if marks is not None else dict
    try:
        if shape.chat:  # the role arrives at once, before the prompt is even prefilled
            yield shape.chunk([shape.delta("", role=True)], **extra)
        async for event in run.events():
            if isinstance(event, TextDelta):
                if marks is not None:
                    marks.add(event)
                if not event.text:
                    continue
                for choice in reader.feed(event.text) if reader else [shape.delta(event.text)]:
                    yield shape.chunk([choice], **take(), **extra)
            elif isinstance(event, Done):
                stats = stats_body(event)
                reason: str  # the reader may answer "tool_calls"
                reason, fields = event.finish_reason, {}
                if reader:
                    for choice in reader.finish():
                        yield shape.chunk([choice], **extra)
                    reason, fields = reader.finish_reason(reason), reader.final_fields()
                yield shape.chunk([shape.delta("", reason)], mtp=stats["mtp"], **fields, **take(), **extra)
                if include_usage:
                    yield shape.chunk([], **stats)
            elif isinstance(event, Failed):
                yield json.dumps(failure(event).body())
                return
        if not run.finished:
            yield json.dumps(ApiError(500, "the job ended without a result").body())
            return
        yield "[DONE]"
    except Exception as e:  # a bug here must still end the stream visibly, never hang it
        yield json.dumps(ApiError(500, f"{type(e).__name__}: {e}", code="internal_error").body())
