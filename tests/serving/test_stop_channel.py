"""The stop channel: a cancelled ensemble stream's postprocessing step stops the `tensorrt_llm` request behind it
(Triton 2.51 tells only the steps it schedules after the cancel), and that request then ends with the final flag
alone, never an error."""

import sys
import threading
import time

import fake_pb_utils as fake
import numpy as np
import pytest

from tritonllm.engine.types import CompletionOutput, RequestOutput
from tritonllm.triton.stop_channel import StopChannel, send_stop


@pytest.fixture(autouse=True)
def pb_utils(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_key_sent_reaches_its_channel_with_its_token():
    received = []
    channel = StopChannel(received.append)
    try:
        token = channel.new_token()
        assert send_stop(channel.key(token))
        wait_for(lambda: received == [token])
    finally:
        channel.close()
    assert not channel.thread.is_alive()


def test_malformed_keys_and_keys_of_a_closed_channel_are_not_sent():
    channel = StopChannel(lambda token: None)
    key = channel.key(channel.new_token())
    channel.close()
    assert not send_stop(key)  # nobody listens: the model (or its request) is gone
    assert not send_stop("no separator")
    assert not send_stop("/tmp/somewhere#token")
    assert not send_stop("")


class _Handle:
    def __init__(self, request_id):
        self.request_id = request_id


class _StreamingEngine:
    """Streams two tokens at once, then generates until aborted; the abort finishes the request."""

    def __init__(self):
        self.outputs = {}
        self.aborted = threading.Event()

    def generate_async(self, prompt, params, streaming, on_output):
        handle = _Handle(len(self.outputs) + 1)
        self.outputs[handle.request_id] = (handle, prompt, on_output)
        on_output(handle, RequestOutput(handle.request_id, list(prompt), [CompletionOutput(0, [7, 8])]))
        return handle

    def abort(self, request_id):
        handle, prompt, on_output = self.outputs[request_id]
        self.aborted.set()
        done = CompletionOutput(0, [7, 8], finish_reason="cancelled", _diff_start=2)
        on_output(handle, RequestOutput(request_id, list(prompt), [done], finished=True))


def _streaming_request(**kwargs):
    return fake.InferenceRequest(
        {
            "input_ids": np.array([[5, 6, 7]], dtype=np.int32),
            "input_lengths": np.array([[3]], dtype=np.int32),
            "request_output_len": np.array([[50]], dtype=np.int32),
            "streaming": np.array([[True]]),
        },
        **kwargs,
    )


def _server(engine):
    from tritonllm.triton.llm_inflight import LLMInflightRequests

    return LLMInflightRequests(engine, decoupled=True, exclude_input_in_output=True, cancellation_check_ms=10)


def test_a_request_stopped_by_its_cancel_key_ends_with_the_bare_final_flag():
    engine = _StreamingEngine()
    server = _server(engine)
    request = _streaming_request(requested_outputs=["output_ids", "sequence_length", "cancel_key"])
    try:
        server.submit(request)
        sender = request.get_response_sender()
        wait_for(lambda: sender.sent)
        first, flags = sender.sent[0]
        assert flags == 0
        (key,) = fake.get_output_tensor_by_name(first, "cancel_key").as_numpy().reshape(-1)
        assert send_stop(key.decode())
        wait_for(lambda: sender.finished)
    finally:
        server.shutdown()
    assert engine.aborted.is_set()
    last, flags = sender.sent[-1]
    assert last is None and flags == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert not server.by_cancel_token and not server.active


def test_a_request_that_does_not_ask_for_a_cancel_key_gets_none():
    engine = _StreamingEngine()
    server = _server(engine)
    request = _streaming_request(requested_outputs=["output_ids", "sequence_length"])
    try:
        server.submit(request)
        sender = request.get_response_sender()
        wait_for(lambda: sender.sent)
        assert fake.get_output_tensor_by_name(sender.sent[0][0], "cancel_key") is None
        assert not server.by_cancel_token
    finally:
        server.shutdown()


def test_postprocessing_stops_the_generation_of_a_cancelled_request_once_and_still_answers(monkeypatch):
    import tritonllm.models.postprocessing as post

    sent = []
    monkeypatch.setattr(post, "send_stop", sent.append)
    postprocessor = post.Postprocessor(_FakeTokenizer())
    inputs = {
        "TOKENS_BATCH": np.array([[[1, 2]]], dtype=np.int32),
        "SEQUENCE_LENGTH": np.array([[2]], dtype=np.int32),
        "CANCEL_KEY": np.array([[b"tritonllm-stop-1-ab#cd"]], dtype=object),
    }
    for cancelled in (False, True, True):
        response = postprocessor.respond(fake.InferenceRequest(inputs, cancelled=cancelled))
        assert not response.has_error()
    assert sent == ["tritonllm-stop-1-ab#cd"]  # not for the live request; once for the cancelled stream


class _FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(ord("a") + i) for i in ids)
