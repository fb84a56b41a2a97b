"""`TensorRTLLMEngine`: the engine seam implemented by TensorRT-LLM's LLM API (`tensorrt_llm.LLM`).

Written against the LLM API as read in NVIDIA/TensorRT-LLM (llmapi/llm.py, llmapi/llm_args.py, sampling_params.py,
executor/result.py; commits named in tests/engine/fake_tensorrt_llm.py) and tested only against a recording
stand-in of that API: TensorRT-LLM cannot be installed on the machines this project is built on.

The adapter maps our `EngineConfig` to `LLM(...)` keyword arguments (`llm_kwargs`) and our `SamplingParams` to
`tensorrt_llm.SamplingParams` (`trtllm_sampling_params`), both pure functions. Requests run on ONE asyncio loop
thread owned by the adapter: the library's results are asyncio-based and only async-iterable when created while a
loop runs, so `LLM.generate_async` is called on that loop and one task per request turns each library update into
our `RequestOutput` (streaming deltas carry only the tokens not delivered before)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import itertools
import json
import logging
import threading
from dataclasses import replace
from typing import Any, Callable, Optional

from .config import ConfigError, EngineConfig
from .embedded.engine import EngineError, RequestHandle
from .embedded.engine_core import EngineStats
from .types import CompletionOutput, InvalidRequestError, RequestOutput, RequestPerfMetrics, SamplingParams

log = logging.getLogger("tritonllm.engine.trtllm")

NOT_INSTALLED_MESSAGE = "TensorRT-LLM is not installed; use engine: embedded"
# Strings that stand in for our token-level stop/bad words in `SamplingParams.stop` / `.bad` (see
# `trtllm_sampling_params`). They never reach a tokenizer: `detokenize=False`, and `end_id` is set whenever they are.
STOP_WORD_PREFIX = "\x00tritonllm-stop-word-"
BAD_WORD_PREFIX = "\x00tritonllm-bad-word-"
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


# -- EngineConfig -> LLM(...) -------------------------------------------------------------------------------------

def llm_kwargs(config: EngineConfig, trtllm: Any) -> dict[str, Any]:
    """`LLM(**kwargs)` for `config`, built with the library's own config classes.

    Not passed: `engine` and `device` (ours), and `normalize_log_probs`, which only the TensorRT-engine backend's
    arguments know: `tensorrt_llm.LLM` is the PyTorch backend and refuses keys it does not know."""
    if config.device == "cpu":
        raise ConfigError("device='cpu': TensorRT-LLM runs on CUDA GPUs only; use engine: embedded for CPU")
    kwargs: dict[str, Any] = {
        "model": config.model,
        "dtype": config.dtype,
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "max_batch_size": config.max_batch_size,
        "max_num_tokens": config.max_num_tokens,
        "max_beam_width": config.max_beam_width,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "kv_cache_config": trtllm_kv_cache_config(config, trtllm),
        "scheduler_config": trtllm_scheduler_config(config, trtllm),
    }
    kwargs.update(_optional_llm_kwargs(config))
    return _with_passthrough(kwargs, config.extra)


def trtllm_kv_cache_config(config: EngineConfig, trtllm: Any) -> Any:
    kv = config.kv_cache_config
    return trtllm.KvCacheConfig(enable_block_reuse=kv.enable_block_reuse, tokens_per_block=kv.tokens_per_block,
                                max_tokens=kv.max_tokens, free_gpu_memory_fraction=kv.free_gpu_memory_fraction)


def trtllm_scheduler_config(config: EngineConfig, trtllm: Any) -> Any:
    policy = trtllm.CapacitySchedulerPolicy[config.scheduler_config.capacity_scheduler_policy]
    return trtllm.SchedulerConfig(capacity_scheduler_policy=policy)


def _optional_llm_kwargs(config: EngineConfig) -> dict[str, Any]:
    """Settings passed only when set, so the library's own defaults apply otherwise."""
    optional = {"tokenizer": config.tokenizer, "max_seq_len": config.max_seq_len, "backend": config.backend,
                "lora_config": config.lora_config, "speculative_config": config.speculative_config}
    kwargs = {key: value for key, value in optional.items() if value is not None}
    if config.speculative_config is not None:
        _check_speculative_config(config.speculative_config)
    if config.enable_lora:
        kwargs["enable_lora"] = True
    return kwargs


