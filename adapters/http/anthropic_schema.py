"""Anthropic Messages requests in, scheduler requests and OpenAI-style chat messages out.

The conversation is converted to the OpenAI-style messages engine/prompts.py
renders (system text; user text; `tool_result` blocks as `tool` turns;
assistant text with `tool_use` blocks as `tool_calls`), so both dialects share
one template path, one tool-call reader and one scheduler. A final assistant
message is Anthropic's prefill: it begins the reply in the prompt and is not
repeated in the answer. Earlier thinking blocks are dropped: chat templates
render only the answer of past turns.

Differences from the hosted API, on purpose: `max_tokens` above the room left
in the model's context is lowered to fit (agents send one fixed budget, e.g.
32000, whatever the model); images, documents, server tools and structured
outputs (`output_config.format`) are refused with a 400, except an image inside a
tool_result, which becomes a one-line note; `thinking.budget_tokens`
is checked but not enforced; the `model` of a response is the loaded model's id.
Errors are raised as `ApiError`s; the app renders them in Anthropic's shape for
/v1/messages paths (`error_body`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from adapters.common.chat_turn import ToolSpec, render_chat
from adapters.common.errors import ApiError, bad
from adapters.common.tool_definitions import ToolFields, named_choice, parse_tools
from adapters.http.openai_schema import (
    DEFAULT_MODEL_ALIAS, TextParams, decode_extensions, get_bool, get_float, get_int, get_str,
)
from engine.sampler_settings import SamplerSettings
from mtplxd.requests import Priority, TextRequest
from mtplxd.runtime import ModelInfo

MAX_STOP_SEQUENCES = 256
IMAGE_OMITTED = "[image omitted: this model reads text only]"
MIN_THINKING_BUDGET = 1024  # the hosted API's lower bound
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                415: "invalid_request_error", 421: "invalid_request_error",
                429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


@dataclass(frozen=True)
class MessagesParams:
    text: TextParams  # the scheduler request and how to read the reply
    thinking: str  # "shown" | "omitted" (blocks without their text) | "hidden" (no blocks)


def parse_messages(body: dict, model: ModelInfo, priority: Priority, count_only: bool = False) -> MessagesParams:
    """`count_only`: /v1/messages/count_tokens, where `max_tokens` is not needed."""
    _check_model(body, model.id)
    max_tokens = None if count_only else get_int(body, "max_tokens", None, 1)
    if max_tokens is None and not count_only:
        raise bad("`max_tokens` is required", "max_tokens")
    _refuse_output_format(body.get("output_config"))
    thinking, enable_thinking = _thinking(body.get("thinking"), max_tokens)
    messages, prefix = conversation(body)
    spec = tool_spec(body)
    try:
        prompt, turn = render_chat(model.tokenizer, messages, spec, {"enable_thinking": enable_thinking}, prefix)
    except ValueError as e:
        raise bad(str(e), "messages") from None
    if len(prompt) >= model.context_length and not count_only:
        raise bad(f"prompt is too long: {len(prompt)} tokens > {model.context_length - 1} maximum", "messages")
    room = max(model.context_length - len(prompt), 1)
    stream = get_bool(body, "stream")
    mode, profile = decode_extensions(body)  # this daemon's extensions, as on the OpenAI side
    request = TextRequest(
        prompt_ids=tuple(prompt),
        max_tokens=min(max_tokens or 1, room),
        sampler=_sampler(body, model),
        mode=mode,
        profile=profile,
        depth=get_int(body, "depth", model.default_depth, 1, max(model.depth_max, 1)),
        stop=_stop_sequences(body.get("stop_sequences")),
        priority=priority,
    )
    return MessagesParams(TextParams(request, stream, False, turn), thinking)


def with_text(params: MessagesParams, text: TextParams) -> MessagesParams:
    return dataclasses.replace(params, text=text)


def _check_model(body: dict, model_id: str) -> None:
    name = get_str(body, "model")
    if name is None:
        raise bad("`model` is required", "model")
    if name not in (model_id, DEFAULT_MODEL_ALIAS):
        raise ApiError(404, f"model: {name} (this daemon serves {model_id!r}, also called 'default'; "
                            f"Claude Code: set ANTHROPIC_MODEL and ANTHROPIC_DEFAULT_HAIKU_MODEL to it)")


# -- the conversation --------------------------------------------------------------


def conversation(body: dict) -> tuple[list[dict], str]:
    """OpenAI-style messages, and the text a final assistant message begins the reply with."""
    out = []
    system = _system_text(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("`messages` must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad(f"`{where}.role` must be 'user' or 'assistant'", "messages")
        blocks = _blocks(message.get("content"), where)
        out += _user_turns(blocks, where) if message["role"] == "user" else [_assistant_turn(blocks, where)]
    prefix = ""
    if messages[-1]["role"] == "assistant":
        last = out.pop()
        if last.get("tool_calls"):
            raise bad("the last assistant message holds tool_use blocks: answer them with tool_result blocks "
                      "in a user message", "messages")
        prefix = last["content"]
        if prefix != prefix.rstrip():
            raise bad("final assistant content cannot end with trailing whitespace", "messages")
    return out, prefix


def _system_text(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    return _joined_text(_blocks(value, "system"), "system")


def _blocks(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad(f"`{where}.content` must be a string or a list of content blocks", "messages")
    return content


def _joined_text(blocks: list[dict], where: str) -> str:
    texts = []
    for block in blocks:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad(f"`{where}` may hold only text blocks here, got {block.get('type')!r}", "messages")
        texts.append(block["text"])
    return "\n\n".join(texts)


def _user_turns(blocks: list[dict], where: str) -> list[dict]:
    """Tool results first (they answer the previous assistant turn), then the user's text."""
    turns, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "tool_result":
            turns.append(_tool_result(block, f"{where}.content[{j}]"))
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        else:
            raise bad(_unsupported(kind, f"{where}.content[{j}]"), "messages")
    if texts or not turns:
        turns.append({"role": "user", "content": "\n\n".join(texts)})
    return turns


