"""Structured outputs and tool calls through `tritonllm openai` on the real tritonserver (the tiny random-weight
model), driven by the official `openai` client: `response_format` json_schema / json_object, and tools with
tool_choice required / named, whole and streamed. Random weights never write valid JSON by chance, so every check
here fails unless the backend guides the output (the repository's guided_decoding_backend: xgrammar, and the
guided_decoding_guide_type / guided_decoding_guide inputs of tensorrt_llm_bls and tensorrt_llm)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the OpenAI endpoint tests need the openai client")

from tritonllm.commands.bench_guided import schema_errors  # noqa: E402
from tritonllm.deploy.frontend import FrontendProcess  # noqa: E402
from tritonllm.deploy.tritonserver import free_port  # noqa: E402

pytestmark = pytest.mark.server

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Describe an animal, then tell me the weather in Paris."}]
MAX_TOKENS = 400  # JSON whitespace is the grammar's to allow: room for a random model's share of it
# Bounded strings and numbers, so that a random model's output ends well within MAX_TOKENS.
ANIMAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "kind", "age"],
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "describe_animal", "parameters": ANIMAL}},
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
GREEDY = {"temperature": 0}
SAMPLED = {"temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def frontend(server, tiny_model: Path, tmp_path_factory):
    process = FrontendProcess(
        server.triton.grpc_url,
        tiny_model,
        free_port(),
        log_file=tmp_path_factory.mktemp("openai_structured") / "openai.log",
        extra=["--served-model-name", MODEL],
    ).start()
    yield process
    process.stop()


@pytest.fixture
def client(frontend):
    with openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def chat(client, max_tokens=MAX_TOKENS, **fields):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, **fields)


def check_schema(schema: dict[str, Any], value: Any) -> None:
    errors = schema_errors(schema, value, strict=True)
    assert not errors, (errors, value)


def streamed(stream) -> tuple[str, dict[int, dict[str, str]], list]:
    """A chat stream joined as a client joins it: content, calls by index (id, name, arguments), finish reasons."""
    content, calls, reasons = "", {}, []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": delta.id, "name": None, "arguments": ""})
                if delta.function.name:
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
            reasons.append(choice.finish_reason)
    return content, calls, reasons


# ---------------------------------------------------------------------------------------------- response_format


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_json_schema_response_format_content_parses_and_validates(client, sampling):
    response_format = {"type": "json_schema", "json_schema": {"name": "animal", "schema": ANIMAL, "strict": True}}
    whole = chat(client, response_format=response_format, **sampling)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop", choice
    check_schema(ANIMAL, json.loads(choice.message.content))
    content, calls, reasons = streamed(chat(client, response_format=response_format, stream=True, **sampling))
    assert content == choice.message.content and calls == {} and reasons[-1] == "stop"


def test_json_object_response_format_writes_a_json_object(client):
    """Any JSON object: its keys are unbounded strings, which a random model does not end, so the check is that
    the text is a JSON object or the start of one (as the grammar the engine uses reads it)."""
    xgrammar = pytest.importorskip("xgrammar")
    from xgrammar.testing import _get_matcher_from_grammar

    answer = chat(client, response_format={"type": "json_object"}, max_tokens=48, **GREEDY)
    choice = answer.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        grammar = xgrammar.Grammar.from_json_schema('{"type": "object"}', strict_mode=False)
        assert choice.message.content.startswith("{")
        assert _get_matcher_from_grammar(grammar).accept_string(choice.message.content), choice.message.content


def test_response_format_on_text_completions(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "animal", "schema": ANIMAL}}
    answer = client.completions.create(
        model=MODEL, prompt="An animal:", max_tokens=MAX_TOKENS, extra_body={"response_format": response_format}
    )
    check_schema(ANIMAL, json.loads(answer.choices[0].text))


# ---------------------------------------------------------------------------------------------- tools


def check_calls(calls) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        check_schema(PARAMETERS[call.function.name], json.loads(call.function.arguments))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_tool_choice_required_gives_calls_valid_for_their_function(client, sampling):
    fields = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, **sampling}
    whole = chat(client, **fields)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false: one call
    content, calls, reasons = streamed(chat(client, stream=True, **fields))
    assert content == "" and reasons[-1] == "tool_calls" and set(reasons[:-1]) <= {None}
    (call,) = choice.message.tool_calls
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


def test_parallel_tool_calls_may_give_several_each_valid(client):
    """parallel_tool_calls left at OpenAI's default (true): the guided array of calls, one or more."""
    fields = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 8}
    choice = chat(client, **fields).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    check_calls(choice.message.tool_calls)
    _, calls, _ = streamed(chat(client, stream=True, **fields))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments) for call in choice.message.tool_calls
    ]
    assert len({c["id"] for c in calls.values()}) == len(calls)


def test_a_named_tool_choice_calls_that_function(client):
    fields = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, **GREEDY}
    choice = chat(client, **fields).choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)
    assert [call.function.name for call in choice.message.tool_calls] == ["get_weather"]
    _, calls, reasons = streamed(chat(client, stream=True, **fields))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        ("get_weather", choice.message.tool_calls[0].function.arguments)
    ]
    assert reasons[-1] == "tool_calls"


def test_a_call_and_its_result_in_the_history_need_a_template_with_tools(client):
    """The tiny model's ChatML template cannot show an assistant's tool_calls: a 400 naming them."""
    call = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **GREEDY).choices[0]
    history = [
        *MESSAGES,
        call.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.message.tool_calls[0].id, "content": "sunny"},
    ]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, tools=TOOLS, tool_choice="required")
    assert caught.value.response.json()["error"]["param"] == "messages.1.tool_calls"


# ---------------------------------------------------------------------------------------------- errors


def error_of(call) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.response.json()["error"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_schema_the_engine_cannot_compile_is_a_400_naming_it(client, stream):
    bad = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["n"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}}
    error = error_of(lambda: chat(client, response_format=response_format, stream=stream))
    assert error["param"] == "response_format.json_schema.schema" and "does not compile" in error["message"]
    tools = [{"type": "function", "function": {"name": "bad", "parameters": bad}}]
    error = error_of(lambda: chat(client, tools=tools, tool_choice="required", stream=stream))
    assert error["param"] == "tools" and "does not compile" in error["message"]


def test_tool_errors_name_the_field(client):
    assert error_of(lambda: chat(client, tools=TOOLS))["param"] == "tool_choice"  # auto: no tool format in ChatML
    named = {"type": "function", "function": {"name": "nope"}}
    assert error_of(lambda: chat(client, tools=TOOLS, tool_choice=named))["param"] == "tool_choice.function.name"
    not_function = [{"type": "file_search"}]
    assert error_of(lambda: chat(client, tools=not_function, tool_choice="required"))["param"] == "tools.0.type"
