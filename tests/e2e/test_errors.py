"""Malformed requests get a clear error naming the input, and disturb nothing else: a stream that runs meanwhile
completes in full."""

from __future__ import annotations

import e2e_clients as clients
import numpy as np
import pytest
from e2e_clients import scalar, strings

pytestmark = pytest.mark.server

GOOD_PROMPT = "Tea, bread, light, water"
GOOD_TOKENS = 300  # long enough to still be streaming while the bad requests come and go


def http_errors(server) -> dict[str, tuple[int, str]]:
    """Each malformed /generate request on the ensemble: (HTTP status, error message)."""
    too_long = server.max_seq_len - 1  # allowed alone, but prompt + max_tokens exceeds max_seq_len
    bodies = {
        "missing text_input": {"max_tokens": 5},
        "max_tokens 0": {"text_input": "Hi", "max_tokens": 0},
        "max_tokens beyond the limit": {"text_input": "Hello there", "max_tokens": too_long},
        "lora_task_id without LoRA": {"text_input": "Hi", "max_tokens": 5, "lora_task_id": 3},
    }
    return {case: server.generate_error(body) for case, body in bodies.items()}


def wrong_dtype_error(server) -> str:
    """max_tokens sent as FP32 on a gRPC stream (HTTP infer refuses decoupled models before looking at types)."""
    reply = server.stream_infer("ensemble", {"text_input": strings("Hi"), "max_tokens": scalar(5.0, np.float32)})
    assert reply.error is not None and not reply.results, "an FP32 max_tokens was accepted"
    return reply.error


def test_malformed_requests_fail_alone_while_a_stream_completes(server):
    expected = server.generate({"text_input": GOOD_PROMPT, "max_tokens": GOOD_TOKENS, "exclude_input_in_output": True})[
        "text_output"
    ]
    stream = server.grpc_stream()
    reply = clients.StreamReply()
    try:
        stream.send(
            "ensemble",
            {
                "text_input": strings(GOOD_PROMPT),
                "max_tokens": scalar(GOOD_TOKENS, np.int32),
                "exclude_input_in_output": scalar(True, bool),
                "stream": scalar(True, bool),
            },
        )
        clients.add_event(reply, *stream.next_event(timeout=30))  # the stream is under way
        errors = http_errors(server)
        dtype_error = wrong_dtype_error(server)
        while not stream.events.empty():
            clients.add_event(reply, *stream.events.get())
        still_streaming = not reply.finished
        stream.collect(reply, timeout=120)
    finally:
        stream.close()

    status, message = errors["missing text_input"]
    assert status == 400 and "text_input" in message and "missing" in message
    status, message = errors["max_tokens 0"]
    assert status == 400 and "max_tokens" in message and "request_output_len" in message
    status, message = errors["max_tokens beyond the limit"]
    assert status == 400 and "max_tokens" in message and f"exceeds max_seq_len {server.max_seq_len}" in message
    status, message = errors["lora_task_id without LoRA"]  # this repository runs without LoRA
    assert status == 400 and "LoRA is not enabled" in message and "enable_lora" in message
    assert "max_tokens" in dtype_error and "FP32" in dtype_error

    assert still_streaming, "the good stream ended before the bad requests were answered: make it longer"
    assert reply.error is None, reply.error
    assert "".join(reply.texts()) == expected
    assert len(reply.results) >= GOOD_TOKENS // 2
