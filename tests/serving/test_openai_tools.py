"""Structured outputs and tools of the OpenAI front, without a server: `response_format` and tool choices as
guides (checked against xgrammar, the engine's grammar library), their errors naming the field, and the readers
that turn generated text into tool calls, streamed piece by piece or whole."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the OpenAI frontend needs fastapi (ci/requirements.txt)")

from tritonllm.openai_api.errors import BadRequest, OpenAIError, Unsupported  # noqa: E402
from tritonllm.openai_api.structured import response_format_guide  # noqa: E402
from tritonllm.openai_api.tool_calls import (  # noqa: E402
    ArgumentsReader,
    CallListReader,
    Message,
    TaggedCallsReader,
    json_value_end,
    read_whole,
)
from tritonllm.openai_api.tools import calls_schema, parse_tool_choice, parse_tools, plan_tools  # noqa: E402
from tritonllm.openai_api.triton_client import backend_error  # noqa: E402

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "noop"}},
]


def accepts(schema: dict, text: str) -> bool:
    """Whether xgrammar's grammar for `schema` (the engine compiles the same way) takes `text` whole."""
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgrammar.Grammar.from_json_schema(json.dumps(schema)), text)


def raises_naming(param: str, call, *args) -> OpenAIError:
    with pytest.raises(BadRequest) as caught:
        call(*args)
    assert caught.value.param == param and caught.value.status == 400, caught.value.message
    return caught.value


# ---------------------------------------------------------------------------------------------- response_format


def test_response_format_maps_onto_the_guide_types():
    assert response_format_guide(None) is None and response_format_guide({"type": "text"}) is None
    json_object = response_format_guide({"type": "json_object"})
    assert (json_object.guide_type, json_object.guide) == ("json", "")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for strict in (True, False, None):
        guide = response_format_guide(
            {"type": "json_schema", "json_schema": {"name": "a_b", "schema": schema, "strict": strict}}
        )
        assert guide.guide_type == "json_schema" and json.loads(guide.guide) == schema
        assert guide.param == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    "value, param",
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
        (
            {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}},
            "response_format.json_schema.name",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "response_format.json_schema.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict",
        ),
    ],
)
def test_a_bad_response_format_is_a_400_naming_the_part(value, param):
    raises_naming(param, response_format_guide, value)


# ---------------------------------------------------------------------------------------------- tools


@pytest.mark.parametrize(
    "tools, param",
    [
        ([{"type": "retrieval"}], "tools.0.type"),
        (["get_weather"], "tools.0"),
        ([{"type": "function"}], "tools.0.function"),
        ([{"type": "function", "function": {"name": "no spaces please"}}], "tools.0.function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools.0.function.parameters"),
        ([{"type": "function", "function": {"name": "f", "description": 5}}], "tools.0.function.description"),
        ([TOOLS[1], TOOLS[1]], "tools.1.function.name"),
    ],
)
def test_bad_tools_are_400s_naming_the_part(tools, param):
    raises_naming(param, parse_tools, tools)


def test_tool_choice_defaults_and_errors():
    functions = parse_tools(TOOLS)
    assert parse_tool_choice(None, functions) == "auto" and parse_tool_choice(None, ()) == "none"
    assert parse_tool_choice("none", ()) == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "noop"}}, functions) == "noop"
    error = raises_naming(
        "tool_choice.function.name", parse_tool_choice, {"type": "function", "function": {"name": "x"}}, functions
    )
    assert "'x'" in error.message and "get_weather" in error.message
    raises_naming("tool_choice", parse_tool_choice, "required", ())
    raises_naming("tool_choice", parse_tool_choice, "sometimes", functions)
    raises_naming("tool_choice", parse_tool_choice, {"type": "function"}, functions)


def test_a_function_without_parameters_takes_none():
    noop = parse_tools(TOOLS)[1]
    assert noop.parameters == {"type": "object", "properties": {}}
    assert noop.as_template_tool() == {"type": "function", "function": {"name": "noop", "parameters": noop.parameters}}


def test_a_named_choice_is_guided_by_that_functions_parameters():
    functions = parse_tools(TOOLS)
    plan, guide = plan_tools(functions, "get_weather", True, None)
    assert plan.mode == "named" and plan.name == "get_weather"
    assert guide.guide_type == "json_schema" and json.loads(guide.guide) == WEATHER_PARAMETERS
    assert guide.param == "tools.0.function.parameters"


def test_required_is_guided_by_an_array_of_calls_one_of_the_tools_each():
    functions = parse_tools(TOOLS)
    plan, guide = plan_tools(functions, "required", True, None)
    assert plan.mode == "required" and guide.param == "tools"
    schema = json.loads(guide.guide)
    assert schema == calls_schema(functions, True)
    weather = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert accepts(schema, f"[{weather}]") and accepts(schema, f'[{weather}, {{"name": "noop", "arguments": {{}}}}]')
    assert not accepts(schema, "[]")
    assert not accepts(schema, '[{"name": "nope", "arguments": {}}]')
    assert not accepts(schema, '[{"name": "get_weather", "arguments": {}}]')  # city is required
    assert not accepts(schema, '[{"arguments": {}, "name": "noop"}]')  # the name comes first
    single = calls_schema(functions, parallel=False)
    assert accepts(single, f"[{weather}]") and not accepts(single, f"[{weather}, {weather}]")