def _tool_result(block: dict, where: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"`{where}.tool_use_id` must be a non-empty string", "messages")
    content = block.get("content")
    blocks = _blocks(content, where) if content is not None else []
    # An agent's tool may return an image (a screenshot, an image file it read): the
    # model reads text only, so it is told one was left out rather than the session failing.
    blocks = [{"type": "text", "text": IMAGE_OMITTED} if b.get("type") == "image" else b for b in blocks]
    text = _joined_text(blocks, where)
    if block.get("is_error") is True:  # the template has no flag for it: say it in words
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant_turn(blocks: list[dict], where: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{where}.content[{j}]"))
        elif kind not in ("thinking", "redacted_thinking"):
            raise bad(_unsupported(kind, f"{where}.content[{j}]"), "messages")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_use(block: dict, where: str) -> dict:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(arguments, dict):
        raise bad(f"`{where}` (tool_use) needs a string `id` and `name` and an object `input`", "messages")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _unsupported(kind: Any, where: str) -> str:
    if kind in ("image", "document", "search_result"):
        return f"`{where}`: {kind} blocks are not supported by this model server; send text"
    return f"`{where}`: unsupported content block type {kind!r}"


# -- tools, thinking, sampling ------------------------------------------------------


def tool_spec(body: dict) -> ToolSpec:
    tools = parse_tools(body.get("tools"), _read_tool)
    choice = body.get("tool_choice")
    if choice is None:
        return ToolSpec(tools, "auto" if tools else "none")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise bad("`tool_choice.type` must be 'auto', 'any', 'tool' or 'none'", "tool_choice")
    parallel = not get_bool(choice, "disable_parallel_tool_use")
    if kind in ("auto", "none"):
        return ToolSpec(tools, kind, None, parallel)
    name = get_str(choice, "name") if kind == "tool" else None
    if kind == "tool" and not name:
        raise bad("`tool_choice` of type 'tool' needs a `name`", "tool_choice")
    mode, name = named_choice(name, tools, "tool_choice")
    return ToolSpec(tools, mode, name, parallel)


def _read_tool(tool: Any, where: str) -> ToolFields:
    """{"type"?: "custom", "name", "description"?, "input_schema"}: client tools only."""
    if not isinstance(tool, dict):
        raise bad(f"`{where}` must be an object", "tools")
    if tool.get("type", "custom") != "custom":
        raise bad(f"`{where}`: server tools ({tool.get('type')!r}) are not available here; "
                  "only client tools with an `input_schema`", "tools")
    if not isinstance(tool.get("input_schema"), dict):
        raise bad(f"`{where}.input_schema` must be a JSON Schema object", "tools")
    return ToolFields(tool.get("name"), tool.get("description"), tool["input_schema"], where)


def _thinking(value: Any, max_tokens: int | None) -> tuple[str, bool]:
    """(how thinking blocks are shown, whether the template is asked to think)."""
    if value is None:
        return "hidden", False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return "hidden", False
    if kind not in ("enabled", "adaptive"):
        raise bad("`thinking.type` must be 'enabled', 'adaptive' or 'disabled'", "thinking")
    if kind == "enabled":
        budget = get_int(value, "budget_tokens", None, MIN_THINKING_BUDGET)
        if budget is None:
            raise bad("`thinking.budget_tokens` is required", "thinking")
        if max_tokens is not None and budget >= max_tokens:
            raise bad("`max_tokens` must be greater than `thinking.budget_tokens`", "thinking")
    display = value.get("display")
    if display not in (None, "summarized", "omitted"):
        raise bad("`thinking.display` must be 'summarized' or 'omitted'", "thinking")
    return ("omitted" if display == "omitted" else "shown"), True


def _refuse_output_format(config: Any) -> None:
    """Structured outputs would need constrained decoding, which the exact sampler does
    not do: refused rather than ignored (`effort` is a hint and is ignored)."""
    if config is not None and not isinstance(config, dict):
        raise bad("`output_config` must be an object", "output_config")
    if config and config.get("format") is not None:
        raise bad("`output_config.format` (structured outputs) is not supported", "output_config")


def _sampler(body: dict, model: ModelInfo) -> SamplerSettings:
    top_p = get_float(body, "top_p", None, 0.0, 1.0)
    if top_p == 0:
        raise bad("`top_p` must be greater than 0", "top_p")
    return model.sampler(
        temperature=get_float(body, "temperature", None, 0.0, 1.0),  # Anthropic's documented range
        top_p=top_p,
        top_k=get_int(body, "top_k", None, 0),
    )


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad("`stop_sequences` must be a list of strings", "stop_sequences")
    if len(value) > MAX_STOP_SEQUENCES:
        raise bad(f"`stop_sequences` may hold at most {MAX_STOP_SEQUENCES} strings", "stop_sequences")
    return tuple(s for s in value if s)
