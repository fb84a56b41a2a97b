"""The OpenAI routes against a scripted Triton stream (no server): answer shapes, SSE framing, usage, stop
strings, n, errors in OpenAI's shape, and a Triton that cannot be reached."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the OpenAI frontend needs fastapi (ci/requirements.txt)")

from starlette.testclient import TestClient  # noqa: E402

from tritonllm.checkpoints.tiny import build_tiny_model  # noqa: E402
from tritonllm.deploy.tritonserver import free_port  # noqa: E402
from tritonllm.openai_api.app import create_app  # noqa: E402
from tritonllm.openai_api.config import FrontendConfig  # noqa: E402
from tritonllm.openai_api.service import OpenAIService  # noqa: E402
from tritonllm.openai_api.triton_client import StreamResponse, backend_error  # noqa: E402

PIECES = ["Hello", " wor", "ld", ". The", " end"]


class ScriptedTriton:
    """Answers every request with PIECES, one token each, per sequence; records the inputs it got."""

    def __init__(self, pieces=PIECES, error=None):
        self.pieces, self.error = pieces, error
        self.requests: list[dict] = []

    async def ready(self, model):
        return True

    async def model_parameter(self, model, key):
        return "64" if key == "max_seq_len" else None

    async def stream(self, model, inputs, outputs):
        self.requests.append(inputs)
        if self.error:
            raise backend_error(model, self.error)
        n = int(inputs["num_return_sequences"][0, 0]) if "num_return_sequences" in inputs else 1
        for piece in self.pieces[: int(inputs["max_tokens"][0, 0])]:
            for sequence in range(n):
                yield StreamResponse(
                    {
                        "text_output": np.array([piece.encode()], dtype=object),
                        "output_log_probs": np.array([[[-0.5]]], dtype=np.float32),
                        "sequence_index": np.array([[sequence]], dtype=np.int32),
                    },
                    final=False,
                )
        yield StreamResponse({}, final=True)

    async def close(self):
        pass


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def make_client(tiny_dir, triton=None, url="localhost:1", **settings):
    config = FrontendConfig(
        triton_url=url, model_dir=tiny_dir, served_model_name="tiny", lora_names=("adapter",), **settings
    )
    service = OpenAIService(config, client=triton) if triton is not None else OpenAIService(config)
    return TestClient(create_app(config, service)), service


@pytest.fixture
def scripted(tiny_dir):
    triton = ScriptedTriton()
    client, service = make_client(tiny_dir, triton)
    with client:
        yield client, triton, service


def sse_payloads(response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def assert_openai_error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and (code is None or error["code"] == code)


def test_models_lists_the_served_name_and_lora_names(scripted):
    client, _, _ = scripted
    ids = [card["id"] for card in client.get("/v1/models").json()["data"]]
    assert ids == ["tiny", "adapter"]
    assert client.get("/v1/models/adapter").json()["parent"] == "tiny"
    assert_openai_error(client.get("/v1/models/nope"), 404, "model", "model_not_found")


def test_whole_completion_counts_tokens_and_reports_length(scripted, tiny_dir):
    client, triton, service = scripted
    answer = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi there", "max_tokens": 5}).json()
    assert answer["object"] == "text_completion" and answer["choices"][0]["text"] == "".join(PIECES)
    assert answer["choices"][0]["finish_reason"] == "length"
    prompt_tokens = len(service.tokenizer.encode("Hi there", add_special_tokens=True))
    assert answer["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 5,
        "total_tokens": prompt_tokens + 5,
    }
    sent = triton.requests[-1]
    assert sent["text_input"][0, 0] == b"Hi there" and sent["stream"][0, 0] and sent["return_log_probs"][0, 0]
    assert sent["temperature"][0, 0] == 1.0 and "stop_words" not in sent  # completions: no end-of-turn stops


def test_chat_stream_is_sse_with_role_deltas_finish_usage_and_done(scripted):
    client, triton, _ = scripted
    response = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(response)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hello"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "".join(PIECES[:4])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(c["usage"] is None for c in chunks[:-1])
    assert [w.decode() for w in triton.requests[-1]["stop_words"][0]] == ["<|im_end|>"]


def test_stop_string_cuts_the_text_before_it_and_finishes_with_stop(scripted):
    client, triton, _ = scripted
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5, "stop": [". T"], "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["text"] == "Hello world" and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] == 4  # the tokens generated up to the stop string
    assert [w.decode() for w in triton.requests[-1]["stop_words"][0]] == [". T"]
    chunks = sse_payloads(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_n_and_several_prompts_number_the_choices(scripted):
    client, triton, _ = scripted
    answer = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": ["a", "b"], "n": 2, "max_tokens": 2}
    ).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "Hello wor" for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 8
    assert all(r["num_return_sequences"][0, 0] == 2 for r in triton.requests[-2:])


def test_a_lora_name_picks_its_adapter_and_the_base_name_none(scripted):
    client, triton, _ = scripted
    client.post("/v1/completions", json={"model": "adapter", "prompt": "x", "max_tokens": 2})
    assert triton.requests[-1]["lora_name"][0, 0] == b"adapter"
    client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert "lora_name" not in triton.requests[-1]


def test_chat_logprobs_carry_each_tokens_text(scripted):
    client, _, _ = scripted
    answer = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "logprobs": True},
    ).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == PIECES[:3] and all(e["logprob"] == -0.5 for e in content)


def test_errors_in_openai_shape(scripted):
    client, _, _ = scripted
    assert_openai_error(
        client.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model", "model_not_found"
    )
    assert_openai_error(client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "top_p": 2}), 400, "top_p")
    assert_openai_error(
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 64}),
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    assert_openai_error(
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "echo": True}),
        422,
        "echo",
        "unsupported_parameter",
    )
    assert_openai_error(
        client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400
    )
    assert_openai_error(client.get("/v1/nothing-here"), 404)


def test_a_backend_error_before_any_text_is_an_http_error(tiny_dir):
    client, _ = make_client(tiny_dir, ScriptedTriton(error="input 'temperature' must be >= 0"))
    with client:
        for stream in (False, True):
            response = client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": stream}
            )
            assert_openai_error(response, 400)


def test_triton_unreachable_is_a_503(tiny_dir):
    client, _ = make_client(tiny_dir, url=f"localhost:{free_port()}")
    with client:
        assert_openai_error(client.get("/health"), 503, code="service_unavailable")
        for stream in (False, True):
            response = client.post(
                "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "stream": stream}
            )
            assert_openai_error(response, 503, code="service_unavailable")


def test_metrics_count_requests_and_tokens(scripted):
    client, _, _ = scripted
    client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
    client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    text = client.get("/metrics").text
    assert 'tritonllm_openai_requests_total{endpoint="/v1/completions",model="tiny",status="200"} 1.0' in text
    assert 'tritonllm_openai_requests_total{endpoint="/v1/completions",model="unknown",status="404"} 1.0' in text
    assert 'tritonllm_openai_completion_tokens_total{model="tiny"} 3.0' in text
    assert "tritonllm_openai_time_to_first_token_seconds_count" in text


def test_max_tokens_default_and_limit(tiny_dir):
    triton = ScriptedTriton()
    client, _ = make_client(tiny_dir, triton, max_tokens_default=3, max_tokens_limit=10)
    chat_body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    with client:
        answer = client.post("/v1/chat/completions", json=chat_body).json()
        assert int(triton.requests[-1]["max_tokens"][0, 0]) == 3  # no max_tokens: the default
        assert answer["usage"]["completion_tokens"] == 3 and answer["choices"][0]["finish_reason"] == "length"
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "min_tokens": 5})
        assert int(triton.requests[-1]["max_tokens"][0, 0]) == 5  # min_tokens above the default raises it
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 10})
        assert int(triton.requests[-1]["max_tokens"][0, 0]) == 10  # the limit itself is allowed
        sent = len(triton.requests)
        too_many = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 11})
        assert_openai_error(too_many, 400, "max_tokens")
        assert "at most 10" in too_many.json()["error"]["message"]
        assert_openai_error(
            client.post("/v1/chat/completions", json={**chat_body, "max_completion_tokens": 11}),
            400,
            "max_completion_tokens",
        )
        assert len(triton.requests) == sent  # refused before anything reached Triton


def test_the_default_max_tokens_never_exceeds_the_context(tiny_dir):
    triton = ScriptedTriton()  # max_seq_len 64
    client, service = make_client(tiny_dir, triton, max_tokens_default=1000)
    with client:
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
    prompt_tokens = len(service.tokenizer.encode("x", add_special_tokens=True))
    assert int(triton.requests[-1]["max_tokens"][0, 0]) == 64 - prompt_tokens


# ---------------------------------------------------------------------------------------------- structured outputs

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 20}
CALL_PIECES = ['[{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}]']


def tool_client(tiny_dir, pieces, error=None, model_dir=None):
    triton = ScriptedTriton(pieces, error)
    client, _ = make_client(model_dir or tiny_dir, triton, max_model_len=4096)  # room for the tools in the prompt
    return client, triton


def sent_guide(triton) -> tuple:
    inputs = triton.requests[-1]
    guide = inputs.get("guided_decoding_guide")
    return inputs["guided_decoding_guide_type"][0, 0].decode(), json.loads(guide[0, 0]) if guide is not None else None


def test_response_format_json_schema_guides_the_backend_and_the_text_is_the_content(tiny_dir):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client, triton = tool_client(tiny_dir, ['{"a"', ": 1}"])
    with client:
        answer = client.post(
            "/v1/chat/completions",
            json={**ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
        ).json()
        assert answer["choices"][0]["message"] == {"role": "assistant", "content": '{"a": 1}'}
        assert sent_guide(triton) == ("json_schema", schema)
        client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "x", "response_format": {"type": "json_object"}}
        )
        assert sent_guide(triton) == ("json", None)
        client.post("/v1/chat/completions", json={**ASK, "response_format": {"type": "text"}})
        assert "guided_decoding_guide_type" not in triton.requests[-1]


def test_tool_choice_required_is_parsed_into_tool_calls(tiny_dir):
    client, triton = tool_client(tiny_dir, CALL_PIECES)
    with client:
        answer = client.post("/v1/chat/completions", json={**ASK, "tools": [WEATHER], "tool_choice": "required"}).json()
    guide_type, schema = sent_guide(triton)
    assert guide_type == "json_schema" and schema["type"] == "array" and "maxItems" not in schema
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def streamed_calls(chunks) -> tuple[dict, list]:
    """The calls a client assembles from streamed tool_call deltas, and the finish reasons."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls", []) if chunk["choices"] else []:
            call = calls.setdefault(delta["index"], {"id": delta.get("id"), "name": None, "arguments": ""})
            call["name"] = delta["function"].get("name", call["name"])
            call["arguments"] += delta["function"]["arguments"]
    return calls, [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]


