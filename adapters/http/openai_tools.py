"""OpenAI `tools`, `tool_choice`, `parallel_tool_calls` and `chat_template_kwargs`, checked.

    tools                [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
    tool_choice          "auto" (default with tools) | "none" (default without) | "required"
                         | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls  true (default) | false: only the first call of a reply goes out
    chat_template_kwargs extension (as in other local servers): extra variables for the
                         chat template, e.g. {"enable_thinking": false}

The definitions themselves are checked as the Anthropic adapter's are
(adapters/common/tool_definitions.py); this module says where OpenAI keeps their fields.
"""

from __future__ import annotations

from typing import Any

from adapters.common.chat_turn import Choice, ToolSpec
from adapters.common.errors import bad
from adapters.common.tool_definitions import ToolFields, named_choice, parse_tools

# Names the template call itself sets: a client may not override them.
_RESERVED_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "tokenize",
                    "continue_final_message", "return_dict", "chat_template"}


def openai_tool_spec(body: dict) -> ToolSpec:
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad("`functions` and `function_call` are deprecated; use `tools` and `tool_choice`", "functions")
    tools = parse_tools(body.get("tools"), _read_tool)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("`parallel_tool_calls` must be a boolean", "parallel_tool_calls")
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    return ToolSpec(tools, choice, name, parallel)


def _read_tool(tool: Any, where: str) -> ToolFields:
    """{"type": "function", "function": {"name", "description"?, "parameters"?}}"""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad(f"`{where}` must be a function tool ({{'type': 'function', 'function': {{...}}}})", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad(f"`{where}.function` must be an object", "tools")
    return ToolFields(function.get("name"), function.get("description"), function.get("parameters"),
                      f"{where}.function")


def _tool_choice(value: Any, tools: tuple[dict, ...]) -> tuple[Choice, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if value in ("auto", "none"):
        return value, None
    name = None
    if value != "required":
        function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad("`tool_choice` must be 'auto', 'none', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    return named_choice(name, tools, "tool_choice")


def template_kwargs(body: dict) -> dict[str, Any] | None:
    value = body.get("chat_template_kwargs")
    if value is None:
        return None
    if not isinstance(value, dict) or any(not isinstance(k, str) or not k.isidentifier() for k in value):
        raise bad("`chat_template_kwargs` must be an object with identifier keys", "chat_template_kwargs")
    reserved = sorted(_RESERVED_KWARGS & value.keys())
    if reserved:
        raise bad(f"`chat_template_kwargs` may not set {', '.join(reserved)}", "chat_template_kwargs")
    return value
