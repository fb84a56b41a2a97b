"""A non-decoupled repository (`build_repo(..., streaming=False)`): one response per request, so /generate and
plain HTTP infer work, a batch comes back as one response with a row per prompt, and streaming is refused. The
tensorrt_llm_bls model answers the same way, and a gRPC client cancelling it stops the engine request."""

from __future__ import annotations

import time

import e2e_clients as clients
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

pytestmark = pytest.mark.server

PROMPTS = ["Hello there", "The lamp turned and turned", "北京"]
MAX_TOKENS = 10


def body(prompt: str, **extra) -> dict:
    return {"text_input": prompt, "max_tokens": MAX_TOKENS, "bad_words": "", "stop_words": "", **extra}


def test_generate_answers_like_the_decoupled_repository(plain_server, server):
    for prompt in PROMPTS[:2]:
        text = plain_server.generate(body(prompt))["text_output"]
        assert text.startswith(prompt) and len(text) > len(prompt)
        assert text == server.generate(body(prompt))["text_output"]


def test_stream_true_is_refused(plain_server):
    status, message = plain_server.generate_error(body(PROMPTS[0], stream=True))
    assert status == 400
    assert "'streaming'" in message and "only supported in decoupled mode" in message


def test_batch_of_three_returns_one_response_with_three_rows(plain_server):
    client = httpclient.InferenceServerClient(f"localhost:{plain_server.ports.http}")
    try:
        inputs = []
        for name, array, dtype in (
            ("text_input", np.array([[p.encode()] for p in PROMPTS], dtype=object), "BYTES"),
            ("max_tokens", np.full((3, 1), MAX_TOKENS, dtype=np.int32), "INT32"),
        ):
            tensor = httpclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer("ensemble", inputs)
    finally:
        client.close()
    texts = result.as_numpy("text_output")
    assert texts.shape[0] == 3
    assert clients.decode_texts(texts) == [plain_server.generate(body(p))["text_output"] for p in PROMPTS]


# ---------------------------------------------------------------------------------------------- tensorrt_llm_bls


def test_bls_answers_like_the_ensemble(plain_server):
    for prompt in PROMPTS:
        assert (
            plain_server.generate(body(prompt), model="tensorrt_llm_bls")["text_output"]
            == plain_server.generate(body(prompt))["text_output"]
        )


@pytest.mark.parametrize(
    "extra, name", [({"stream": True}, "'stream'"), ({"num_return_sequences": 2}, "'num_return_sequences'")]
)
def test_bls_refuses_what_needs_more_than_one_response(plain_server, extra, name):
    status, message = plain_server.generate_error(body(PROMPTS[0], **extra), model="tensorrt_llm_bls")
    assert status == 400 and name in message and "needs a decoupled tensorrt_llm_bls" in message


def test_bls_batch_of_three_returns_one_response_with_three_rows(plain_server):
    client = httpclient.InferenceServerClient(f"localhost:{plain_server.ports.http}")
    try:
        inputs = []
        for name, array, dtype in (
            ("text_input", np.array([[p.encode()] for p in PROMPTS], dtype=object), "BYTES"),
            ("max_tokens", np.full((3, 1), MAX_TOKENS, dtype=np.int32), "INT32"),
        ):
            tensor = httpclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer("tensorrt_llm_bls", inputs)
    finally:
        client.close()
    assert clients.decode_texts(result.as_numpy("text_output")) == [
        plain_server.generate(body(p))["text_output"] for p in PROMPTS
    ]


def test_cancelling_a_bls_request_stops_its_engine_request(plain_server):
    """The BLS sees the gRPC client cancel and sends tensorrt_llm a stop request with the request's id."""
    before = plain_server.wait_engine_idle()
    client = grpcclient.InferenceServerClient(plain_server.triton.grpc_url)
    max_tokens = plain_server.max_seq_len - 16
    try:
        future = client.async_infer(
            "tensorrt_llm_bls",
            clients.grpc_inputs(
                {"text_input": clients.strings(PROMPTS[0]), "max_tokens": clients.scalar(max_tokens, np.int32)}
            ),
            callback=lambda result, error: None,
        )
        deadline = time.monotonic() + 30
        while plain_server.metrics().get(("nv_trt_llm_request_metrics", "active")) != 1:
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
        future.cancel()
        after = plain_server.wait_engine_idle(timeout=20)
    finally:
        client.close()
    assert clients.engine_is_idle(after), after
    steps = (
        after[("nv_trt_llm_general_metrics", "iteration_counter")]
        - before[("nv_trt_llm_general_metrics", "iteration_counter")]
    )
    # The request's length, not a share of it: how far it gets before the cancel lands depends on the machine.
    assert steps < max_tokens, f"the engine ran {steps} steps of {max_tokens}: the request was not stopped"


def test_stop_request_answers_and_stops_the_running_request(plain_server, tokenizer):
    """One-response mode: the `stop` request gets its one (empty) response, no error, and the request it names
    ends early, cancelled."""
    before = plain_server.wait_engine_idle()
    client = grpcclient.InferenceServerClient(plain_server.triton.grpc_url)
    prompt_ids = tokenizer.encode(PROMPTS[1], add_special_tokens=True)
    max_tokens = plain_server.max_seq_len - len(prompt_ids) - 1
    outcome = {}
    try:
        client.async_infer(
            "tensorrt_llm",
            clients.grpc_inputs(clients.direct_request(prompt_ids, max_tokens, tokenizer.end_id)),
            request_id="stop-me",
            callback=lambda result, error: outcome.update(result=result, error=error),
        )
        deadline = time.monotonic() + 30
        while plain_server.metrics().get(("nv_trt_llm_request_metrics", "active")) != 1:
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.02)
        client.infer("tensorrt_llm", clients.grpc_inputs(clients.stop_request()), request_id="stop-me")
        while "error" not in outcome:
            assert time.monotonic() < deadline + 30, "the stopped request never answered"
            time.sleep(0.02)
    finally:
        client.close()
    assert outcome["error"] is not None and "cancelled" in str(outcome["error"])
    after = plain_server.wait_engine_idle(timeout=20)
    steps = (
        after[("nv_trt_llm_general_metrics", "iteration_counter")]
        - before[("nv_trt_llm_general_metrics", "iteration_counter")]
    )
    assert clients.engine_is_idle(after) and steps < max_tokens, (steps, after)
