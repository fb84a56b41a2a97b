"""Cancelling a long stream to `tensorrt_llm` mid-way, three ways: a `stop=true` request with the same request
id, a gRPC client cancelling its stream, an HTTP client closing its generate_stream connection. Each time the
engine must stop generating (the iteration counter shows it) and free every KV block (the metrics show it).

Cancelling a stream to the `ensemble` is not tested: Triton 2.51 does not tell an ensemble's steps that its
client went away (environment.md), so `tensorrt_llm` cannot see it."""

from __future__ import annotations

import json

import e2e_clients as clients
import pytest

pytestmark = pytest.mark.server

PROMPT = "The lamp turned and turned"
TOKENS_BEFORE_CANCEL = 5
# Far more steps than a stop sent before its request lets run (usually none).
EARLY = 400
ITERATIONS = clients.ITERATIONS


@pytest.fixture
def long_request(server, tokenizer):
    """Inputs of a streaming request for as many tokens as max_seq_len allows (`max_tokens` of them), and the
    engine's idle state."""
    before = server.wait_engine_idle()
    assert clients.engine_is_idle(before), f"the engine is busy before the test: {before}"
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    max_tokens = server.max_seq_len - len(prompt_ids) - 1
    inputs = clients.direct_request(prompt_ids, max_tokens, tokenizer.end_id, streaming=True)
    return inputs, before


def assert_engine_stopped_early(server, inputs, before) -> None:
    clients.assert_cut_short(server, before, int(inputs["request_output_len"].flat[0]))


def read_tokens(stream: clients.GrpcStream, reply: clients.StreamReply, count: int) -> None:
    while len(reply.results) < count and not reply.finished:
        clients.add_event(reply, *stream.next_event(timeout=30))


def test_stop_request_with_the_same_request_id(server, long_request):
    inputs, before = long_request
    stream = server.grpc_stream()
    stopper = server.grpc_stream()
    try:
        stream.send("tensorrt_llm", inputs, request_id="cancel-me")
        reply = clients.StreamReply()
        read_tokens(stream, reply, TOKENS_BEFORE_CANCEL)
        assert not reply.finished, reply.error
        stopper.send("tensorrt_llm", clients.stop_request(), request_id="cancel-me")
        stop_reply = stopper.collect(timeout=30)
        assert stop_reply.error is None and stop_reply.finished
        stream.collect(reply, timeout=30)
    finally:
        stream.close()
        stopper.close()
    assert reply.error is not None and "cancelled" in reply.error
    assert TOKENS_BEFORE_CANCEL <= len(reply.results) < int(inputs["request_output_len"].flat[0])
    assert_engine_stopped_early(server, inputs, before)


def test_stop_request_before_its_request_is_held_and_stops_it(server, long_request):
    """A `stop` that overtakes its request (sent first) is held briefly: the request arriving next is cancelled."""
    inputs, before = long_request
    stop_reply = server.stream_infer("tensorrt_llm", clients.stop_request(), request_id="overtaken")
    assert stop_reply.error is None and stop_reply.finished
    reply = server.stream_infer("tensorrt_llm", inputs, request_id="overtaken", timeout=30)
    assert reply.error is not None and "cancelled" in reply.error
    assert len(reply.results) < EARLY
    after = server.wait_engine_idle(timeout=10)
    assert clients.engine_is_idle(after), f"the engine did not free its blocks or requests: {after}"
    assert after[ITERATIONS] - before[ITERATIONS] < EARLY  # often 0: cancelled before its first step


def test_stop_request_without_a_request_id_is_an_error(server):
    reply = server.stream_infer("tensorrt_llm", clients.stop_request())
    assert reply.error is not None and "request id" in reply.error


def test_grpc_client_cancelling_its_stream(server, long_request):
    inputs, before = long_request
    stream = server.grpc_stream()
    try:
        stream.send("tensorrt_llm", inputs, request_id="abandoned")
        reply = clients.StreamReply()
        read_tokens(stream, reply, TOKENS_BEFORE_CANCEL)
        assert not reply.finished, reply.error
    finally:
        stream.close(cancel=True)
    assert_engine_stopped_early(server, inputs, before)


def test_http_client_closing_its_generate_stream(server, long_request):
    inputs, before = long_request
    body = clients.generate_body(inputs)
    connection = server.connection()
    try:
        connection.request(
            "POST", "/v2/models/tensorrt_llm/generate_stream", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 200
        events = clients.sse_events(response)
        received = [next(events) for _ in range(TOKENS_BEFORE_CANCEL)]
        assert all("output_ids" in event for event in received), received
    finally:
        connection.close()
    assert_engine_stopped_early(server, inputs, before)
