"""The engine seam: what the Triton side and the commands may rely on, whichever engine runs.

`Engine` is TensorRT-LLM's LLM-API shape as this package uses it; `EmbeddedEngine` (engine/embedded/) and
`TensorRTLLMEngine` (engine/trtllm.py) implement it, and neither imports the other. The value types of requests
and outputs are in engine/types.py, the configuration in engine/config.py."""

from __future__ import annotations

import asyncio
import queue
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

from .types import LoRARequest, RequestOutput, SamplingParams

_END = object()


class Engine(Protocol):
    def generate_async(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        streaming: bool = False,
        request_id: Optional[int] = None,
        on_output: Optional[Callable[["RequestHandle", object], None]] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> "RequestHandle":
        """Submit a request; a bad one raises here, on the caller's thread. `on_output` (optional) gets every
        output, or the exception that ended the request, on the engine's thread instead of the handle's queue."""
        ...

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> RequestOutput:
        """Submit a request and wait for its final output."""
        ...

    def abort(self, request_id: int) -> None:
        """Cancel a request; it then ends with finish_reason 'cancelled'. Unknown ids are ignored."""
        ...

    def stats(self) -> "EngineStats": ...

    def wait_idle(self, timeout: float = 10.0) -> "EngineStats": ...

    def shutdown(self) -> None: ...


@dataclass
class EngineStats:
    num_total_blocks: int
    num_free_blocks: int  # unused by any request, cached prefixes included
    tokens_per_block: int
    num_running: int
    num_waiting: int
    num_steps: int
    max_seq_len: int
    max_batch_size: int
    max_num_tokens: int
    num_cached_blocks: int = 0  # free blocks that still hold a reusable prefix
    num_reused_blocks: int = 0  # blocks taken from the prefix cache since the engine started
    num_context_requests: int = 0  # running requests whose prompt is not fully computed yet
    num_context_tokens: int = 0  # prompt tokens computed in the last step
    num_paused_requests: int = 0  # preempted requests waiting to be recomputed


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


class RequestHandle:
    """Outputs of one request: every step's update when streaming, else only the final one."""

    def __init__(
        self,
        engine: "Engine",
        request_id: int,
        streaming: bool,
        on_output: Optional[Callable[["RequestHandle", object], None]] = None,
    ):
        self.engine = engine
        self.request_id = request_id
        self.streaming = streaming
        self._on_output = on_output
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._last: Optional[RequestOutput] = None
        self._done = False

    def _put(self, item) -> None:
        # With a callback, outputs (or the exception that ended the request) go to it, on the engine thread.
        if self._on_output is not None:
            self._on_output(self, item)
        else:
            self._outputs.put(item)

    def __iter__(self):
        return self

    def __next__(self) -> RequestOutput:
        return self._next(None)

    def _next(self, timeout: Optional[float]) -> RequestOutput:
        if self._done:
            raise StopIteration
        item = self._outputs.get(timeout=timeout)
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item is _END:
            self._done = True
            raise StopIteration
        self._last = item
        if item.finished:
            self._outputs.put(_END)
        return item

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        # StopIteration cannot cross a Future, so the worker thread returns the end marker instead.
        item = await asyncio.to_thread(self._next_or_end)
        if item is _END:
            raise StopAsyncIteration
        return item

    def _next_or_end(self):
        try:
            return self._next(None)
        except StopIteration:
            return _END

    def result(self, timeout: Optional[float] = None) -> RequestOutput:
        """Block until the request finishes; returns its final output."""
        while not self._done:
            try:
                self._next(timeout)
            except StopIteration:
                break
        if self._last is None:  # asked again after the request failed before any output
            raise EngineError(f"request {self.request_id} ended without an output")
        return self._last

    async def aresult(self) -> RequestOutput:
        return await asyncio.to_thread(self.result)

    def abort(self) -> None:
        self.engine.abort(self.request_id)

    @property
    def finished(self) -> bool:
        return self._last is not None and self._last.finished
