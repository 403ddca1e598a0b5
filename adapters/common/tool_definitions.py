"""Tool definitions, parsed once for both HTTP dialects.

    parse_tools(value, read)        a request's `tools` list -> function definitions in the
                                    OpenAI form chat templates expect, checked, unique by name
    named_choice(name, tools, ...)  a tool_choice that asks for a call, checked against them

A dialect says only where one of its definitions keeps the function's name,
description and JSON Schema (`read`): OpenAI nests them under `function` with
`parameters` (adapters/http/openai_tools.py), Anthropic keeps them at the top with
`input_schema` (adapters/http/anthropic_schema.py). Everything else (the list, the
name's form, the schema's type, duplicates, the choice) is checked here, alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from adapters.common.chat_turn import Choice
from adapters.common.errors import bad

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@dataclass(frozen=True)
class ToolFields:
    """One tool definition's fields as a dialect found them, not yet checked."""

    name: Any
    description: Any
    parameters: Any  # a JSON Schema object; None: no parameters
    where: str  # how errors name the definition, e.g. "tools[2].function"


# A dialect's reader: (one item of `tools`, "tools[i]") -> its fields; raises `bad` for
# an item of the wrong shape.
ReadTool = Callable[[Any, str], ToolFields]


def parse_tools(value: Any, read: ReadTool) -> tuple[dict, ...]:
    """A request's `tools` (None: none) as OpenAI-form function definitions."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("`tools` must be a list", "tools")
    return unique([function_definition(read(tool, f"tools[{i}]")) for i, tool in enumerate(value)], "tools")


def function_definition(fields: ToolFields) -> dict:
    """One function definition in the form chat templates expect."""
    name, description, parameters, where = fields.name, fields.description, fields.parameters, fields.where
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad(f"`{where}` needs a `name` of 1-128 letters, digits, '_' or '-'", where)
    if description is not None and not isinstance(description, str):
        raise bad(f"`{where}.description` must be a string", where)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad(f"`{where}` parameters must be a JSON Schema object", where)
    function = {"name": name, "parameters": parameters}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def unique(tools: list[dict], param: str) -> tuple[dict, ...]:
    names = [t["function"]["name"] for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise bad(f"tool names must be unique; repeated: {', '.join(duplicates)}", param)
    return tuple(tools)


def named_choice(name: str | None, tools: tuple[dict, ...], param: str) -> tuple[Choice, str | None]:
    """("required", None) or ("named", name), checked against the declared tools."""
    if not tools:
        raise bad(f"`{param}` asks for a tool call but no `tools` were given", param)
    if name is not None and name not in {t["function"]["name"] for t in tools}:
        raise bad(f"`{param}` names {name!r}, which is not among the declared tools", param)
    return ("required", None) if name is None else ("named", name)
