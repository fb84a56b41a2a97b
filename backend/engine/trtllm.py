"""`TensorRTLLMEngine`: the engine seam implemented by TensorRT-LLM's LLM API (`tensorrt_llm.LLM`).

Written against the LLM API as read in NVIDIA/TensorRT-LLM (llmapi/llm.py, llmapi/llm_args.py, sampling_params.py,
executor/result.py; commits named in tests/engine/fake_tensorrt_llm.py) and tested only against a recording
stand-in of that API: TensorRT-LLM cannot be installed on the machines this project is built on.

What goes to the library is built in trtllm_args (`llm_kwargs`, `trtllm_sampling_params`), what comes back is read in
trtllm_outputs; both are pure functions. This module runs the requests. They run on ONE asyncio loop thread owned by
the adapter: the library's results are asyncio-based and only async-iterable when created while a loop runs, so
`LLM.generate_async` is called on that loop and one task per request turns each library update into our
`RequestOutput` (streaming deltas carry only the tokens not delivered before)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import threading
from dataclasses import replace
from typing import Any, Callable, Optional

from .config import EngineConfig
from .seam import EngineError, EngineStats, RequestHandle
from .trtllm_args import llm_kwargs, trtllm_sampling_params
from .trtllm_outputs import completion_from_trtllm, engine_stats_from_iteration
from .types import InvalidRequestError, RequestOutput, SamplingParams, require_guided_backend

log = logging.getLogger("tritonllm.engine.trtllm")

NOT_INSTALLED_MESSAGE = "TensorRT-LLM is not installed; use engine: embedded"
STATS_POLL_TIMEOUT_S = 0.01  # `LLM.get_stats` waits this long for queued iteration stats; stats() must not stall
SHUTDOWN_DRAIN_TIMEOUT_S = 10.0  # how long shutdown lets aborted requests deliver their final output


class TensorRTLLMNotInstalled(ImportError):
    """`engine: tensorrt_llm` was chosen but the library cannot be imported."""


def import_tensorrt_llm():
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise TensorRTLLMNotInstalled(NOT_INSTALLED_MESSAGE) from exc
    return tensorrt_llm


# -- the request handle -------------------------------------------------------------------------------------------


class TensorRTLLMRequestHandle(RequestHandle):
    """The seam's handle (iterable, async-iterable, result(), abort()), fed with library updates
    converted to our `RequestOutput`. It remembers, per sequence, how many tokens it delivered, so a streaming
    update's `token_ids_diff` holds only new tokens whatever the library's own diff bookkeeping does."""

    def __init__(
        self,
        engine: "TensorRTLLMEngine",
        request_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        streaming: bool,
        on_output: Optional[Callable] = None,
    ):
        super().__init__(engine, request_id, streaming, on_output)
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.trtllm_params: Any = None  # set at submission; the library fills its end_id in place when None
        self.trtllm_lora: Any = None  # the library's LoRARequest, if any
        self._delivered: dict[int, int] = {}

    def _deliver_update(self, update: Any) -> None:
        if self.streaming or update.finished:
            self._put(self._snapshot(update))

    def _snapshot(self, update: Any) -> RequestOutput:
        end_id = self.params.end_id if self.params.end_id is not None else getattr(self.trtllm_params, "end_id", None)
        outputs = []
        for output in update.outputs:
            completion = completion_from_trtllm(
                output, self._delivered.get(output.index, 0), self.params.stop_words, end_id
            )
            if self.streaming:
                self._delivered[output.index] = len(completion.token_ids)
            outputs.append(completion)
        return RequestOutput(self.request_id, list(self.prompt_token_ids), outputs, finished=bool(update.finished))


# -- the loop thread ----------------------------------------------------------------------------------------------


class _LoopThread:
    """One asyncio loop on one daemon thread; everything touching the library's results runs here."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="tritonllm-trtllm-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def in_loop(self) -> bool:
        return threading.current_thread() is self.thread

    def call(self, fn: Callable, *args):
        """Run `fn(*args)` on the loop and return its result (or raise its exception) to the caller. Called from
        the loop itself (an on_output callback submitting a request), it runs at once instead of waiting on
        itself."""
        if self.in_loop():
            return fn(*args)
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return future.result()

    def call_soon(self, fn: Callable, *args) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def run_coroutine(self, coroutine, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        self.run_coroutine(_cancel_tasks())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()


async def _cancel_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# -- the engine ---------------------------------------------------------------------------------------------------


class TensorRTLLMEngine:
    """generate_async / abort / stats / shutdown, as `EmbeddedEngine`, on `tensorrt_llm.LLM`."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.trtllm = import_tensorrt_llm()
        # Built on the caller's thread, as TensorRT-LLM's own Triton model builds it off its event loop.
        self.llm = self.trtllm.LLM(**llm_kwargs(config, self.trtllm))
        self._loop = _LoopThread()
        self._results: dict[int, Any] = {}  # our request id -> the library's result; touched on the loop only
        self._tasks: dict[int, asyncio.Task] = {}
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._stopped = threading.Event()
        self._latest_iteration: Optional[dict] = None

    # -- public API -----------------------------------------------------------------------------------------------

    def generate_async(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        streaming: bool = False,
        request_id: Optional[int] = None,
        on_output: Optional[Callable[[RequestHandle, object], None]] = None,
        lora_request=None,
    ) -> RequestHandle:
        """Submit a request; the library's own refusals (bad arguments) raise here, as the embedded engine's do."""
        if self._stopped.is_set():
            raise EngineError("the engine has been shut down")
        self._validate(prompt_token_ids, sampling_params)
        trtllm_lora = self._trtllm_lora_request(lora_request)
        if request_id is None:
            with self._ids_lock:
                request_id = next(self._ids)
        params = self._resolve_end_id(sampling_params)
        handle = TensorRTLLMRequestHandle(self, request_id, list(prompt_token_ids), params, streaming, on_output)
        handle.trtllm_lora = trtllm_lora
        self._loop.call(self._submit, handle)
        return handle

    def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> RequestOutput:
        return self.generate_async(prompt_token_ids, sampling_params).result()

    def abort(self, request_id: int) -> None:
        """Ask the library to cancel; the request then ends with finish_reason 'cancelled'. Unknown ids are
        ignored (the request may have just finished)."""
        if not self._stopped.is_set():
            self._loop.call_soon(self._abort_on_loop, request_id)

    def stats(self) -> EngineStats:
        self._poll_iteration_stats()
        return engine_stats_from_iteration(self._latest_iteration, self.config, self.num_in_flight)

    def wait_idle(self, timeout: float = 10.0) -> EngineStats:
        """Wait until every submitted request has delivered its final output; returns fresh stats."""
        if not self._loop.run_coroutine(self._wait_for_tasks(timeout)):
            raise TimeoutError(f"engine still busy after {timeout}s")
        return self.stats()

    def shutdown(self) -> None:
        """Abort what still runs, let it deliver its final output, then shut the LLM and the loop down."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._loop.call(self._abort_all_on_loop)
        self._loop.run_coroutine(self._wait_for_tasks(SHUTDOWN_DRAIN_TIMEOUT_S))
        try:
            self.llm.shutdown()
        finally:
            self._loop.stop()  # requests still running get an EngineError

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    # -- caller side ----------------------------------------------------------------------------------------------

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate(self.config.max_seq_len)
        require_guided_backend(params, self.config.guided_decoding_backend)
        if params.guided_prefix_len:
            raise InvalidRequestError(
                "guided_prefix_len (continuing a guided output) is an extension of the embedded engine; "
                "TensorRT-LLM has no such setting"
            )
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: at least one input token is required")
        max_seq_len = self.config.max_seq_len
        if max_seq_len is not None and len(prompt_token_ids) + params.max_tokens > max_seq_len:
            raise InvalidRequestError(
                f"prompt length {len(prompt_token_ids)} + max_tokens {params.max_tokens} "
                f"exceeds max_seq_len {max_seq_len}"
            )
        if params.priority not in (None, 0.5):  # the executor has Request.priority; the LLM API does not pass it
            raise InvalidRequestError(
                f"priority={params.priority}: TensorRT-LLM's LLM API has no request priority; "
                "only the embedded engine honours it (leave it out or send 0.5)"
            )
        if params.draft_tokens:  # ExternalDraftTokensConfig is the executor's; the LLM API does not take it
            raise InvalidRequestError(
                "draft_input_ids (external draft tokens): TensorRT-LLM's LLM API takes no "
                "per-request draft tokens; only the embedded engine verifies them"
            )

    def _trtllm_lora_request(self, lora_request) -> Any:
        """The library's LoRARequest: its LLM API takes an adapter by folder (name, id, path) only."""
        if lora_request is None:
            return None
        if lora_request.lora_weights is not None or not lora_request.lora_path:
            raise InvalidRequestError(
                "the TensorRT-LLM engine takes LoRA adapters by folder (LoRARequest with "
                "lora_path) only; lora_weights / lora_config and ids alone need the embedded "
                "engine"
            )
        task_id = lora_request.lora_int_id if lora_request.lora_int_id is not None else 0
        return self.trtllm.LoRARequest(lora_request.lora_name or str(task_id), task_id, lora_request.lora_path)

    def _resolve_end_id(self, params: SamplingParams) -> SamplingParams:
        # With end_id unset the library runs its tokenizer setup, which re-encodes `stop`/`bad` strings and would
        # overwrite our token-level words (see trtllm_sampling_params). So fill end_id first, as that setup would.
        if params.end_id is not None or not (params.stop_words or params.bad_words):
            return params
        eos = getattr(getattr(self.llm, "tokenizer", None), "eos_token_id", None)
        if eos is None:
            raise InvalidRequestError("stop_words/bad_words need end_id when the LLM has no tokenizer to supply it")
        return replace(params, end_id=eos)

    # -- loop side ------------------------------------------------------------------------------------------------

    def _submit(self, handle: TensorRTLLMRequestHandle) -> None:
        if handle.request_id in self._tasks:
            raise InvalidRequestError(f"request id {handle.request_id} is already running")
        handle.trtllm_params = trtllm_sampling_params(handle.params, self.trtllm)
        # Called with this loop running: only then is the library's result async-iterable.
        result = self.llm.generate_async(
            handle.prompt_token_ids,
            sampling_params=handle.trtllm_params,
            streaming=handle.streaming,
            lora_request=handle.trtllm_lora,
        )
        self._results[handle.request_id] = result
        self._tasks[handle.request_id] = self._loop.loop.create_task(self._drive(handle, result))

    async def _drive(self, handle: TensorRTLLMRequestHandle, result: Any) -> None:
        """Deliver the library's updates for one request until its final one."""
        try:
            async for update in result:
                handle._deliver_update(update)
                if update.finished:
                    return
        except asyncio.CancelledError:
            self._fail(handle, EngineError("the engine shut down before the request finished"))
            raise
        except Exception as exc:
            log.exception("TensorRT-LLM request %s failed", handle.request_id)
            self._fail(handle, EngineError(f"TensorRT-LLM request failed: {exc}"))
        finally:
            self._results.pop(handle.request_id, None)
            self._tasks.pop(handle.request_id, None)

    @staticmethod
    def _fail(handle: TensorRTLLMRequestHandle, error: Exception) -> None:
        try:
            handle._put(error)
        except Exception:  # a failing on_output callback must not take the loop down
            log.exception("could not report the failure of request %s", handle.request_id)

    def _abort_on_loop(self, request_id: int) -> None:
        result = self._results.get(request_id)
        if result is not None and not result.finished:
            result.abort()

    def _abort_all_on_loop(self) -> None:
        for request_id in list(self._results):
            self._abort_on_loop(request_id)

    async def _wait_for_tasks(self, timeout: float) -> bool:
        tasks = list(self._tasks.values())
        if not tasks:
            return True
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        return not pending

    def _poll_iteration_stats(self) -> None:
        try:
            records = self.llm.get_stats(timeout=STATS_POLL_TIMEOUT_S)
        except Exception:  # stats are best effort: an executor without them must not break the metrics thread
            log.debug("LLM.get_stats failed", exc_info=True)
            return
        if records:
            latest = records[-1]
            self._latest_iteration = json.loads(latest) if isinstance(latest, str) else latest
