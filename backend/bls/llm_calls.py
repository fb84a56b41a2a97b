"""One request to the tensorrt_llm model, as an iterator of its responses that another thread may cancel.

Two transports, chosen by the repository's transaction policy:
  * decoupled: a gRPC stream to this server's own endpoint (`GrpcTransport`). It streams, and it avoids BLS
    `exec(decoupled=True)`: Triton 2.51 cannot cancel that iterator, and under concurrent streams with clients
    cancelling, that path crashed the server (see tritonllm.bls).
  * non-decoupled: BLS `exec` (`ExecTransport`), one response.
Either cancels by sending tensorrt_llm a `stop` request with the same request id, as TensorRT-LLM's own clients
do; tensorrt_llm aborts the engine request (its KV blocks freed) and ends it with a CANCELLED error. A gRPC
stream is then read to its end, not cancelled: Triton 2.51's gRPC front end can crash (SIGSEGV in
TRITONBACKEND_ResponseSend, a race fixed upstream in Triton 2.53) when a stream is cancelled while responses
are still being sent on it, and a CI run here saw it under the BLS stress test.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol

import numpy as np

from .inner_models import InnerModelError, exec_model

MAX_GRPC_MESSAGE_BYTES = 2**31 - 1


class LlmCancelled(Exception):
    """The call was cancelled (by `cancel()`); the request ended early."""


@dataclass
class LlmResponse:
    outputs: dict[str, np.ndarray]
    final: bool  # the last response of the tensorrt_llm request


class LlmCall(Protocol):
    """A tensorrt_llm request in flight (GrpcCall, ExecCall, or the BLS's SpeculativeCall)."""

    def responses(self) -> Iterator[LlmResponse]: ...

    def cancel(self) -> None: ...


# ---------------------------------------------------------------------------------------------- gRPC


STOP_GRACE_S = 10.0  # a stream that a stop has not ended by then is cancelled after all


def stop_inputs() -> dict[str, np.ndarray]:
    """A `stop` request's tensors (its request id names the request to stop)."""
    return {
        "input_ids": np.zeros((1, 1), np.int32),
        "input_lengths": np.zeros((1, 1), np.int32),
        "request_output_len": np.zeros((1, 1), np.int32),
        "stop": np.ones((1, 1), bool),
    }


class GrpcTransport:
    """One channel to the server's gRPC endpoint, shared by every call of a model instance."""

    def __init__(self, url: str, model: str):
        import grpc
        from tritonclient.grpc import service_pb2_grpc

        self.url, self.model = url, model
        self.channel = grpc.insecure_channel(
            url,
            options=[
                ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
            ],
        )
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def start(self, inputs: Mapping[str, np.ndarray], request_id: str) -> "GrpcCall":
        return GrpcCall(self, inputs, request_id)

    def stop(self, request_id: str) -> None:
        """Sends a `stop` request for `request_id` on a stream of its own and reads its one (empty) response."""
        request = infer_request(self.model, stop_inputs(), request_id)
        for _ in self.stub.ModelStreamInfer(iter([request]), timeout=STOP_GRACE_S):
            pass

    def close(self) -> None:
        self.channel.close()


class GrpcCall:
    def __init__(self, transport: GrpcTransport, inputs: Mapping[str, np.ndarray], request_id: str):
        self.transport, self.request_id = transport, request_id
        self.cancelled = self.completed = False
        self.lock = threading.Lock()
        self.grace: threading.Timer | None = None  # cancels the stream if a stop has not ended it
        # One request on its own stream, so that its end is the stream's end.
        self.stream = transport.stub.ModelStreamInfer(iter([infer_request(transport.model, inputs, request_id)]))

    def responses(self) -> Iterator[LlmResponse]:
        import grpc

        try:
            for message in self.stream:
                if message.error_message:  # the request's end (a stopped one's too): its stream closes
                    self._finish()
                    if self.cancelled:
                        raise LlmCancelled()
                    raise InnerModelError(
                        self.transport.model, message.error_message, is_input_error="input '" in message.error_message
                    )
                response = LlmResponse(decode_outputs(message.infer_response), is_final(message.infer_response))
                if response.final:
                    self._finish()
                yield response
                if response.final:
                    return
        except grpc.RpcError as error:
            if self.cancelled or error.code() == grpc.StatusCode.CANCELLED:
                raise LlmCancelled() from None
            raise InnerModelError(
                self.transport.model,
                f"gRPC call to {self.transport.url} failed: {error.code().name}: {error.details()}",
                is_input_error=False,
            ) from None
        finally:
            if not self.completed:
                self._end()

    def _finish(self) -> None:
        """After the final response, read the stream to its end: the server closes it once the request is done.
        Cancelling a stream that has just delivered its final response races the server's own completion, and
        tritonserver (2.5x) can then wait forever for a cancellation callback, keeping the model from unloading
        at shutdown (its stub process is left orphaned)."""
        for _ in self.stream:
            pass
        self.completed = True
        if self.grace is not None:
            self.grace.cancel()

    def _end(self) -> None:
        """The caller stopped reading before the final response: stop the request and read its stream out."""
        import grpc

        self.cancel()
        try:
            self._finish()
        except grpc.RpcError:
            pass  # cancelled by the grace timer, or the server went away

    def cancel(self) -> None:
        """Stops the request with a `stop` request, without cancelling its stream (module docstring); a stream
        the stop has not ended within STOP_GRACE_S is cancelled, as is one whose stop could not be sent."""
        import grpc

        with self.lock:
            if self.cancelled or self.completed:
                return
            self.cancelled = True
        try:
            self.transport.stop(self.request_id)
        except grpc.RpcError:
            self.stream.cancel()
            return
        self.grace = threading.Timer(STOP_GRACE_S, self._cancel_if_running)
        self.grace.daemon = True
        self.grace.start()

    def _cancel_if_running(self) -> None:
        if not self.completed:
            self.stream.cancel()


def infer_request(model: str, inputs: Mapping[str, np.ndarray], request_id: str):
    from tritonclient.grpc import service_pb2
    from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    # Without it Triton drops a final flag that comes without outputs, and the stream's end would go unseen.
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, array in inputs.items():
        array = np.ascontiguousarray(array)
        request.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
        # The bytes go in raw_input_contents, in the order of the inputs.
        # (serialize_byte_tensor returns a 0-d object array holding the bytes: take the item, not its pointer.)
        raw = serialize_byte_tensor(array).item() if array.dtype.kind in "OSU" else array.tobytes()
        request.raw_input_contents.append(raw)
    return request


def decode_outputs(response) -> dict[str, np.ndarray]:
    from tritonclient.grpc import InferResult

    result = InferResult(response)
    return {output.name: result.as_numpy(output.name) for output in response.outputs}


def is_final(response) -> bool:
    flag = response.parameters.get("triton_final_response")
    return flag is not None and flag.bool_param


# ---------------------------------------------------------------------------------------------- BLS exec


class ExecTransport:
    """BLS exec to a non-decoupled tensorrt_llm: one response per request."""

    def __init__(self, model: str):
        self.model = model

    def start(self, inputs: Mapping[str, np.ndarray], request_id: str) -> "ExecCall":
        return ExecCall(self.model, inputs, request_id)

    def close(self) -> None:
        pass


class ExecCall:
    def __init__(self, model: str, inputs: Mapping[str, np.ndarray], request_id: str):
        self.model, self.inputs, self.request_id = model, inputs, request_id
        self.cancelled = False
        self.lock = threading.Lock()

    def responses(self) -> Iterator[LlmResponse]:
        try:
            outputs = exec_model(self.model, self.inputs, request_id=self.request_id)
        except InnerModelError:
            if self.cancelled:
                raise LlmCancelled() from None
            raise
        yield LlmResponse(outputs, final=True)

    def cancel(self) -> None:
        """Ask tensorrt_llm to stop the request: a `stop` request with the same request id."""
        with self.lock:
            if self.cancelled:
                return
            self.cancelled = True
        try:
            exec_model(self.model, stop_inputs(), request_id=self.request_id)
        except InnerModelError:
            pass  # the request may have finished meanwhile; nothing left to stop
