"""Tool-call and reasoning parsers on recorded model outputs, one-shot and streamed.

Each recording is text in the layout a model family writes (Hermes / Qwen2.5,
Qwen3 with <think>, Qwen3-Coder XML, DeepSeek V3 / V3.1 / R1). The streamed
path must give the same reasoning, text and calls as the one-shot parse
wherever the text is cut into chunks, and no marker may reach text or
reasoning.
"""

from __future__ import annotations

import json
import random

import pytest

from adapters.common.chat_turn import AssistantOutput, ChatTurn, Reply, ToolSpec, collect, read_all
from adapters.common.reasoning import ThinkSplitter, prompt_opens_think
from adapters.common.streaming_text import Reasoning, Text, partial_marker
from adapters.common.tool_parsers import Call, DeepSeekParser, HermesParser, Qwen3CoderParser, parser_for


def tool(name: str, **properties: str) -> dict:
    schema = {"type": "object", "properties": {k: {"type": v} for k, v in properties.items()}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = (tool("get_weather", city="string", days="integer"), tool("get_time", timezone="string"),
         tool("read_file", path="string", limit="integer"), tool("write_file", path="string", content="string"),
         tool("set_flags", flags="object", dry_run="boolean"))
MARKERS = ("<tool_call", "</tool_call", "<think", "</think", "<｜", "｜>")
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def expected(reasoning: str = "", content: str = "", calls: list[tuple[str, dict]] = ()) -> tuple:
    return reasoning, content, [(name, args) for name, args in calls]


# (parser, recorded output, (reasoning, content, calls))
RECORDINGS = {
    "hermes_two_calls": (HermesParser, (
        "I will look that up.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        "{\"city\": \"Paris\", \"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
        "\"arguments\": {\"timezone\": \"Europe/Paris\"}}\n</tool_call>"),
        expected("", "I will look that up.", [("get_weather", {"city": "Paris", "days": 3}),
                                              ("get_time", {"timezone": "Europe/Paris"})])),
    "hermes_arguments_as_string": (HermesParser,
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"timezone\\\": \\\"UTC\\\"}\"}\n</tool_call>",
        expected("", "", [("get_time", {"timezone": "UTC"})])),
    "qwen3_think_then_call": (HermesParser, (
        "<think>\nThe user asks for the weather in Paris. I should call get_weather.\n</think>\n\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
        expected("The user asks for the weather in Paris. I should call get_weather.", "",
                 [("get_weather", {"city": "Paris"})])),
    "qwen3_empty_think_answer": (HermesParser,
        "<think>\n\n</think>\n\nThe capital of France is Paris.\nIt has 2 million people.\n",
        expected("", "The capital of France is Paris.\nIt has 2 million people.\n")),
    "plain_code_answer": (HermesParser,
        "Use a comparison:\n\n```python\nif a < b and b > c:\n    print(a<b)\n```\n",
        expected("", "Use a comparison:\n\n```python\nif a < b and b > c:\n    print(a<b)\n```\n")),
    "hermes_text_after_call": (HermesParser,
        "Checking.\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\nDone, see above.",
        expected("", "Checking.\nDone, see above.", [("get_time", {})])),
    "qwen3_coder_xml": (Qwen3CoderParser, (
        "I'll read the file first.\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.py\n"
        "</parameter>\n<parameter=limit>\n40\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=write_file>\n<parameter=path>\nout.py\n</parameter>\n<parameter=content>\n"
        "def f():\n    return 1\n\n</parameter>\n</function>\n</tool_call>"),
        expected("", "I'll read the file first.", [("read_file", {"path": "src/main.py", "limit": 40}),
                                                    ("write_file", {"path": "out.py", "content": "def f():\n    return 1\n"})])),
    "qwen3_coder_typed_values": (Qwen3CoderParser, (
        "<tool_call>\n<function=set_flags>\n<parameter=flags>\n{\"a\": [1, 2]}\n</parameter>\n"
        "<parameter=dry_run>\ntrue\n</parameter>\n</function>\n</tool_call>"),
        expected("", "", [("set_flags", {"flags": {"a": [1, 2]}, "dry_run": True})])),
    "deepseek_v3": (DeepSeekParser, (
        f"Let me check.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```"
        f"{DS_END}\n{DS_CALL}function{DS_SEP}get_time\n```json\n{{\"timezone\": \"Europe/Paris\"}}\n```{DS_END}"
        f"{DS_CALLS_END}"),
        expected("", "Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})])),
    "deepseek_v31": (DeepSeekParser,
        f"{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{\"city\": \"Oslo\", \"days\": 2}}{DS_END}{DS_CALLS_END}",
        expected("", "", [("get_weather", {"city": "Oslo", "days": 2})])),
    "deepseek_r1_think": (DeepSeekParser, (
        f"<think>\nNeed the time.\n</think>\n\n{DS_CALLS}{DS_CALL}function{DS_SEP}get_time\n```json\n"
        f"{{\"timezone\": \"UTC\"}}\n```{DS_END}{DS_CALLS_END}"),
        expected("Need the time.", "", [("get_time", {"timezone": "UTC"})])),
    # malformed and unexpected output: never markup in the text, nothing silently lost
    "hermes_bad_json": (HermesParser,
        "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",
        expected("", "Sure.\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }")),
    "hermes_undeclared_tool": (HermesParser,
        "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {\"path\": \"/\"}}\n</tool_call>",
        expected("", "{\"name\": \"rm_rf\", \"arguments\": {\"path\": \"/\"}}")),
    "hermes_cut_off_but_complete": (HermesParser,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
        expected("", "", [("get_weather", {"city": "Paris"})])),
    "hermes_cut_off_mid_call": (HermesParser,
        "One moment.\n\n<tool_call>\n{\"name\": \"get_weather\", \"argu",
        expected("", "One moment.\n\n{\"name\": \"get_weather\", \"argu")),
    "hermes_missing_end_marker": (HermesParser, (
        "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}<tool_call>{\"name\": \"get_weather\", "
        "\"arguments\": {\"city\": \"Rome\"}}</tool_call>"),
        expected("", "", [("get_time", {}), ("get_weather", {"city": "Rome"})])),
    "hermes_stray_end_marker": (HermesParser, "All done.</tool_call>",
        expected("", "All done.")),
    "partial_marker_at_the_end": (HermesParser, "compare x <tool",
        expected("", "compare x <tool")),
    "think_cut_off": (HermesParser, "<think>\nStill thinking about it",
        expected("Still thinking about it", "")),
    "deepseek_undeclared": (DeepSeekParser,
        f"{DS_CALLS}{DS_CALL}delete_all{DS_SEP}{{}}{DS_END}{DS_CALLS_END}",
        expected("", "delete_all {}")),
    "qwen3_coder_undeclared": (Qwen3CoderParser,
        "<tool_call>\n<function=launch>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
        expected("", "<function=launch>\n<parameter=x>\n1\n</parameter>\n</function>")),
}


def turn(parser, **spec) -> ChatTurn:
    return ChatTurn(parser, ToolSpec(TOOLS, **spec))


def summary(reply: Reply) -> tuple:
    return reply.reasoning, reply.content, [(c.name, json.loads(c.arguments)) for c in reply.calls]


def streamed(t: ChatTurn, chunks: list[str]) -> tuple[Reply, list]:
    output = AssistantOutput(t, "call_")
    pieces = [p for chunk in chunks for p in output.feed(chunk)] + output.finish()
    return collect(pieces), pieces


def splits(text: str) -> list[list[str]]:
    """Every cut into two chunks, one character at a time, and seeded random cuts."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(7)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("name", RECORDINGS)
def test_one_shot_parse(name):
    parser, text, want = RECORDINGS[name]
    assert summary(read_all(turn(parser), text, "call_")) == want


@pytest.mark.parametrize("name", RECORDINGS)
def test_streamed_parse_matches_one_shot_at_every_chunk_boundary(name):
    parser, text, want = RECORDINGS[name]
    for chunks in splits(text):
        reply, pieces = streamed(turn(parser), chunks)
        assert summary(reply) == want, chunks
        for piece in pieces:
            if not isinstance(piece, Call):
                assert not any(m in piece.text for m in MARKERS) or name == "partial_marker_at_the_end", chunks


def test_calls_get_distinct_ids_with_the_adapters_prefix():
    _, text, _ = RECORDINGS["hermes_two_calls"]
    calls = read_all(turn(HermesParser), text, "toolu_").calls
    assert [c.id[:6] for c in calls] == ["toolu_"] * 2 and calls[0].id != calls[1].id


def test_parallel_calls_off_keeps_the_first_call_only():
    _, text, _ = RECORDINGS["hermes_two_calls"]
    reply = read_all(turn(HermesParser, parallel=False), text, "call_")
    assert [c.name for c in reply.calls] == ["get_weather"] and reply.content == "I will look that up."


def test_tool_choice_none_declares_nothing():
    _, text, _ = RECORDINGS["hermes_two_calls"]
    reply = read_all(turn(HermesParser, choice="none"), text, "call_")
    assert reply.calls == [] and "<tool_call>" not in reply.content and '"get_time"' in reply.content


def test_named_choice_accepts_only_that_tool():
    _, text, _ = RECORDINGS["hermes_two_calls"]
    reply = read_all(turn(HermesParser, choice="named", name="get_time"), text, "call_")
    assert [c.name for c in reply.calls] == ["get_time"] and '"get_weather"' in reply.content


@pytest.mark.parametrize("parser, name, continuation", [
    (HermesParser, "get_weather", '{"city": "Lima"}}\n</tool_call>'),
    (Qwen3CoderParser, "get_weather", "<parameter=city>\nLima\n</parameter>\n</function>\n</tool_call>"),
])
def test_named_prefill_is_part_of_the_reply(parser, name, continuation):
    t = ChatTurn(parser, ToolSpec(TOOLS, "named", name), parser.prefill(name))
    reply = read_all(t, continuation, "call_")
    assert summary(reply) == ("", "", [(name, {"city": "Lima"})])


@pytest.mark.parametrize("parser, continuation", [
    (HermesParser, '\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'),
    (Qwen3CoderParser, "get_time>\n<parameter=timezone>\nUTC\n</parameter>\n</function>\n</tool_call>"),
    (DeepSeekParser, f'get_time{DS_SEP}{{"timezone": "UTC"}}{DS_END}{DS_CALLS_END}'),
])
def test_required_prefill_is_part_of_the_reply(parser, continuation):
    t = ChatTurn(parser, ToolSpec(TOOLS, "required"), parser.prefill(None))
    assert summary(read_all(t, continuation, "call_")) == ("", "", [("get_time", {"timezone": "UTC"})])


def test_reasoning_opened_by_the_prompt():
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    t = ChatTurn(HermesParser, ToolSpec(TOOLS), thinking=True)
    assert summary(read_all(t, "Two steps.\n</think>\n\nAnswer: 4", "call_")) == ("Two steps.", "Answer: 4", [])


def test_think_splitter_streams_reasoning_before_it_ends():
    splitter = ThinkSplitter()
    assert splitter.feed("<think>\nfirst thought") == [Reasoning("first thought")]
    assert splitter.feed(" and more</thi") == [Reasoning(" and more")]
    assert splitter.feed("nk>\n\nok") == [Text("ok")]


def test_text_before_a_marker_is_not_held_longer_than_needed():
    output = AssistantOutput(turn(HermesParser), "call_")
    assert output.feed("hello wor") == [Text("hello wor")]
    assert output.feed("ld <tool") == [Text("ld")]  # " <tool" could still open a call


@pytest.mark.parametrize("template, parser", [
    ("{{ '<tool_call>' }}", HermesParser),
    ("<tool_call>\n<function={{ name }}>\n<parameter=x>", Qwen3CoderParser),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}", DeepSeekParser),
    (None, HermesParser),
    ({"default": "plain", "tool_use": "<｜tool▁call▁begin｜>"}, DeepSeekParser),
])
def test_format_is_read_off_the_chat_template(template, parser):
    assert parser_for(template) is parser


def test_partial_marker():
    assert partial_marker("abc <tool_c", ["<tool_call>"]) == 7
    assert partial_marker("abc <tool_call", ["<tool_call>", "<"]) == 10
    assert partial_marker("abc", ["<tool_call>"]) == 0