# speculative_config keys only the embedded engine knows (TensorRT-LLM's decoding configs refuse unknown keys).
EMBEDDED_SPEC_KEYS = ("min_path_probability",)


def _check_speculative_config(spec: dict[str, Any]) -> None:
    """Refuse, naming the key, what only the embedded engine can do: our extension keys, and the drafters shipped
    in this package (`builtin:NAME`, saved with our checkpoint-format extensions)."""
    ours = [key for key in EMBEDDED_SPEC_KEYS if key in spec]
    if ours:
        raise ConfigError(f"speculative_config.{ours[0]} is an extension of the embedded engine; TensorRT-LLM has "
                          "no such setting (remove it, or use engine: embedded)")
    folder = str(spec.get("speculative_model_dir") or "")
    if folder.startswith("builtin:"):
        raise ConfigError(f"speculative_config.speculative_model_dir={folder}: the drafters shipped with tritonllm "
                          "use its own checkpoint-format extensions, which TensorRT-LLM cannot load (use engine: "
                          "embedded, or a Medusa / EAGLE checkpoint in the standard format)")


def _with_passthrough(kwargs: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    # `extra` holds keys EngineConfig does not know; they go to LLM() unchanged and the library judges them.
    clashes = sorted(set(extra) & set(kwargs))
    if clashes:
        raise ConfigError(f"engine argument(s) {clashes} given twice (as typed settings and as extra keys)")
    return {**kwargs, **extra}


# -- SamplingParams -> tensorrt_llm.SamplingParams ----------------------------------------------------------------

def trtllm_sampling_params(params: SamplingParams, trtllm: Any) -> Any:
    """The library's `SamplingParams` for ours.

    Multi-token stop/bad words have no public token-level field (`stop`/`bad` take strings the LLM tokenizes), so
    they go into the private `_stop_word_ids`/`_bad_word_ids` lists, which the library reads only while `stop`/`bad`
    is set: hence one placeholder string per word. `end_id` must be set by then (see
    `TensorRTLLMEngine._resolve_end_id`), or the library's setup would re-encode the placeholders over our ids.
    Stop tokens stay in the output (`include_stop_str_in_output`), as the embedded engine keeps them."""
    sampling = trtllm.SamplingParams(
        end_id=params.end_id, pad_id=params.pad_id, max_tokens=params.max_tokens, n=params.n,
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
        min_tokens=params.min_tokens, repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        length_penalty=params.length_penalty, early_stopping=params.early_stopping,
        stop_token_ids=list(params.stop_token_ids) if params.stop_token_ids else None,
        embedding_bias=_embedding_bias_tensor(params.embedding_bias),
        # Top-1 logprobs: the library returns the sampled token's logprob among them.
        logprobs=1 if params.logprobs else None,
        ignore_eos=params.ignore_eos, return_perf_metrics=params.return_perf_metrics,
        # Triton's pre/postprocessing models own the text; the engine works on token ids only.
        detokenize=False, include_stop_str_in_output=True,
        lookahead_config=_lookahead_config(params.lookahead_config, trtllm),
        **_beam_search_kwargs(params.beam_width), **_word_placeholders(params))
    if params.stop_words:
        sampling._stop_word_ids = [list(word) for word in params.stop_words]
    if params.bad_words:
        sampling._bad_word_ids = [list(word) for word in params.bad_words]
    return sampling


def _lookahead_config(config, trtllm: Any):
    """Our per-request (W, N, G) as the executor binding the library's SamplingParams.lookahead_config takes."""
    if config is None:
        return None
    binding = trtllm.bindings.executor.LookaheadDecodingConfig
    return binding(config.max_window_size, config.max_ngram_size, config.max_verification_set_size)


def _embedding_bias_tensor(bias: Optional[list[float]]):
    if bias is None:
        return None
    import torch

    return torch.tensor(bias, dtype=torch.float32)  # the library expects a float32 [vocab_size] tensor


def _beam_search_kwargs(beam_width: int) -> dict[str, Any]:
    # The LLM API spells beam search as use_beam_search + best_of (the beam width); n beams are returned.
    return {"use_beam_search": True, "best_of": beam_width} if beam_width > 1 else {}


def _word_placeholders(params: SamplingParams) -> dict[str, list[str]]:
    placeholders = {}
    if params.stop_words:
        placeholders["stop"] = [f"{STOP_WORD_PREFIX}{i}" for i in range(len(params.stop_words))]
    if params.bad_words:
        placeholders["bad"] = [f"{BAD_WORD_PREFIX}{i}" for i in range(len(params.bad_words))]
    return placeholders


# -- library outputs -> ours --------------------------------------------------------------------------------------

def completion_from_trtllm(output: Any, diff_start: int, stop_words: Optional[list[list[int]]],
                           end_id: Optional[int]) -> CompletionOutput:
    """Our `CompletionOutput` for one of the library's, copied (the library mutates its objects in place)."""
    token_ids = list(output.token_ids or [])
    logprobs = sampled_logprobs(output.logprobs, token_ids)
    cumulative = output.cumulative_logprob if output.cumulative_logprob is not None else sum(logprobs)
    return CompletionOutput(
        index=output.index, token_ids=token_ids, logprobs=logprobs, cumulative_logprob=float(cumulative),
        finish_reason=output.finish_reason,
        stop_reason=stop_reason_from_trtllm(output.stop_reason, output.finish_reason, stop_words, end_id),
        request_perf_metrics=perf_metrics_from_trtllm(getattr(output, "request_perf_metrics", None)),
        _diff_start=min(diff_start, len(token_ids)))


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """One float per token. Depending on backend the library gives floats or, per position, a dict
    {token_id: Logprob} of the top tokens plus the sampled one."""
    values = []
    for position, entry in enumerate(logprobs or []):
        if isinstance(entry, dict):
            token = token_ids[position] if position < len(token_ids) else None
            entry = entry.get(token, float("nan"))
        values.append(float(getattr(entry, "logprob", entry)))
    return values


def stop_reason_from_trtllm(reason: Any, finish_reason: Optional[str], stop_words: Optional[list[list[int]]],
                            end_id: Optional[int]):
    """Our stop_reason: the word's token ids for a stop word, the end id when the end token stopped it."""
    if isinstance(reason, str) and reason.startswith(STOP_WORD_PREFIX) and stop_words:
        return list(stop_words[int(reason[len(STOP_WORD_PREFIX):])])
    if reason is None and finish_reason == "stop":
        return end_id  # the library leaves stop_reason empty when the end token finished the sequence
    return reason


def perf_metrics_from_trtllm(metrics: Any) -> RequestPerfMetrics:
    """The library's per-request metrics (timings as steady-clock timedeltas) in our fields (ns). Preemptions and
    prefill steps are not reported by the library: they stay 0."""
    if metrics is None:
        return RequestPerfMetrics()
    timing = getattr(metrics, "timing_metrics", None)
    kv = getattr(metrics, "kv_cache_metrics", None)
    spec = getattr(metrics, "speculative_decoding", None)
    return RequestPerfMetrics(
        arrival_time_ns=_timedelta_ns(getattr(timing, "arrival_time", None)),
        first_scheduled_time_ns=_timedelta_ns(getattr(timing, "first_scheduled_time", None)),
        first_token_time_ns=_timedelta_ns(getattr(timing, "first_token_time", None)),
        last_token_time_ns=_timedelta_ns(getattr(timing, "last_token_time", None)),
        kv_cache_alloc_new_blocks=int(getattr(kv, "num_new_allocated_blocks", 0) or 0),
        kv_cache_reused_blocks=int(getattr(kv, "num_reused_blocks", 0) or 0),
        kv_cache_alloc_total_blocks=int(getattr(kv, "num_total_allocated_blocks", 0) or 0),
        total_draft_tokens=int(getattr(spec, "total_draft_tokens", 0) or 0),
        total_accepted_draft_tokens=int(getattr(spec, "total_accepted_draft_tokens", 0) or 0))


def _timedelta_ns(value: Optional[datetime.timedelta]) -> int:
    if value is None:
        return 0
    # Integer arithmetic: total_seconds() would round at microsecond resolution for large steady-clock values.
    return (value.days * 86_400 + value.seconds) * 1_000_000_000 + value.microseconds * 1_000


def engine_stats_from_iteration(latest: Optional[dict], config: EngineConfig, in_flight: int) -> EngineStats:
    """EngineStats from the newest iteration-stats record of `LLM.get_stats` (None when there is none: the
    PyTorch backend records them only with `enable_iter_perf_stats: true`). Without a record the KV numbers are 0
    and every in-flight request counts as running. Records come only from iterations, so when idle the KV numbers
    are those of the last iteration that ran."""
    latest = latest or {}
    kv = latest.get("kvCacheStats", {})
    running = latest.get("numActiveRequests", in_flight) if in_flight else 0
    waiting = latest.get("numQueuedRequests", 0) if in_flight else 0
    return EngineStats(
        num_total_blocks=int(kv.get("maxNumBlocks", 0)), num_free_blocks=int(kv.get("freeNumBlocks", 0)),
        tokens_per_block=int(kv.get("tokensPerBlock", config.kv_cache_config.tokens_per_block)),
        num_running=int(running), num_waiting=int(waiting), num_steps=int(latest.get("iter", 0)),
        max_seq_len=config.max_seq_len or 0, max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens)


# -- the request handle -------------------------------------------------------------------------------------------

class TensorRTLLMRequestHandle(RequestHandle):
    """The embedded engine's handle (iterable, async-iterable, result(), abort()), fed with library updates
    converted to our `RequestOutput`. It remembers, per sequence, how many tokens it delivered, so a streaming
    update's `token_ids_diff` holds only new tokens whatever the library's own diff bookkeeping does."""

    def __init__(self, engine: "TensorRTLLMEngine", request_id: int, prompt_token_ids: list[int],
                 params: SamplingParams, streaming: bool, on_output: Optional[Callable] = None):
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
            completion = completion_from_trtllm(output, self._delivered.get(output.index, 0), self.params.stop_words,
                                                end_id)
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

    def generate_async(self, prompt_token_ids: list[int], sampling_params: SamplingParams, streaming: bool = False,
                       request_id: Optional[int] = None,
                       on_output: Optional[Callable[[RequestHandle, object], None]] = None,
                       lora_request=None) -> RequestHandle:
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
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: at least one input token is required")
        max_seq_len = self.config.max_seq_len
        if max_seq_len is not None and len(prompt_token_ids) + params.max_tokens > max_seq_len:
            raise InvalidRequestError(f"prompt length {len(prompt_token_ids)} + max_tokens {params.max_tokens} "
                                      f"exceeds max_seq_len {max_seq_len}")
        if params.priority not in (None, 0.5):  # the executor has Request.priority; the LLM API does not pass it
            raise InvalidRequestError(f"priority={params.priority}: TensorRT-LLM's LLM API has no request priority; "
                                      "only the embedded engine honours it (leave it out or send 0.5)")
        if params.draft_tokens:  # ExternalDraftTokensConfig is the executor's; the LLM API does not take it
            raise InvalidRequestError("draft_input_ids (external draft tokens): TensorRT-LLM's LLM API takes no "
                                      "per-request draft tokens; only the embedded engine verifies them")

    def _trtllm_lora_request(self, lora_request) -> Any:
        """The library's LoRARequest: its LLM API takes an adapter by folder (name, id, path) only."""
        if lora_request is None:
            return None
        if lora_request.lora_weights is not None or not lora_request.lora_path:
            raise InvalidRequestError("the TensorRT-LLM engine takes LoRA adapters by folder (LoRARequest with "
                                      "lora_path) only; lora_weights / lora_config and ids alone need the embedded "
                                      "engine")
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
        result = self.llm.generate_async(handle.prompt_token_ids, sampling_params=handle.trtllm_params,
                                         streaming=handle.streaming, lora_request=handle.trtllm_lora)
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
