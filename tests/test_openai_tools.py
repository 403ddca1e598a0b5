"""Tool calls, reasoning and response_format on /v1/chat/completions, through the real
`openai` client against a real daemon.

The daemon serves the scripted checkpoint of tests/checkpoints/tools.py: after
any chat prompt it writes <think>reasoning</think> and a Hermes <tool_call> for
get_weather(city="paris"), through the real MTP decode path and detokenizer.
What the adapter makes of that text (a call, or plain text when the call is
not allowed) is what these tests check.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

import engine  # noqa: F401  (BLAS before mlx)
from adapters.common.chat_turn import ToolSpec, render_chat
from engine.engine import load_tokenizer
from tests.checkpoints.tools import WEATHER_SCRIPT, write_checkpoint
from tests.daemon_fixture import running_daemon

KEY = "sk-tools"
ASK = [{"role": "user", "content": "weather in paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
REASONING = "the user wants the weather"
CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "paris"}}'


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "scripted", WEATHER_SCRIPT)


@pytest.fixture(scope="module")
def daemon(checkpoint, tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("state"), checkpoint, "--api-key", KEY) as info:
        yield info


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(client, **kwargs):
    return client.chat.completions.create(model="default", messages=kwargs.pop("messages", ASK), max_tokens=40,
                                          **kwargs)


def only_call(message) -> tuple[str, dict]:
    [call] = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    return call.function.name, json.loads(call.function.arguments)


def test_tool_call_and_reasoning_are_parsed(client):
    choice = chat(client, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert only_call(choice.message) == ("get_weather", {"city": "paris"})


def test_streamed_chunks_come_in_order_and_carry_the_same_call(client):
    chunks = list(chat(client, tools=[WEATHER], stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    kinds = []
    for d in deltas[1:]:
        kind = ("reasoning" if d.model_extra.get("reasoning_content") else "call" if d.tool_calls
                else "content" if d.content else "empty")
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
    assert kinds == ["reasoning", "call", "empty"]  # the last chunk carries only the finish reason
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == REASONING
    [call] = [c for d in deltas for c in d.tool_calls or []]
    assert call.index == 0 and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "paris"})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens > 0


def test_tool_turns_in_the_history_are_rendered_by_the_template(client, checkpoint):
    messages = [*ASK,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = chat(client, messages=messages, tools=[WEATHER])
    prompt, _ = render_chat(load_tokenizer(checkpoint), messages, ToolSpec((WEATHER,)))
    assert r.usage.prompt_tokens == len(prompt)
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("extra", [{}, {"tools": [WEATHER], "tool_choice": "none"}, {"tools": [OTHER]}])
def test_a_call_that_is_not_allowed_is_plain_text_without_markup(client, extra):
    """No tools, tool_choice none, or a tool the request did not declare."""
    choice = chat(client, **extra).choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == CALL_TEXT
    assert choice.message.model_extra["reasoning_content"] == REASONING


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_begins_the_call(client, tool_choice):
    choice = chat(client, tools=[OTHER, WEATHER], tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == "tool_calls" and only_call(choice.message) == ("get_weather", {"city": "paris"})
    assert "reasoning_content" not in choice.message.model_extra  # the forced call skipped the thinking


def test_response_format_is_checked_and_reported(client):
    r = chat(client, response_format={"type": "json_object"})
    assert r.choices[0].message.content == CALL_TEXT
    assert r.model_extra["response_format_check"] == {"type": "json_object", "valid": True, "error": None}
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}}
    chunks = list(chat(client, response_format=schema, stream=True))
    check = chunks[-1].model_extra["response_format_check"]
    assert check["valid"] is False and "'answer' is a required property" in check["error"]


@pytest.mark.parametrize("kwargs, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     "response_format"),
    ({"extra_body": {"chat_template_kwargs": {"add_generation_prompt": False}}}, "chat_template_kwargs"),
])
def test_bad_tool_requests_are_openai_400s(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as bad:
        chat(client, **kwargs)
    assert bad.value.body["param"].startswith(param) and bad.value.body["type"] == "invalid_request_error"


def test_x_api_key_is_accepted_too(daemon):
    assert httpx.get(daemon.base_url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = httpx.get(daemon.base_url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
