"""One request to the tensorrt_llm model, as an iterator of its responses that another thread may cancel.

Two transports, chosen by the repository's transaction policy:
  * decoupled: a gRPC stream to this server's own endpoint (`GrpcTransport`). It streams, and cancelling it is a
    client cancellation that tensorrt_llm sees (it aborts the engine request, freeing its KV blocks). It avoids
    BLS `exec(decoupled=True)`: Triton 2.51 cannot cancel that iterator, and under concurrent streams with
    clients cancelling, that path crashed the server (see tritonllm.bls).
  * non-decoupled: BLS `exec` (`ExecTransport`), one response; cancelling sends tensorrt_llm a `stop` request
    with the same request id, as TensorRT-LLM's own clients do.
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

    def close(self) -> None:
        self.channel.close()


class GrpcCall:
    def __init__(self, transport: GrpcTransport, inputs: Mapping[str, np.ndarray], request_id: str):
        self.transport = transport
        self.cancelled = self.completed = False
        # One request on its own stream, so that cancelling the stream cancels exactly this request.
        self.stream = transport.stub.ModelStreamInfer(iter([infer_request(transport.model, inputs, request_id)]))

    def responses(self) -> Iterator[LlmResponse]:
        import grpc

        try:
            for message in self.stream:
                if message.error_message:
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
                self.stream.cancel()  # ends the stream on our side too

    def _finish(self) -> None:
        """After the final response, read the stream to its end: the server closes it once the request is done.
        Cancelling a stream that has just delivered its final response races the server's own completion, and
        tritonserver (2.5x) can then wait forever for a cancellation callback, keeping the model from unloading
        at shutdown (its stub process is left orphaned)."""
        for _ in self.stream:
            pass
        self.completed = True

    def cancel(self) -> None:
        self.cancelled = True
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
        stop = {
            "input_ids": np.zeros((1, 1), np.int32),
            "input_lengths": np.zeros((1, 1), np.int32),
            "request_output_len": np.zeros((1, 1), np.int32),
            "stop": np.ones((1, 1), bool),
        }
        try:
            exec_model(self.model, stop, request_id=self.request_id)
        except InnerModelError:
            pass  # the request may have finished meanwhile; nothing left to stop
