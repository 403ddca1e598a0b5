"""OpenAI `tools`, `tool_choice`, `parallel_tool_calls` and `chat_template_kwargs`, checked.

    tools                [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
    tool_choice          "auto" (default with tools) | "none" (default without) | "required"
                         | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls  true (default) | false: only the first call of a reply goes out
    chat_template_kwargs extension (as in other local servers): extra variables for the
                         chat template, e.g. {"enable_thinking": false}

Tool definitions are shared with the Anthropic adapter (`check_function`), which
converts its own shapes to these.
"""

from __future__ import annotations

import re
from typing import Any

from adapters.common.chat_turn import Choice, ToolSpec
from adapters.common.errors import bad

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# Names the template call itself sets: a client may not override them.
_RESERVED_KWARGS = {"messages", "tools", "documents", "add_generation_prompt", "tokenize",
                    "continue_final_message", "return_dict", "chat_template"}


def check_function(name: Any, description: Any, parameters: Any, param: str) -> dict:
    """One function definition in the form chat templates expect."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad(f"`{param}` needs a `name` of 1-128 letters, digits, '_' or '-'", param)
    if description is not None and not isinstance(description, str):
        raise bad(f"`{param}.description` must be a string", param)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad(f"`{param}` parameters must be a JSON Schema object", param)
    function = {"name": name, "parameters": parameters}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def openai_tool_spec(body: dict) -> ToolSpec:
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise bad("`functions` and `function_call` are deprecated; use `tools` and `tool_choice`", "functions")
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("`parallel_tool_calls` must be a boolean", "parallel_tool_calls")
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    return ToolSpec(tools, choice, name, parallel)


def _tools(value: Any) -> tuple[dict, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("`tools` must be a list", "tools")
    tools = []
    for i, tool in enumerate(value):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad(f"`{param}` must be a function tool ({{'type': 'function', 'function': {{...}}}})", "tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad(f"`{param}.function` must be an object", "tools")
        tools.append(check_function(function.get("name"), function.get("description"),
                                    function.get("parameters"), f"{param}.function"))
    return unique(tools, "tools")


def unique(tools: list[dict], param: str) -> tuple[dict, ...]:
    names = [t["function"]["name"] for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise bad(f"tool names must be unique; repeated: {', '.join(duplicates)}", param)
    return tuple(tools)


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


def named_choice(name: str | None, tools: tuple[dict, ...], param: str) -> tuple[Choice, str | None]:
    """("required", None) or ("named", name), checked against the declared tools."""
    if not tools:
        raise bad(f"`{param}` asks for a tool call but no `tools` were given", param)
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise bad(f"`{param}` names {name!r}, which is not among the declared tools", param)
    return ("required", None) if name is None else ("named", name)


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
