"""Structured outputs: OpenAI's `response_format` as the backend model's guided-decoding pair
(`guided_decoding_guide_type`, `guided_decoding_guide`).

`{"type": "json_object"}` is guide type `json` (any JSON object); `{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}` is `json_schema` with the schema as JSON text. `strict: false` is guided all the same: the
engine has one way to follow a schema, and an answer that follows it is what a non-strict request hopes for."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from .errors import BadRequest

# OpenAI's rule for the names of response formats and functions.
NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True)
class Guide:
    """What the backend's guided decoder follows; `param` names the request field it came from (for errors)."""

    guide_type: str  # one of the engine's GUIDE_TYPES
    guide: str  # the schema / regex / grammar text; "" for `json`
    param: str


def schema_guide(schema: dict[str, Any], param: str) -> Guide:
    return Guide("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")), param)


def response_format_guide(value: Optional[dict[str, Any]]) -> Optional[Guide]:
    """The guide `response_format` asks for; None for text (or none given). BadRequest naming the bad part."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json", "", "response_format")
    if kind != "json_schema":
        raise BadRequest(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest(
            "response_format.json_schema must be an object with 'name' and 'schema'",
            param="response_format.json_schema",
        )
    check_name(spec.get("name"), "response_format.json_schema.name")
    optional_type(spec, "description", str, "a string", "response_format.json_schema")
    optional_type(spec, "strict", bool, "a boolean", "response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise BadRequest(
            "response_format.json_schema.schema must be a JSON Schema object"
            + (" (it is missing)" if schema is None else f", got {type(schema).__name__}"),
            param="response_format.json_schema.schema",
        )
    return schema_guide(schema, "response_format.json_schema.schema")


def check_name(name: Any, param: str) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise BadRequest(
            f"{param} must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
            param=param,
        )
    return name


def optional_type(spec: dict[str, Any], key: str, kind: type, described: str, where: str) -> None:
    """A key that may be absent or null, else must be of `kind`."""
    value = spec.get(key)
    if value is not None and not isinstance(value, kind):
        raise BadRequest(f"{where}.{key} must be {described}, got {type(value).__name__}", param=f"{where}.{key}")
