"""The Anthropic Messages API through the real `anthropic` client against a real daemon.

Same scripted checkpoint as tests/test_openai_tools.py: after any chat prompt
the model writes <think>reasoning</think> and a Hermes <tool_call> for
get_weather(city="paris"). The raw event stream is read with httpx too, so the
exact event sequence (ping included) is checked, not only what the SDK keeps.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

import engine  # noqa: F401  (BLAS before mlx)
from tests.checkpoints.tools import WEATHER_SCRIPT, write_checkpoint
from tests.daemon_fixture import running_daemon

KEY = "sk-ant-test"
ASK = [{"role": "user", "content": "weather in paris?"}]
WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
OTHER = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
THINK = {"type": "enabled", "budget_tokens": 1024}
REASONING = "the user wants the weather"
CALL_TEXT = '{"name": "get_weather", "arguments": {"city": "paris"}}'


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("ck") / "scripted", WEATHER_SCRIPT)
    with running_daemon(tmp_path_factory.mktemp("state"), checkpoint, "--api-key", KEY) as info:
        yield info


@pytest.fixture(scope="module")
def client(daemon) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=daemon.base_url, api_key=KEY, max_retries=0, timeout=60)


def create(client, **kwargs):
    return client.messages.create(model=kwargs.pop("model", "default"), messages=kwargs.pop("messages", ASK),
                                  max_tokens=kwargs.pop("max_tokens", 2048), **kwargs)


def sse_events(daemon, body: dict, **headers: str) -> list[tuple[str, dict]]:
    """(event name, data) of a raw streamed response."""
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", **headers}
    with httpx.stream("POST", daemon.base_url + "/v1/messages", json={**body, "stream": True},
                      headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events, name = [], None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def test_tool_use_message(client):
    m = create(client, tools=[WEATHER])
    assert m.type == "message" and m.role == "assistant" and m.model == "scripted"
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    [block] = m.content  # thinking was not asked for: no thinking block
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert (block.name, block.input) == ("get_weather", {"city": "paris"})
    counted = client.messages.count_tokens(model="default", messages=ASK, tools=[WEATHER]).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
    assert m.usage.output_tokens > 0 and m.usage.cache_creation_input_tokens == 0


def test_thinking_blocks_when_enabled(client):
    m = create(client, tools=[WEATHER], thinking=THINK)
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == REASONING and m.content[0].signature == ""
    omitted = create(client, tools=[WEATHER], thinking={**THINK, "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None)) for b in omitted.content] == [("thinking", ""), ("tool_use", None)]


def test_stream_event_sequence(daemon):
    events = sse_events(daemon, {"model": "default", "max_tokens": 2048, "messages": ASK, "tools": [WEATHER],
                                 "thinking": THINK})
    assert [name for name, _ in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    thinking, tool = events[2][1], events[6][1]
    assert thinking["index"] == 0 and thinking["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert events[3][1]["delta"] == {"type": "thinking_delta", "thinking": REASONING}
    assert events[4][1]["delta"]["type"] == "signature_delta"
    assert tool["index"] == 1 and tool["content_block"]["type"] == "tool_use" and tool["content_block"]["input"] == {}
    assert json.loads(events[7][1]["delta"]["partial_json"]) == {"city": "paris"}
    delta = events[9][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0


def test_sdk_stream_gives_the_same_message(client):
    whole = create(client, tools=[WEATHER], thinking=THINK)
    with client.messages.stream(model="default", max_tokens=2048, messages=ASK, tools=[WEATHER],
                                thinking=THINK) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    assert [b.type for b in streamed.content] == [b.type for b in whole.content]
    assert streamed.content[1].input == whole.content[1].input and streamed.content[0].thinking == REASONING


def test_tool_results_in_the_history(client):
    messages = [*ASK,
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                    {"type": "text", "text": "and tomorrow?"}]}]
    m = create(client, messages=messages, tools=[WEATHER], system=[{"type": "text", "text": "Be brief."}])
    counted = client.messages.count_tokens(model="default", messages=messages, tools=[WEATHER],
                                           system=[{"type": "text", "text": "Be brief."}]).input_tokens
    short = client.messages.count_tokens(model="default", messages=ASK, tools=[WEATHER]).input_tokens
    assert m.stop_reason == "tool_use" and counted > short
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_choice(client, tool_choice):
    m = create(client, tools=[OTHER, WEATHER], tool_choice=tool_choice)
    assert m.stop_reason == "tool_use" and [(b.name, b.input) for b in m.content] == [("get_weather", {"city": "paris"})]


def test_a_call_that_is_not_allowed_is_a_text_block(client):
    for kwargs in ({}, {"tools": [WEATHER], "tool_choice": {"type": "none"}}, {"tools": [OTHER]}):
        m = create(client, **kwargs)
        assert m.stop_reason == "end_turn" and [(b.type, b.text) for b in m.content] == [("text", CALL_TEXT)]


def test_stop_sequences_and_max_tokens(client):
    m = create(client, stop_sequences=["paris", "zzz"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "paris")
    assert m.content[0].text == '{"name": "get_weather", "arguments": {"city": "'
    short = create(client, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_assistant_prefill_continues_the_reply(client):
    m = create(client, messages=[*ASK, {"role": "assistant", "content": "<tool_call>"}])
    assert m.stop_reason == "end_turn" and m.content[0].text.strip() == CALL_TEXT


def test_workspace_header_shares_the_session_bank(client, tmp_path):
    headers = {"X-Mtplx-Workspace": str(tmp_path)}
    create(client, tools=[WEATHER], extra_headers=headers)
    again = create(client, tools=[WEATHER], extra_headers=headers)
    assert again.usage.cache_read_input_tokens > 0
    sessions = httpx.get(str(client.base_url).rstrip("/") + "/v1/sessions", headers={"x-api-key": KEY}).json()
    assert str(tmp_path) in [s["workspace"] for s in sessions["data"]]


def test_errors_come_in_anthropics_shape(client, daemon):
    cases = [
        (anthropic.BadRequestError, "invalid_request_error", {"max_tokens": 0}),
        (anthropic.NotFoundError, "not_found_error", {"model": "claude-unknown"}),
        (anthropic.BadRequestError, "invalid_request_error", {"extra_body": {"temperature": 1.5}}),
        (anthropic.BadRequestError, "invalid_request_error", {"output_config": {"format": {
            "type": "json_schema", "schema": {"type": "object"}}}}),
        (anthropic.BadRequestError, "invalid_request_error",
         {"messages": [{"role": "user", "content": [{"type": "image", "source": {
             "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}),
        (anthropic.BadRequestError, "invalid_request_error", {"thinking": {"type": "enabled", "budget_tokens": 10}}),
        (anthropic.BadRequestError, "invalid_request_error",
         {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ]
    for error, kind, kwargs in cases:
        with pytest.raises(error) as info:
            client.messages.create(**{"model": "default", "max_tokens": 64, "messages": ASK, **kwargs})
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == kind, kwargs
        assert info.value.body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=daemon.base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        create(wrong)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_raw_http_errors_and_bearer_auth(daemon):
    url = daemon.base_url + "/v1/messages"
    r = httpx.post(url, content=b"{nope", headers={"x-api-key": KEY, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, json={"model": "default", "messages": ASK}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and "`max_tokens` is required" in r.json()["error"]["message"]
    r = httpx.post(url + "/nothing", json={}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url, json={}, headers={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/count_tokens", json={"model": "default", "messages": ASK},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