def test_streamed_tool_calls_are_shaped_as_openai_streams_them(tiny_dir):
    client, _ = tool_client(tiny_dir, CALL_PIECES)
    with client:
        response = client.post(
            "/v1/chat/completions", json={**ASK, "tools": [WEATHER], "tool_choice": "required", "stream": True}
        )
    chunks = sse_payloads(response)
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"] is None
    (header,) = first["tool_calls"]
    assert header["index"] == 0 and header["id"].startswith("call_") and header["type"] == "function"
    assert header["function"] == {"name": "get_weather", "arguments": ""}
    later = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert all(set(d) == {"tool_calls"} and set(d["tool_calls"][0]) == {"index", "function"} for d in later)
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    calls, reasons = streamed_calls(chunks)
    assert calls == {0: {"id": header["id"], "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert reasons[:-1] == [None] * (len(reasons) - 1)


def test_a_named_tool_choice_streams_its_arguments_and_sends_one_call(tiny_dir):
    client, triton = tool_client(tiny_dir, ['{"city"', ': "Rome"}'])
    body = {**ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with client:
        chunks = sse_payloads(client.post("/v1/chat/completions", json={**body, "stream": True}))
        whole = client.post("/v1/chat/completions", json=body).json()
    assert sent_guide(triton) == ("json_schema", WEATHER["function"]["parameters"])
    calls, reasons = streamed_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", '{"city": "Rome"}')]
    assert reasons[-1] == "tool_calls" == whole["choices"][0]["finish_reason"]
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'


def test_tool_calls_cut_short_finish_with_length(tiny_dir):
    client, _ = tool_client(tiny_dir, CALL_PIECES)
    with client:
        answer = client.post(
            "/v1/chat/completions", json={**ASK, "max_tokens": 2, "tools": [WEATHER], "tool_choice": "required"}
        ).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": '


@pytest.fixture(scope="module")
def hermes_dir(tiny_dir, tmp_path_factory):
    """The tiny model with a chat template that has a tool-call format (Hermes' <tool_call> tags)."""
    folder = tmp_path_factory.mktemp("hermes")
    for path in tiny_dir.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
        "Call a tool as <tool_call>JSON</tool_call><|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_auto_reads_the_templates_tool_call_format_unguided(tiny_dir, hermes_dir):
    pieces = ["Sure.", "\n<tool_", 'call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', "\n</tool_call>"]
    client, triton = tool_client(tiny_dir, pieces, model_dir=hermes_dir)
    with client:
        answer = client.post("/v1/chat/completions", json={**ASK, "tools": [WEATHER]}).json()
        chunks = sse_payloads(client.post("/v1/chat/completions", json={**ASK, "tools": [WEATHER], "stream": True}))
    assert "guided_decoding_guide_type" not in triton.requests[-1]
    assert b'"name": "get_weather"' in triton.requests[-1]["text_input"][0, 0]  # the template got the tools
    message = answer["choices"][0]["message"]
    assert message["content"] == "Sure." and answer["choices"][0]["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"})
    ]
    calls, reasons = streamed_calls(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Oslo"})]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "Sure."
    assert reasons[-1] == "tool_calls"


def test_tool_choice_none_is_plain_unguided_text(tiny_dir):
    client, triton = tool_client(tiny_dir, PIECES)
    with client:
        answer = client.post("/v1/chat/completions", json={**ASK, "tools": [WEATHER], "tool_choice": "none"}).json()
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "".join(PIECES)}
    assert answer["choices"][0]["finish_reason"] == "stop" and "guided_decoding_guide_type" not in triton.requests[-1]


def test_structured_output_errors_name_the_field(tiny_dir):
    client, triton = tool_client(tiny_dir, CALL_PIECES)
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    cases = [
        ({"tools": [WEATHER]}, 400, "tool_choice"),  # auto: the tiny ChatML template has no tool-call format
        ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, 400, "tools.0.type"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            400,
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, 400, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": schema_format}, 400, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "response_format.json_schema.schema",
        ),
        ({"functions": [{"name": "f"}]}, 422, "functions"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "tool", "content": "ok", "tool_call_id": "c"},
                ],
                "tools": [WEATHER],
                "tool_choice": "required",
            },
            400,
            "messages.1.tool_calls",
        ),
    ]
    with client:
        for extra, status, param in cases:
            assert_openai_error(client.post("/v1/chat/completions", json={**ASK, **extra}), status, param)
    assert triton.requests == []  # all refused before anything reached Triton


