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
