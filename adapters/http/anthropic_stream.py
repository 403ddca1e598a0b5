"""Anthropic Messages responses: the message object and its stream of events.

A stream goes, as the hosted API sends it and the anthropic SDK's
MessageStream expects:

    message_start, ping,
    per content block: content_block_start, content_block_delta..., content_block_stop,
    message_delta (stop_reason, stop_sequence, cumulative usage), message_stop

or ends early with one `error` event. Blocks follow the reply: a thinking block
for reasoning (when the request enabled thinking), text blocks for answer
text, one tool_use block per call, sent whole (its input in one
input_json_delta) once the call has parsed.

Usage maps the session bank: `cache_read_input_tokens` is the part of the
prompt restored from it, `input_tokens` the rest.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from sse_starlette import ServerSentEvent

from adapters.http.anthropic_schema import error_body
from adapters.common.chat_turn import ChatTurn
from adapters.common.errors import ApiError
from adapters.http.openai_stream import Run, failure
from adapters.common.streaming_text import Reasoning, Text
from adapters.common.tool_parsers import Call
from mtplxd.requests import Done, Failed, TextDelta

TOOL_ID_PREFIX = "toolu_"
Piece = Text | Reasoning | Call


def usage(done: Done) -> dict:
    u = done.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


def stop_reason(done: Done, called: bool) -> str:
    if called:
        return "tool_use"
    if done.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if done.finish_reason == "length" else "end_turn"


class MessageShape:
    """The message object, whole or as message_start announces it."""

    def __init__(self, model_id: str, thinking: str):
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model_id = model_id
        self.thinking = thinking  # "shown" | "omitted" | "hidden"

    def message(self, content: list[dict], done: Done | None, input_tokens: int = 0) -> dict:
        called = any(block["type"] == "tool_use" for block in content)
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model_id, "content": content,
            "stop_reason": stop_reason(done, called) if done else None,
            "stop_sequence": done.stop_sequence if done and not called else None,
            "usage": usage(done) if done else {"input_tokens": input_tokens, "output_tokens": 0},
        }

    def blocks(self, pieces: list[Piece]) -> list[dict]:
        """Content blocks of a whole reply: runs of text or reasoning merged."""
        blocks: list[dict] = []
        for piece in pieces:
            if isinstance(piece, Call):
                blocks.append(_tool_use(piece))
            elif isinstance(piece, Text):
                if blocks and blocks[-1]["type"] == "text":
                    blocks[-1]["text"] += piece.text
                else:
                    blocks.append({"type": "text", "text": piece.text})
            elif self.thinking != "hidden":
                text = piece.text if self.thinking == "shown" else ""
                if blocks and blocks[-1]["type"] == "thinking":
                    blocks[-1]["thinking"] += text
                else:
                    blocks.append({"type": "thinking", "thinking": text, "signature": ""})
        return blocks


def _tool_use(call: Call) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}


class BlockStream:
    """Pieces of a streamed reply in, content block events out."""

    def __init__(self, thinking: str):
        self.thinking = thinking
        self.index = -1
        self.open: str | None = None  # the type of the block being written
        self.called = False

    def write(self, pieces: list[Piece]) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        for piece in pieces:
            if isinstance(piece, Call):
                events += self._start("tool_use", {**_tool_use(piece), "input": {}})
                events.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
                events += self.close()
                self.called = True
            elif isinstance(piece, Text):
                events += self._start("text", {"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": piece.text}))
            elif self.thinking != "hidden":
                events += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                if self.thinking == "shown":
                    events.append(self._delta({"type": "thinking_delta", "thinking": piece.text}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # the hosted API signs thinking; this daemon has nothing to sign
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return events

    def _start(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        if self.open == kind and kind != "tool_use":
            return []
        events = self.close()
        self.index += 1
        self.open = kind
        events.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block}))
        return events

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}


def _event(name: str, data: dict) -> ServerSentEvent:
    return ServerSentEvent(json.dumps(data), event=name)


def _error(error: ApiError) -> ServerSentEvent:
    return _event("error", error_body(error))


async def message_events(run: Run, shape: MessageShape, turn: ChatTurn, input_tokens: int) -> AsyncIterator[Any]:
    """The event stream of one message; always ends with message_stop or one error event."""
    try:
        yield _event("message_start", {"type": "message_start", "message": shape.message([], None, input_tokens)})
        yield _event("ping", {"type": "ping"})
        output, blocks = turn.output(TOOL_ID_PREFIX), BlockStream(shape.thinking)
        async for event in run.events():
            if isinstance(event, TextDelta) and event.text:
                for name, data in blocks.write(output.feed(event.text)):
                    yield _event(name, data)
            elif isinstance(event, Done):
                for name, data in blocks.write(output.finish()) + blocks.close():
                    yield _event(name, data)
                delta = {"stop_reason": stop_reason(event, blocks.called),
                         "stop_sequence": None if blocks.called else event.stop_sequence}
                yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(event)})
                yield _event("message_stop", {"type": "message_stop"})
            elif isinstance(event, Failed):
                yield _error(failure(event))
                return
        if not run.finished:
            yield _error(ApiError(500, "the job ended without a result"))
    except Exception as e:  # a bug here must still end the stream visibly, never hang it
        yield _error(ApiError(500, f"{type(e).__name__}: {e}"))
