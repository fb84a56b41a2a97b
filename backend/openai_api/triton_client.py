"""Async gRPC to Triton: health, a model's config parameters, and one decoupled stream per request.

Each request gets its own bidirectional `ModelStreamInfer` call (on one shared channel), so cancelling the call
cancels exactly that request: a client that goes away cancels its call, and `tensorrt_llm_bls` aborts the engine
request (an `ensemble` cannot be cancelled in Triton 2.51; see the README). The messages are tritonclient's
protobufs; tritonclient's own aio wrapper is not used for streams because it cannot ask for the empty final
response that marks a stream's end."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncGenerator, AsyncIterator, Mapping, Optional, Sequence

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, np_to_triton_dtype, serialize_byte_tensor, triton_to_np_dtype

from .errors import BackendFailed, BadRequest, PromptTooLong, ServiceUnavailable, Unsupported

MAX_MESSAGE_BYTES = 2**31 - 1
HEALTH_TIMEOUT_S = 2.0
# Words of the backend's error messages that blame the request, not the server.
_REQUEST_FAULTS = (
    "input '",
    "must be",
    "exceeds",
    "not supported",
    "is empty",
    "outside the vocabulary",
    "does not compile",  # a guided-decoding schema, regex or grammar
)
# Messages that mean this server's models cannot do what a valid request asks: the engine runs without a
# guided-decoding backend, or the backend model does not declare an input, or refuses it as not built (guided
# decoding's, on an older repository).
_SERVER_CANNOT = ("runs without guided decoding", "unexpected inference input", "not supported yet")


@dataclass
class StreamResponse:
    outputs: dict[str, np.ndarray]
    final: bool


class TritonClient:
    def __init__(self, url: str):
        self.url = url
        self._channel: Optional[grpc.aio.Channel] = None
        self._stub = None

    @property
    def stub(self):
        """The channel belongs to the event loop that first uses it (uvicorn's), so it is made on first use."""
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                self.url,
                options=[
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ],
            )
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    # -- health and configuration ---------------------------------------------------------------------------

    async def ready(self, model: str) -> bool:
        """Server live and ready, and `model` ready; False (never an exception) when Triton cannot be reached."""
        try:
            server = await self.stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=HEALTH_TIMEOUT_S)
            if not server.ready:
                return False
            reply = await self.stub.ModelReady(service_pb2.ModelReadyRequest(name=model), timeout=HEALTH_TIMEOUT_S)
            return reply.ready
        except grpc.aio.AioRpcError:
            return False

    async def model_parameter(self, model: str, key: str) -> Optional[str]:
        """A config.pbtxt parameter of `model` as Triton loaded it; None when unset, unfilled or unreachable."""
        try:
            reply = await self.stub.ModelConfig(service_pb2.ModelConfigRequest(name=model), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None
        parameter = reply.config.parameters.get(key)
        value = parameter.string_value.strip() if parameter is not None else ""
        return value if value and not value.startswith("${") else None

    # -- streams ---------------------------------------------------------------------------------------------

    async def stream(
        self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]
    ) -> AsyncGenerator[StreamResponse, None]:
        """The responses of one request, up to its final one. Leaving the iteration early (a break, an
        exception, a cancelled task) cancels the request on Triton."""
        request = infer_request(model, inputs, outputs)
        call = self.stub.ModelStreamInfer(_one_request(request))
        try:
            async for message in call:
                if message.error_message:
                    raise backend_error(model, message.error_message)
                response = StreamResponse(decode_outputs(message.infer_response), is_final(message.infer_response))
                yield response
                if response.final:
                    return
        except grpc.aio.AioRpcError as error:
            raise rpc_error(self.url, error) from None
        finally:
            call.cancel()  # a no-op once the call completed


async def _one_request(request) -> AsyncIterator:
    """Send the request, then keep the sending side open until the call ends: half-closing right away is
    allowed, but an open side keeps every Triton version streaming to the end."""
    yield request
    await asyncio.Event().wait()  # cancelled with the call


def infer_request(model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str]):
    request = service_pb2.ModelInferRequest(model_name=model)
    # Without it Triton drops a final flag that comes without outputs, and the stream's end would go unseen.
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    for name, array in inputs.items():
        array = np.ascontiguousarray(array)
        request.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=list(array.shape))
        request.raw_input_contents.append(_raw_bytes(array))
    for name in outputs:
        request.outputs.add(name=name)
    return request


def _raw_bytes(array: np.ndarray) -> bytes:
    if array.dtype.kind not in "OSU":
        return array.tobytes()
    # serialize_byte_tensor returns a 0-d object array holding the bytes (its .tobytes() would be a pointer)
    return serialize_byte_tensor(array).item()


def decode_outputs(response) -> dict[str, np.ndarray]:
    """The response's tensors, read in one pass over its raw contents (they come in the order of `outputs`)."""
    if len(response.raw_output_contents) != len(response.outputs):  # tensors sent in `contents` instead
        result = InferResult(response)
        return {output.name: result.as_numpy(output.name) for output in response.outputs}
    tensors = {}
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.datatype == "BYTES":
            array = deserialize_bytes_tensor(raw)
        else:
            array = np.frombuffer(raw, dtype=triton_to_np_dtype(output.datatype))
        tensors[output.name] = array.reshape(list(output.shape))
    return tensors


def is_final(response) -> bool:
    flag = response.parameters.get("triton_final_response")
    return flag is not None and flag.bool_param


def backend_error(model: str, message: str) -> Exception:
    if "exceeds max_seq_len" in message or "exceeds max_num_tokens" in message:
        return PromptTooLong(f"{model}: {message}")
    if any(words in message for words in _SERVER_CANNOT):
        return Unsupported(f"{model} cannot serve this request: {message}")
    if any(word in message for word in _REQUEST_FAULTS):
        return BadRequest(f"{model}: {message}")
    return BackendFailed(f"{model} failed: {message}")


def rpc_error(url: str, error: grpc.aio.AioRpcError) -> Exception:
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ServiceUnavailable(f"Triton at {url} is unreachable: {error.details()}")
    return BackendFailed(f"gRPC call to Triton at {url} failed: {error.code().name}: {error.details()}")