def test_a_schema_the_backend_cannot_compile_is_a_400_naming_it(tiny_dir):
    error = "input 'guided_decoding_guide': guided_decoding.json (JSON schema) does not compile: bad"
    client, _ = tool_client(tiny_dir, PIECES, error=error)
    schema_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    with client:
        for stream in (False, True):
            response = client.post(
                "/v1/chat/completions", json={**ASK, "response_format": schema_format, "stream": stream}
            )
            assert_openai_error(response, 400, "response_format.json_schema.schema")
            tools = client.post(
                "/v1/chat/completions", json={**ASK, "tools": [WEATHER], "tool_choice": "required", "stream": stream}
            )
            assert_openai_error(tools, 400, "tools")


def test_streamed_calls_of_n_choices_keep_apart_and_held_back_logprobs_come_later(tiny_dir):
    client, _ = tool_client(tiny_dir, ['[{"name": "get_wea', 'ther", "arguments": {"city": ', '"Paris"}}]'])
    body = {**ASK, "n": 2, "logprobs": True, "tools": [WEATHER], "tool_choice": "required", "stream": True}
    with client:
        chunks = sse_payloads(client.post("/v1/chat/completions", json=body))
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        calls, reasons = streamed_calls(mine)
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", '{"city": "Paris"}')]
        assert reasons[-1] == "tool_calls"
        # the first piece was held back (no name yet): its log-probability comes with the call's first delta
        logprobs = [entry for c in mine for entry in (c["choices"][0]["logprobs"] or {"content": []})["content"]]
        assert len(logprobs) == 3 and mine[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"]
        assert len(mine[0]["choices"][0]["logprobs"]["content"]) == 2
