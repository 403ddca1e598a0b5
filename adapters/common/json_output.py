"""`response_format` json_object / json_schema: checked after generation and reported.

The engine samples exactly from the model's distribution and has no hook to
mask tokens, so nothing constrains the text while it is generated; instead
the finished answer is parsed (a ```json fence around it is allowed) and,
for json_schema, validated with jsonschema. The verdict goes out as the
extension object `response_format_check` {type, valid, error}: on the
response, or on the streamed chunk that carries the finish reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError

from adapters.common.errors import bad


@dataclass(frozen=True)
class ResponseFormat:
    kind: str  # "json_object" | "json_schema"
    schema: dict | None = None

    def check(self, content: str) -> dict[str, Any]:
        return {"type": self.kind, **_verdict(content, self.schema)}


def parse_response_format(value: Any) -> ResponseFormat | None:
    """None for plain text; a 400 for anything malformed or unknown."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise bad("`response_format.type` must be 'text', 'json_object' or 'json_schema'", "response_format")
    spec = value.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(schema, dict):
        raise bad("`response_format.json_schema` needs a `name` and a `schema` object", "response_format")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except SchemaError as e:
        raise bad(f"`response_format.json_schema.schema` is not a valid JSON Schema: {e.message}",
                  "response_format") from None
    return ResponseFormat("json_schema", schema)


def _verdict(content: str, schema: dict | None) -> dict[str, Any]:
    try:
        data = json.loads(_unfenced(content))
    except ValueError as e:
        return {"valid": False, "error": f"the answer is not JSON: {e}"}
    if schema is None:
        if not isinstance(data, dict):
            return {"valid": False, "error": "the answer is JSON but not an object"}
        return {"valid": True, "error": None}
    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return {"valid": False, "error": f"{where}: {error.message}"}
    return {"valid": True, "error": None}


def _unfenced(text: str) -> str:
    text = text.strip()
    if text.startswith("```") and text.endswith("```") and len(text) >= 6:
        text = text[3:-3]
        text = text[4:] if text.startswith("json") else text
    return text
