"""Tools of a chat request (`tools`, `tool_choice`, `parallel_tool_calls`), checked, and the plan for its answer.

- `none`: no tool calls; the answer is plain text, unguided. The chat template still gets the tools (as vLLM does by
  default), so the model knows of them.
- `auto` (the default with tools): unguided; the model calls a tool in its chat template's own format, which is
  parsed from the text (`tool_calls.TaggedCallsReader`). A template without a tool-call format is refused.
- a named function: the output is guided by that function's `parameters` schema and is its arguments; the name is
  known before any token.
- `required`: the output is guided by a JSON array of `{"name", "arguments"}` objects, one of the tools each
  (`anyOf`); at most one with `parallel_tool_calls: false`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from .errors import BadRequest
from .structured import Guide, check_name, optional_type, schema_guide

# A function without `parameters` takes none (OpenAI's reading).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    name: str
    description: Optional[str]
    parameters: dict[str, Any]
    index: int  # its place in `tools`, for errors

    def as_template_tool(self) -> dict[str, Any]:
        """The tool as `apply_chat_template(tools=...)` takes it (the JSON-schema form of transformers)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat answer is read: `named` (the output is `name`'s arguments), `required` (a guided JSON array of
    calls) or `template` (the chat template's own tool-call format, `call_format`)."""

    mode: str
    name: Optional[str] = None
    call_format: Optional[str] = None


def parse_tools(tools: Optional[list[Any]]) -> tuple[Function, ...]:
    functions: list[Function] = []
    for index, tool in enumerate(tools or ()):
        where = f"tools.{index}"
        if not isinstance(tool, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        if tool.get("type") != "function":
            raise BadRequest(
                f"{where}.type must be 'function' (the only tool type supported), got {tool.get('type')!r}",
                param=f"{where}.type",
            )
        functions.append(_function(tool.get("function"), index))
    names = [function.name for function in functions]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise BadRequest(f"tools: two functions are named {name!r}", param=f"tools.{index}.function.name")
    return tuple(functions)


def _function(spec: Any, index: int) -> Function:
    where = f"tools.{index}.function"
    if not isinstance(spec, dict):
        raise BadRequest(f"{where} must be an object with a 'name'", param=where)
    name = check_name(spec.get("name"), f"{where}.name")
    optional_type(spec, "description", str, "a string", where)
    optional_type(spec, "strict", bool, "a boolean", where)
    parameters = spec.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise BadRequest(
            f"{where}.parameters must be a JSON Schema object, got {type(parameters).__name__}",
            param=f"{where}.parameters",
        )
    return Function(name, spec.get("description"), parameters if parameters is not None else NO_PARAMETERS, index)


def parse_tool_choice(value: Union[str, dict[str, Any], None], functions: tuple[Function, ...]) -> str:
    """'none', 'auto', 'required', or the name of the function asked for; BadRequest naming tool_choice."""
    if value is None:
        return "auto" if functions else "none"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise BadRequest(
                f"tool_choice must be 'none', 'auto', 'required' or a named function, got {value!r}",
                param="tool_choice",
            )
        if value != "none" and not functions:
            raise BadRequest(f"tool_choice {value!r} needs tools", param="tool_choice")
        return value
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(function, dict):
        raise BadRequest(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}', param="tool_choice"
        )
    name = function.get("name")
    if name not in {f.name for f in functions}:
        known = ", ".join(repr(f.name) for f in functions) or "none"
        raise BadRequest(
            f"tool_choice names the function {name!r}, which is not in tools (they hold {known})",
            param="tool_choice.function.name",
        )
    return str(name)


def plan_tools(
    functions: tuple[Function, ...], choice: str, parallel: bool, call_format: Optional[str]
) -> tuple[Optional[ToolPlan], Optional[Guide]]:
    """The answer's plan and guide for a checked tool choice; (None, None) for plain text."""
    if choice == "none":
        return None, None
    if choice == "auto":
        if call_format is None:
            raise BadRequest(
                "tool_choice 'auto' needs a chat template with a tool-call format, and this model's has none: "
                "send tool_choice 'required' or a named function (the answer is then guided into a call)",
                param="tool_choice",
            )
        return ToolPlan("template", call_format=call_format), None
    if choice == "required":
        return ToolPlan("required"), schema_guide(calls_schema(functions, parallel), "tools")
    function = next(f for f in functions if f.name == choice)
    return ToolPlan("named", name=choice), schema_guide(
        function.parameters, f"tools.{function.index}.function.parameters"
    )


def calls_schema(functions: tuple[Function, ...], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls, each `{"name": <a tool's name>, "arguments": <its parameters>}`."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": f.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema
