"""/v1/chat/completions: the request with its tools, and the reply read into OpenAI's shapes.

The reply goes through the model family's parsers (adapters/common/chat_turn.py):
<think> blocks become `reasoning_content`, tool calls become `tool_calls`
(finish_reason "tool_calls"), and only answer text reaches `content`. Streamed,
each call goes out whole in one `delta.tool_calls` chunk once it has parsed, so
a call that turns out malformed was never half-announced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from adapters.common.chat_turn import ChatTurn, Reply, read_all, render_chat
from adapters.common.json_output import ResponseFormat, parse_response_format
from adapters.common.errors import bad
from adapters.http.openai_schema import TextParams, check_model, text_params
from mtplxd.runtime import ModelInfo
from adapters.http.openai_tools import openai_tool_spec, template_kwargs
from adapters.common.streaming_text import Reasoning, Text
from adapters.common.tool_parsers import Call
from mtplxd.requests import Priority

CALL_ID_PREFIX = "call_"


def parse_chat(body: dict, model: ModelInfo, priority: Priority) -> TextParams:
    check_model(body, model.id)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("`messages` must be a non-empty list", "messages")
    spec = openai_tool_spec(body)
    response_format = parse_response_format(body.get("response_format"))
    try:
        prompt, turn = render_chat(model.tokenizer, messages, spec, template_kwargs(body))
    except ValueError as e:
        raise bad(str(e), "messages") from None
    params = text_params(body, model, prompt, "messages", priority)
    return dataclasses.replace(params, turn=turn, response_format=response_format)


def chat_message(turn: ChatTurn, text: str, finish_reason: str,
                 response_format: ResponseFormat | None) -> tuple[dict, str, dict]:
    """(message, finish_reason, extra top-level fields) of a whole reply."""
    reply: Reply = read_all(turn, text, CALL_ID_PREFIX)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None, "refusal": None}
    if reply.reasoning:
        message["reasoning_content"] = reply.reasoning
    if reply.calls:
        message["tool_calls"] = [_call(c) for c in reply.calls]
    else:
        message["content"] = reply.content  # a text answer is a string, even an empty one
    extra = {"response_format_check": response_format.check(reply.content)} if response_format else {}
    return message, "tool_calls" if reply.calls else finish_reason, extra


def _call(call: Call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


class ChatReader:
    """Streamed replies: text pieces in, chat.completion.chunk choices out."""

    def __init__(self, turn: ChatTurn, response_format: ResponseFormat | None):
        self.output = turn.output(CALL_ID_PREFIX)
        self.response_format = response_format
        self.calls = 0
        self.content = ""

    def feed(self, text: str) -> list[dict]:
        return [self._choice(p) for p in self.output.feed(text)]

    def finish(self) -> list[dict]:
        return [self._choice(p) for p in self.output.finish()]

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls else reason

    def final_fields(self) -> dict:
        return {"response_format_check": self.response_format.check(self.content)} if self.response_format else {}

    def _choice(self, piece: Text | Reasoning | Call) -> dict:
        if isinstance(piece, Reasoning):
            delta: dict = {"reasoning_content": piece.text}
        elif isinstance(piece, Text):
            self.content += piece.text
            delta = {"content": piece.text}
        else:
            delta = {"tool_calls": [_call(piece, self.calls)]}
            self.calls += 1
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
