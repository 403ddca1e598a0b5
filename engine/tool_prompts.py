"""Tools for chat templates that know none: the Hermes layout, written into plain turns.

Templates of tool-trained models (Qwen, DeepSeek, Hermes, ...) render `tools`,
assistant `tool_calls` and `tool` turns themselves, and engine/prompts.py
hands them over as they are. A plain ChatML template (the embedded model's)
only prints role and content, so the tools travel as text in the layout most
open models were trained on:

    system turn:     the tool signatures, one JSON object per line, in <tools></tools>,
                     and how to call them
    assistant turn:  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call> per call
    tool results:    a user turn of <tool_response>\\n...\\n</tool_response> blocks

Replies in that layout are read by adapters/common/tool_parsers.py (HermesParser).
"""

from __future__ import annotations

import json
from typing import Any

_TOOLS_HEADER = (
    "# Tools\n\n"
    "You can call the functions described below. Their signatures, one JSON object per line, "
    "are inside <tools></tools>:\n<tools>\n{signatures}\n</tools>\n\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": <arguments as a JSON object>}}\n</tool_call>'
)


def template_knows_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders `tools` itself."""
    if getattr(tokenizer, "_chat_template", None) is not None:
        return True  # an mlx-lm Python renderer (DeepSeek-V3.2, ...): written for its model's tools
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and "tools" in t for t in texts)


def uses_tools(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, str]]:
    """Plain {role, content} turns carrying `tools`, calls and results as Hermes text."""
    out: list[dict[str, str]] = []
    if tools:
        header = _TOOLS_HEADER.format(signatures="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{header}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": header})
    previous_role = None
    for message in messages:
        if message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if previous_role == "tool":  # the results of one round share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif message.get("tool_calls"):
            calls = [_call_text(c["function"]) for c in message["tool_calls"]]
            text = [message["content"]] if message["content"] else []
            out.append({"role": "assistant", "content": "\n".join(text + calls)})
        else:
            out.append({"role": message["role"], "content": message["content"]})
        previous_role = message["role"]
    return out


def _call_text(function: dict[str, Any]) -> str:
    call = {"name": function["name"], "arguments": function["arguments"]}
    return f"<tool_call>\n{json.dumps(call, ensure_ascii=False)}\n</tool_call>"
