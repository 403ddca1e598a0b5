"""Tool calls out of model text, one incremental parser per model family's format.

    hermes       Hermes / Qwen2.5 / Qwen3:  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    qwen3_coder  Qwen3-Coder XML:           <tool_call><function=NAME><parameter=P>value</parameter>
                                            </function></tool_call>
    deepseek     DeepSeek V3 / V3.1 / R1:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
                                            <｜tool▁call▁end｜><｜tool▁calls▁end｜>  (V3 also writes
                                            `function<｜tool▁sep｜>NAME` and a ```json fence)

A parser is fed the answer text as it streams and returns `Text` and `Call`
pieces. Text outside a call goes out as soon as it cannot be the start of a
marker; a call's body is held until its end marker (or the end of the output)
and then parsed. A call that does not parse, or names a tool the request did
not declare, comes back as plain text without its markers: markup never
reaches the answer, and nothing the model wrote is silently lost.

The format is read off the model's chat template (`parser_for`); a template
that knows no tools gets the Hermes layout (engine/tool_prompts.py), so Hermes
is also the default.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from adapters.common.streaming_text import Text, TrimmedText, find_first, partial_marker


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments`
    id: str = ""  # given by the adapter when the call goes out


Piece = Text | Call


class ToolParser:
    """The streaming machinery; subclasses name the markers and parse one call's body."""

    name: ClassVar[str]
    start: ClassVar[str]
    end: ClassVar[str]
    groups: ClassVar[tuple[str, ...]] = ()  # markers around a batch of calls: dropped

    def __init__(self, tools: Mapping[str, dict]):
        self.tools = tools  # declared name -> function definition (name, description, parameters)
        self.pending = ""  # text not decided yet (it may end in part of a marker)
        self.body: str | None = None  # inside a call: its text so far
        self.trim = TrimmedText()

    # -- per format ------------------------------------------------------------------

    def parse_call(self, body: str) -> tuple[str, Any] | None:
        """(name, arguments) from a call's body, or None when it does not parse."""
        raise NotImplementedError

    def fallback_text(self, body: str) -> str:
        """What a call that failed becomes in the answer: its body without markers."""
        return body.strip()

    @classmethod
    def prefill(cls, name: str | None) -> str:
        """The text that begins the assistant turn to force a call (of `name`, when given)."""
        return cls.start

    # -- streaming -------------------------------------------------------------------

    def feed(self, text: str) -> list[Piece]:
        self.pending += text
        out: list[Piece] = []
        while self._advance(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self.body is not None:  # cut off before its end marker (max_tokens, a stop string)
            self._close_call(self.body + self.pending, out)
        else:
            self._text(self.pending, out)
        self.pending, self.body = "", None
        tail = self.trim.flush()
        if tail:
            out.append(Text(tail))
        return out

    def _advance(self, out: list[Piece]) -> bool:
        """Consume up to the next marker; False when the rest must wait for more text."""
        # Inside a call, a new start (or a group marker) also ends it: the model
        # forgot the end marker. Outside, a stray end marker is swallowed.
        markers = (self.end, self.start, *self.groups)
        hit = find_first(self.pending, markers)
        if hit is None:
            cut = len(self.pending) - partial_marker(self.pending, markers)
            if self.body is not None:  # inside a call
                self.body += self.pending[:cut]
            else:
                self._text(self.pending[:cut], out)
            self.pending = self.pending[cut:]
            return False
        i, marker = hit
        if self.body is not None:  # inside a call
            self._close_call(self.body + self.pending[:i], out)
            self.body = None
        else:
            self._text(self.pending[:i], out)
        self.pending = self.pending[i + len(marker):]
        if marker == self.start:
            self.body = ""
        return True

    def _text(self, piece: str, out: list[Piece]) -> None:
        text = self.trim.text(piece)
        if text:
            out.append(Text(text))

    def _close_call(self, body: str, out: list[Piece]) -> None:
        try:
            parsed = self.parse_call(body)
        except (ValueError, TypeError, AttributeError, RecursionError):
            parsed = None
        if parsed is not None and parsed[0] in self.tools and isinstance(parsed[1], dict):
            self.trim.boundary()
            out.append(Call(parsed[0], json.dumps(parsed[1], ensure_ascii=False)))
        else:
            self._text(self.fallback_text(body), out)


def _strip_fence(text: str) -> str:
    """`text` without a surrounding ``` / ```json fence."""
    text = text.strip()
    if text.startswith("```"):
        text = text[3:]
        if text.startswith("json"):
            text = text[4:]
        text = text.removesuffix("```")
    return text.strip()


def _json_arguments(value: Any) -> Any:
    """Arguments as an object; some models write them as a JSON string."""
    return json.loads(value) if isinstance(value, str) else value


class HermesParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_call(self, body: str) -> tuple[str, Any] | None:
        data = json.loads(_strip_fence(body))
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        return data["name"], _json_arguments(arguments)

    @classmethod
    def prefill(cls, name: str | None) -> str:
        # The named form writes the JSON up to the arguments object, in the layout
        # the template uses for earlier calls (json.dumps spacing).
        return cls.start if name is None else f'{cls.start}\n{{"name": {json.dumps(name)}, "arguments": '


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
_JSON_TYPES = {"integer", "number", "boolean", "object", "array", "null"}


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_call(self, body: str) -> tuple[str, Any] | None:
        match = _FUNCTION.search(body)
        if match is None or body[: match.start()].strip():
            return None
        name = match.group(1).strip()
        properties = _properties(self.tools.get(name, {}))
        arguments = {}
        for param in _PARAMETER.finditer(match.group(2)):
            key = param.group(1).strip()
            arguments[key] = _typed(_strip_one_newline(param.group(2)), properties.get(key, {}))
        return name, arguments

    @classmethod
    def prefill(cls, name: str | None) -> str:
        return f"{cls.start}\n<function=" if name is None else f"{cls.start}\n<function={name}>\n"


def _properties(function: dict) -> dict:
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties if isinstance(properties, dict) else {}


def _strip_one_newline(value: str) -> str:
    """The template writes each value on lines of its own; that layout is not the value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Any) -> Any:
    """XML values are text: convert to the type the tool's schema declares."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    types = set(declared) if isinstance(declared, list) else {declared}
    if "string" in types or not types & _JSON_TYPES:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value  # the tool gets what the model wrote; its own validation will say


_DS = {"calls_begin": "<｜tool▁calls▁begin｜>", "calls_end": "<｜tool▁calls▁end｜>",
       "begin": "<｜tool▁call▁begin｜>", "end": "<｜tool▁call▁end｜>", "sep": "<｜tool▁sep｜>"}


class DeepSeekParser(ToolParser):
    name = "deepseek"
    start = _DS["begin"]
    end = _DS["end"]
    groups = (_DS["calls_begin"], _DS["calls_end"])

    def parse_call(self, body: str) -> tuple[str, Any] | None:
        head, sep, rest = body.partition(_DS["sep"])
        if not sep:
            return None
        if head.strip() in ("function", ""):  # V3: function<sep>NAME\n```json\n{...}\n```
            name, _, arguments = rest.partition("\n")
        else:  # V3.1: NAME<sep>{...}
            name, arguments = head, rest
        return name.strip(), _json_arguments(_strip_fence(arguments))

    def fallback_text(self, body: str) -> str:
        return body.replace(_DS["sep"], " ").strip()

    @classmethod
    def prefill(cls, name: str | None) -> str:
        # V3 and V3.1 lay out the name differently: force a call, not its name.
        return _DS["calls_begin"] + cls.start


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Qwen3CoderParser, DeepSeekParser)}


def parser_for(chat_template: Any) -> type[ToolParser]:
    """The tool-call format a chat template teaches its model (Hermes by default)."""
    texts = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    template = "\n".join(t for t in texts if isinstance(t, str))
    if _DS["begin"] in template or _DS["calls_begin"] in template:
        return DeepSeekParser
    if "<function=" in template and "<parameter=" in template:
        return Qwen3CoderParser
    return HermesParser