def test_auto_needs_a_template_with_a_tool_call_format_and_none_is_plain_text():
    functions = parse_tools(TOOLS)
    error = raises_naming("tool_choice", plan_tools, functions, "auto", True, None)
    assert "chat template" in error.message and "required" in error.message
    plan, guide = plan_tools(functions, "auto", True, "hermes")
    assert plan.mode == "template" and plan.call_format == "hermes" and guide is None
    assert plan_tools(functions, "none", True, None) == (None, None)


def test_backend_errors_about_guides_and_guided_decoding():
    compile_error = backend_error("tensorrt_llm_bls", "guided_decoding.json (JSON schema) does not compile: bad type")
    assert isinstance(compile_error, BadRequest) and compile_error.status == 400
    no_backend = backend_error(
        "tensorrt_llm_bls", "this request is guided (guided_decoding) but the engine runs without guided decoding"
    )
    assert isinstance(no_backend, Unsupported) and no_backend.status == 422
    old_repo = backend_error("ensemble", "unexpected inference input 'guided_decoding_guide_type' for model 'ensemble'")
    assert isinstance(old_repo, Unsupported)
    refused = backend_error(
        "tensorrt_llm_bls", "input 'guided_decoding_guide' needs guided decoding, which is not supported yet"
    )
    assert isinstance(refused, Unsupported)


# ---------------------------------------------------------------------------------------------- readers


def streamed(reader, pieces: list[str]) -> Message:
    """The message a client builds from the reader's deltas, fed piece by piece."""
    message = Message()
    for piece in pieces:
        for delta in reader.feed(piece):
            message.add(delta)
    for delta in reader.end():
        message.add(delta)
    return message


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and in pieces of 3."""
    return [[text], list(text), [text[i : i + 3] for i in range(0, len(text), 3)]]


def test_named_arguments_stream_as_they_come_and_equal_the_whole():
    text = '  {"city": "Paris",\n "days": 3}'
    whole = read_whole(ArgumentsReader("get_weather"), text)
    assert [(c.name, c.arguments) for c in whole.calls] == [("get_weather", text.lstrip())]
    assert whole.content == "" and whole.calls[0].id.startswith("call_")
    for pieces in splits(text):
        message = streamed(ArgumentsReader("get_weather"), pieces)
        assert [(c.name, c.arguments) for c in message.calls] == [("get_weather", text.lstrip())]
    first = ArgumentsReader("get_weather").feed('{"ci')
    assert first[0].call.name == "get_weather" and first[0].call.arguments == "" and first[1].call.arguments == '{"ci'


def test_a_call_list_gives_each_calls_exact_arguments_text():
    arguments = ['{"city": "a \\" } ] b", "days": 2}', "{}"]
    text = (
        f' [ {{"name": "get_weather", "arguments": {arguments[0]} }} ,\n{{"name":"noop","arguments":{arguments[1]}}}]'
    )
    for pieces in splits(text):
        message = streamed(CallListReader(), pieces)
        assert [(c.name, c.arguments) for c in message.calls] == [("get_weather", arguments[0]), ("noop", arguments[1])]
        assert message.content == "" and len({c.id for c in message.calls}) == 2


def test_a_call_lists_first_delta_waits_for_the_name_then_arguments_stream():
    reader = CallListReader()
    assert reader.feed('[{"name": "get_wea') == []
    head = reader.feed('ther", "arguments": {"ci')
    assert head[0].call.name == "get_weather" and head[0].call.id and head[1].call.arguments == '{"ci'
    assert [d.call.arguments for d in reader.feed('ty": "x"}}')] == ['ty": "x"}']  # not the object's own }


def test_a_call_list_cut_short_keeps_what_was_begun_and_text_without_calls_is_content():
    message = streamed(CallListReader(), ['[{"name": "noop", "arguments": {"a": [1, 2'])
    assert [(c.name, c.arguments) for c in message.calls] == [("noop", '{"a": [1, 2')]
    nothing = streamed(CallListReader(), ['[{"na'])
    assert nothing.calls == [] and nothing.content == '[{"na'


def test_json_value_end():
    assert json_value_end('{"a": "}"} tail', 0) == 10
    assert json_value_end(" [1, [2]],", 0) == 9
    assert json_value_end('"a\\"b",', 0) == 6
    assert json_value_end("12,", 0) == 2 and json_value_end("12", 0) is None
    assert json_value_end('{"a": 1', 0) is None


def hermes() -> TaggedCallsReader:
    return TaggedCallsReader("<tool_call>", "</tool_call>")


def test_tagged_calls_split_content_from_calls_in_any_pieces():
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "noop", "parameters": {}}</tool_call>\n'
    )
    for pieces in splits(text):
        message = streamed(hermes(), pieces)
        assert message.content == "Let me check."
        assert [(c.name, json.loads(c.arguments)) for c in message.calls] == [
            ("get_weather", {"city": "Paris"}),
            ("noop", {}),
        ]


def test_tagged_text_without_calls_is_all_content():
    for text in ["Plain answer, a < sign and <tool", "a <tool_call>not json</tool_call> b", 'open <tool_call>{"na']:
        for pieces in splits(text):
            message = streamed(hermes(), pieces)
            assert message.content == text and message.calls == [], pieces


def test_tagged_content_streams_before_the_call_and_holds_only_a_possible_tag():
    reader = hermes()
    assert [d.content for d in reader.feed("Hello <tool")] == ["Hello"]
    assert [d.content for d in reader.feed("box> there")] == [" <toolbox> there"]
