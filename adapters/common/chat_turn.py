"""One chat turn, protocol-neutral: the prompt with its tools, and how to read the reply.

Both HTTP dialects (OpenAI chat completions, Anthropic messages) reduce their
request to OpenAI-style messages plus a `ToolSpec`, render it here through the
model's own chat template, and read the model's text back through an
`AssistantOutput`: reasoning, answer text and tool calls, streamed, with the
same pieces whether the text arrives at once or token by token.

tool_choice "required" or a named function steers by prompt: the assistant
turn is begun with the format's call opener (and the name), which the model
then continues. Sampling stays exact (it is an ordinary prompt); the reply
is still validated, so a model that wanders off yields text, not a bad call.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from adapters.common.reasoning import THINK_END, ThinkSplitter, prompt_opens_think
from adapters.common.streaming_text import Reasoning, Text
from adapters.common.tool_parsers import Call, ToolParser, parser_for
from engine.prompts import chat_prompt_text

Choice = Literal["auto", "none", "required", "named"]
Piece = Text | Reasoning | Call


@dataclass(frozen=True)
class ToolSpec:
    tools: tuple[dict, ...] = ()  # OpenAI form {"type": "function", "function": {...}}, as templates expect
    choice: Choice = "auto"
    name: str | None = None  # the function `choice == "named"` names
    parallel: bool = True

    def rendered(self) -> list[dict] | None:
        """Tools for the prompt: none at all when the model may not call any."""
        return list(self.tools) if self.tools and self.choice != "none" else None

    def declared(self) -> dict[str, dict]:
        """The functions a reply may call, by name (none when tool_choice is none)."""
        if self.choice == "none":
            return {}
        functions = {t["function"]["name"]: t["function"] for t in self.tools}
        return {self.name: functions[self.name]} if self.choice == "named" and self.name else functions


@dataclass(frozen=True)
class ChatTurn:
    """How to read the reply to a rendered prompt."""

    parser: type[ToolParser]
    spec: ToolSpec = field(default_factory=ToolSpec)
    prefill: str = ""  # text this daemon began the assistant turn with: part of the reply
    thinking: bool = False  # the prompt left a <think> block open

    def output(self, id_prefix: str) -> AssistantOutput:
        return AssistantOutput(self, id_prefix)


def render_chat(tokenizer: Any, messages: list[dict], spec: ToolSpec,
                template_kwargs: dict | None = None, assistant_prefix: str = "") -> tuple[list[int], ChatTurn]:
    """Prompt ids and the turn's reading rules. `assistant_prefix`: text the client
    began the reply with (Anthropic's prefill), in the prompt but not in the reply.
    Raises ValueError for messages the template cannot render."""
    text = chat_prompt_text(tokenizer, messages, spec.rendered(), template_kwargs) + assistant_prefix
    parser = parser_for(getattr(tokenizer, "chat_template", None))
    thinking = prompt_opens_think(text)
    prefill = ""
    if spec.choice in ("required", "named") and spec.tools and not assistant_prefix:
        prefill = parser.prefill(spec.name if spec.choice == "named" else None)
        if thinking:  # a forced call skips the reasoning the template opened
            prefill = f"{THINK_END}\n\n{prefill}"
    ids = list(tokenizer.encode(text + prefill, add_special_tokens=False))
    return ids, ChatTurn(parser, spec, prefill, thinking)


class AssistantOutput:
    """The reply split as it streams: feed text pieces, get `Reasoning`, `Text` and `Call`
    pieces; `finish` at the end. Calls get ids; with parallel calls off, only the first
    call goes out (later ones are dropped, never turned into text)."""

    def __init__(self, turn: ChatTurn, id_prefix: str):
        self.think = ThinkSplitter(inside=turn.thinking)
        self.parser = turn.parser(turn.spec.declared())
        self.parallel = turn.spec.parallel
        self.id_prefix = id_prefix
        self.calls = 0
        # The prefill is the beginning of the reply: parse it, then go on with the model's text.
        self._early: list[Piece] = []
        self._early = self.feed(turn.prefill) if turn.prefill else []

    def feed(self, text: str) -> list[Piece]:
        out = self._route(self.think.feed(text))
        if self._early:
            out, self._early = self._early + out, []
        return out

    def finish(self) -> list[Piece]:
        out = self._early + self._route(self.think.finish())
        self._early = []
        return out + self._accept(self.parser.finish())

    def _route(self, pieces: list[Text | Reasoning]) -> list[Piece]:
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, Reasoning):
                out.append(piece)
            else:
                out += self._accept(self.parser.feed(piece.text))
        return out

    def _accept(self, pieces: list[Text | Call]) -> list[Piece]:
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, Call):
                if self.calls and not self.parallel:
                    continue
                self.calls += 1
                piece = Call(piece.name, piece.arguments, f"{self.id_prefix}{uuid.uuid4().hex[:24]}")
            out.append(piece)
        return out


@dataclass
class Reply:
    """A whole reply, merged: what a non-streamed response carries."""

    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)


def read_all(turn: ChatTurn, text: str, id_prefix: str) -> Reply:
    output = turn.output(id_prefix)
    return collect(output.feed(text) + output.finish())


def collect(pieces: list) -> Reply:
    """Reasoning, text and calls of a reply's pieces, in order."""
    reply = Reply()
    for piece in pieces:
        if isinstance(piece, Reasoning):
            reply.reasoning += piece.text
        elif isinstance(piece, Text):
            reply.content += piece.text
        else:
            reply.calls.append(piece)
    return reply
