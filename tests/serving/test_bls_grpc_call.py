"""How the BLS ends its gRPC call to tensorrt_llm early, against a scripted stream (no server): a `stop` request
with the call's request id, then the stream read to its end; the stream is cancelled only where no stop could
be sent or the stop did not end it in time (Triton 2.51's gRPC front end can crash on a cancelled stream)."""

from __future__ import annotations

import queue
import threading

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from tritonllm.bls import llm_calls
from tritonllm.bls.llm_calls import GrpcCall, LlmCancelled

END = object()


def token_message(token: int, final: bool = False):
    message = service_pb2.ModelStreamInferResponse()
    response = message.infer_response
    response.outputs.add(name="output_ids", datatype="INT32", shape=[1, 1, 1])
    response.raw_output_contents.append(np.array([token], np.int32).tobytes())
    response.parameters["triton_final_response"].bool_param = final
    return message


def error_message(text: str):
    return service_pb2.ModelStreamInferResponse(error_message=text)


class ScriptedStream:
    """A gRPC response stream fed from a queue: a test puts messages, END closes it; cancel() fails it."""

    def __init__(self):
        self.messages: queue.Queue = queue.Queue()
        self.cancelled = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        if self.cancelled.is_set():  # as a real stream: cancelled, it fails every read
            raise Cancelled()
        item = self.messages.get(timeout=10)
        if item is END:
            raise StopIteration
        if isinstance(item, grpc.RpcError):
            raise item
        return item

    def cancel(self):
        self.cancelled.set()
        self.messages.put(Cancelled())  # wakes a read that waits


class Cancelled(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "Locally cancelled by application!"


class Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "Socket closed"


class ScriptedTransport:
    """tensorrt_llm behind a scripted stream: a stop for the running id ends it with CANCELLED (stop_ends)."""

    model, url = "tensorrt_llm", "localhost:0"

    def __init__(self, stop_ends: bool = True, stop_fails: bool = False):
        self.stream = ScriptedStream()
        self.stops: list[str] = []
        self.stop_ends, self.stop_fails = stop_ends, stop_fails
        self.stub = self  # GrpcCall opens its stream with transport.stub.ModelStreamInfer

    def ModelStreamInfer(self, requests):  # noqa: N802 (the gRPC stub's method name)
        self.request_id = next(iter(requests)).id
        return self.stream

    def stop(self, request_id: str) -> None:
        if self.stop_fails:
            raise Unavailable()
        self.stops.append(request_id)
        if self.stop_ends:
            self.stream.messages.put(error_message("Request cancelled by client"))
            self.stream.messages.put(END)


def started(transport: ScriptedTransport) -> GrpcCall:
    return GrpcCall(transport, {"input_ids": np.zeros((1, 2), np.int32)}, "bls-1")


def test_a_cancel_stops_the_request_by_its_id_and_never_cancels_the_stream():
    transport = ScriptedTransport()
    call = started(transport)
    transport.stream.messages.put(token_message(7))
    responses = call.responses()
    assert next(responses).outputs["output_ids"].tolist() == [[[7]]]
    call.cancel()
    call.cancel()  # once only
    with pytest.raises(LlmCancelled):
        next(responses)
    assert transport.stops == ["bls-1"] and transport.request_id == "bls-1"
    assert call.completed and not transport.stream.cancelled.is_set()


def test_a_reader_that_stops_early_stops_the_request_and_reads_its_stream_out():
    """As the BLS does when a stop word ended every sequence before tensorrt_llm's final response."""
    transport = ScriptedTransport()
    call = started(transport)
    for token in (1, 2, 3):
        transport.stream.messages.put(token_message(token))
    responses = call.responses()
    next(responses)
    responses.close()  # the generator dropped: its finally stops the request
    assert transport.stops == ["bls-1"]
    assert call.completed and not transport.stream.cancelled.is_set()


def test_a_call_that_ends_is_neither_stopped_nor_cancelled():
    transport = ScriptedTransport()
    call = started(transport)
    transport.stream.messages.put(token_message(4))
    transport.stream.messages.put(token_message(5, final=True))
    transport.stream.messages.put(END)
    assert [r.final for r in call.responses()] == [False, True]
    call.cancel()  # after its end (the client went away as it finished): nothing to stop
    assert transport.stops == [] and not transport.stream.cancelled.is_set()


def test_an_error_ends_the_call_without_a_stop():
    transport = ScriptedTransport()
    call = started(transport)
    transport.stream.messages.put(error_message("input 'input_ids': empty"))
    transport.stream.messages.put(END)
    with pytest.raises(llm_calls.InnerModelError, match="input 'input_ids'"):
        list(call.responses())
    assert transport.stops == [] and not transport.stream.cancelled.is_set()


def cancelled_after_one_token(transport: ScriptedTransport) -> None:
    """Reads one response, cancels, and expects the call to end cancelled."""
    call = started(transport)
    responses = call.responses()
    transport.stream.messages.put(token_message(1))
    next(responses)
    call.cancel()
    with pytest.raises(LlmCancelled):
        next(responses)


def test_a_stop_that_cannot_be_sent_cancels_the_stream():
    transport = ScriptedTransport(stop_fails=True)
    cancelled_after_one_token(transport)
    assert transport.stream.cancelled.is_set()


def test_a_stop_that_does_not_end_the_stream_in_time_cancels_it(monkeypatch):
    monkeypatch.setattr(llm_calls, "STOP_GRACE_S", 0.2)
    transport = ScriptedTransport(stop_ends=False)
    cancelled_after_one_token(transport)  # nothing came after the stop: the grace timer cancelled the stream
    assert transport.stops == ["bls-1"] and transport.stream.cancelled.is_set()
