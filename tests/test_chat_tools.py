"""Tools in prompts and requests: template rendering, the Hermes fallback, prefills,
OpenAI and Anthropic request conversion, response_format checks. No daemon."""

from __future__ import annotations

import json

import pytest

import engine  # noqa: F401  (BLAS before mlx)
from adapters.http.anthropic_schema import conversation, tool_spec
from adapters.common.chat_turn import ToolSpec, render_chat
from adapters.common.json_output import parse_response_format
from adapters.common.errors import ApiError
from adapters.http.openai_tools import openai_tool_spec, template_kwargs
from adapters.common.tool_parsers import HermesParser
from engine.engine import load_tokenizer
from engine.prompts import chat_prompt_text, normalize_messages
from tests.checkpoints.common import write_tokenizer as write_plain_tokenizer
from tests.checkpoints.tools import write_tokenizer as write_tools_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The ChatML test tokenizer: its template knows no tools."""
    folder = tmp_path_factory.mktemp("plain")
    write_plain_tokenizer(folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def tools_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    write_tools_tokenizer(folder)
    return load_tokenizer(folder)


# -- rendering -------------------------------------------------------------------------


def test_plain_template_gets_tools_the_hermes_way(plain):
    text = chat_prompt_text(plain, HISTORY, [WEATHER])
    system, user, assistant, result = text.split("<|im_start|>")[1:5]
    assert system.startswith("system\nBe brief.\n\n# Tools") and json.dumps(WEATHER) in system
    assert user == "user\nWeather in Oslo?<|im_end|>\n"
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert assistant == f"assistant\n{call}<|im_end|>\n"
    assert result == "user\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
    assert text.endswith("<|im_start|>assistant\n")


def test_plain_template_without_tools_is_unchanged(plain):
    messages = [{"role": "user", "content": "hi"}]
    assert chat_prompt_text(plain, messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tools_aware_template_renders_tools_itself(tools_tokenizer):
    text = chat_prompt_text(tools_tokenizer, HISTORY, [WEATHER])
    assert "Functions you may call" in text and "You can call the functions" not in text
    assert json.dumps(WEATHER) in text
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response><|im_end|>" in text


def test_tool_calls_in_the_history_are_checked():
    with pytest.raises(ValueError, match="not valid JSON"):
        normalize_messages([{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(ValueError, match="needs a `function`"):
        normalize_messages([{"role": "assistant", "tool_calls": [{"type": "function"}]}])
    with pytest.raises(ValueError, match="tool_call_id"):
        normalize_messages([{"role": "tool", "tool_call_id": 3, "content": "x"}])
    out = normalize_messages([{"role": "assistant", "content": "", "tool_calls": [CALL]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


@pytest.mark.parametrize("choice, name, tail", [
    ("auto", None, "<|im_start|>assistant\n"),
    ("required", None, "<|im_start|>assistant\n<tool_call>"),
    ("named", "get_weather", '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '),
    ("none", None, "<|im_start|>assistant\n"),
])
def test_tool_choice_steers_by_prompt(tools_tokenizer, choice, name, tail):
    ids, turn = render_chat(tools_tokenizer, HISTORY[:2], ToolSpec((WEATHER,), choice, name))
    text = tools_tokenizer.decode(ids)
    assert text.endswith(tail) and turn.parser is HermesParser
    assert ("Functions you may call" in text) == (choice != "none")
    assert turn.prefill == tail.removeprefix("<|im_start|>assistant\n")


def test_forced_call_closes_a_think_block_the_template_opened(tools_tokenizer):
    _, auto = render_chat(tools_tokenizer, HISTORY[:2], ToolSpec((WEATHER,)), {"think_in_prompt": True})
    assert auto.thinking and auto.prefill == ""
    _, forced = render_chat(tools_tokenizer, HISTORY[:2], ToolSpec((WEATHER,), "required"), {"think_in_prompt": True})
    assert forced.prefill == "</think>\n\n<tool_call>"


def test_template_errors_are_value_errors(tmp_path):
    write_tools_tokenizer(tmp_path, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        chat_prompt_text(load_tokenizer(tmp_path), HISTORY[:2])


# -- OpenAI request fields ---------------------------------------------------------------


def test_openai_tool_spec():
    spec = openai_tool_spec({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                             "parallel_tool_calls": False})
    assert (spec.choice, spec.name, spec.parallel) == ("named", "get_weather", False)
    assert openai_tool_spec({}).choice == "none" and openai_tool_spec({"tools": [WEATHER]}).choice == "auto"
    bare = openai_tool_spec({"tools": [{"type": "function", "function": {"name": "ping"}}]})
    assert bare.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("body, needle", [
    ({"tools": {}}, "must be a list"),
    ({"tools": [{"type": "code_interpreter"}]}, "function tool"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "letters, digits"),
    ({"tools": [WEATHER, WEATHER]}, "unique"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tool_choice": "required"}, "no `tools`"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "boolean"),
    ({"functions": [{"name": "f"}]}, "deprecated"),
])
def test_openai_tool_errors(body, needle):
    with pytest.raises(ApiError) as info:
        openai_tool_spec(body)
    assert info.value.status == 400 and needle in info.value.message


def test_chat_template_kwargs_cannot_override_the_call():
    assert template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}) == {"enable_thinking": False}
    with pytest.raises(ApiError, match="tools"):
        template_kwargs({"chat_template_kwargs": {"tools": []}})


# -- response_format -----------------------------------------------------------------------


SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("fmt, content, valid, error", [
    ({"type": "json_object"}, '{"a": 1}', True, None),
    ({"type": "json_object"}, '```json\n{"a": 1}\n```', True, None),
    ({"type": "json_object"}, "[1, 2]", False, "not an object"),
    ({"type": "json_object"}, "hello", False, "not JSON"),
    (SCHEMA, '{"city": "Oslo"}', True, None),
    (SCHEMA, '{"city": 3}', False, "city: 3 is not of type 'string'"),
    (SCHEMA, "{}", False, "'city' is a required property"),
])
def test_response_format_is_checked_and_reported(fmt, content, valid, error):
    verdict = parse_response_format(fmt).check(content)
    assert verdict["type"] == fmt["type"] and verdict["valid"] is valid
    assert (error is None and verdict["error"] is None) or error in verdict["error"]


@pytest.mark.parametrize("fmt", [{"type": "xml"}, {"type": "json_schema"},
                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}])
def test_bad_response_formats_are_400s(fmt):
    with pytest.raises(ApiError):
        parse_response_format(fmt)
    assert parse_response_format({"type": "text"}) is None


# -- Anthropic conversion -------------------------------------------------------------------


def test_anthropic_conversation_maps_blocks_to_openai_messages():
    body = {"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools.", "cache_control": {}}],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "rain"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": True},
                    {"type": "tool_result", "tool_use_id": "toolu_3", "content": [
                        {"type": "image", "source": {}}, {"type": "text", "text": "a chart"}]},
                    {"type": "text", "text": "And tomorrow?"}]},
                {"role": "assistant", "content": "Tomorrow"}]}
    messages, prefix = conversation(body)
    assert prefix == "Tomorrow"
    assert messages == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "tool", "tool_call_id": "toolu_3", "content": "[image omitted: this model reads text only]\n\na chart"},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.mark.parametrize("messages, needle", [
    ([], "non-empty"),
    ([{"role": "system", "content": "x"}], "'user' or 'assistant'"),
    ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "image blocks are not supported"),
    ([{"role": "user", "content": [{"type": "tool_result"}]}], "tool_use_id"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y "}], "trailing whitespace"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], "tool_result"),
    ([{"role": "user", "content": 5}], "content blocks"),
])
def test_anthropic_conversation_errors(messages, needle):
    with pytest.raises(ApiError) as info:
        conversation({"messages": messages})
    assert info.value.status == 400 and needle in info.value.message


def test_anthropic_tools_and_tool_choice():
    tools = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER["function"]["parameters"]}]
    spec = tool_spec({"tools": tools, "tool_choice": {"type": "tool", "name": "get_weather",
                                                      "disable_parallel_tool_use": True}})
    assert spec.tools == (WEATHER,) and (spec.choice, spec.name, spec.parallel) == ("named", "get_weather", False)
    assert tool_spec({"tools": tools, "tool_choice": {"type": "any"}}).choice == "required"
    assert tool_spec({"tools": tools}).choice == "auto"
    for body, needle in [({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
                         ({"tools": [{"name": "f"}]}, "input_schema"),
                         ({"tools": tools, "tool_choice": {"type": "tool"}}, "needs a `name`"),
                         ({"tools": tools, "tool_choice": {"type": "sometimes"}}, "tool_choice.type")]:
        with pytest.raises(ApiError) as info:
            tool_spec(body)
        assert needle in info.value.message
