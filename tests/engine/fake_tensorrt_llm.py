"""A recording stand-in for `tensorrt_llm`: the part of the LLM API the TensorRT-LLM adapter touches.

TensorRT-LLM cannot be installed here, so the adapter is tested against this module, installed as
`sys.modules["tensorrt_llm"]`. Constructor signatures are written out as read in NVIDIA/TensorRT-LLM:

  LLM.__init__ / generate_async / get_stats / get_kv_cache_events / shutdown:
      tensorrt_llm/llmapi/llm.py @ 4c05a74891e4df8066f08ed4ce14b0972abe4e25 (`LLM` = `_TorchLLM`, the PyTorch
      backend; its keyword arguments are checked against the LLM argument model's field names)
  bindings.executor.LookaheadDecodingConfig:
      cpp/include/tensorrt_llm/executor/executor.h (constructor: windowSize, ngramSize, verificationSetSize)
  SamplingParams, GuidedDecodingParams:
      tensorrt_llm/sampling_params.py @ b35ac1b64368513d215c57d2ed01d62d910df8da (version.py there: 1.2.0rc2)
  KvCacheConfig, SchedulerConfig, CapacitySchedulerPolicy, LLM argument names (BaseLlmArgs + TorchLlmArgs):
      tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412
  CompletionOutput / GenerationResult fields and behaviour:
      tensorrt_llm/executor/result.py @ a678b91aafbeff265cd0b764abb59d7def624ac2

Like the real classes it refuses unknown keyword arguments, so a misspelt name fails a test. Behaviour is
reduced to what the adapter depends on and written here from that reading, not copied:
  * `LLM.generate_async` fills `end_id` from its tokenizer when unset, re-encoding `stop`/`bad` strings then;
  * a result is async-iterable only if an asyncio loop was running when it was created;
  * results play a script of `Update`s (cumulative token ids per sequence); `abort()` ends the request with
    finish_reason 'cancelled'.
"""

from __future__ import annotations

import asyncio
import datetime
import enum
import functools
import itertools
import os
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional, Union

import torch


def _recording(init):
    """Keep the keyword arguments a constructor was called with in `self.called_with`; the wrapped signature
    (explicit parameters, no **kwargs) still rejects unknown names."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.called_with = dict(kwargs)

    return wrapper


# -- llm_args.py ------------------------------------------------------------------------------------------------


class CapacitySchedulerPolicy(str, enum.Enum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class SchedulerConfig:
    @_recording
    def __init__(
        self,
        *,
        capacity_scheduler_policy: CapacitySchedulerPolicy = CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
        context_chunking_policy: Optional[str] = None,
        dynamic_batch_config: Any = None,
        waiting_queue_policy: str = "fcfs",
        use_python_scheduler: bool = False,
        enable_prefix_aware_scheduling: bool = True,
    ):
        self.capacity_scheduler_policy = CapacitySchedulerPolicy(capacity_scheduler_policy)
        self.context_chunking_policy = context_chunking_policy
        self.dynamic_batch_config = dynamic_batch_config
        self.waiting_queue_policy = waiting_queue_policy
        self.use_python_scheduler = use_python_scheduler
        self.enable_prefix_aware_scheduling = enable_prefix_aware_scheduling


class KvCacheConfig:
    # Defaults as declared; `None` stands for the nested configs the library builds with a default_factory.
    @_recording
    def __init__(
        self,
        *,
        enable_block_reuse: bool = True,
        max_tokens: Optional[int] = None,
        max_attention_window: Optional[List[int]] = None,
        sink_token_length: Optional[int] = None,
        free_gpu_memory_fraction: Optional[float] = 0.9,
        host_cache_size: Optional[int] = None,
        disk_cache_size: Optional[int] = None,
        disk_cache_path: Optional[str] = None,
        cross_kv_cache_fraction: Optional[float] = None,
        secondary_offload_min_priority: Optional[int] = None,
        event_buffer_max_size: int = 0,
        attention_dp_events_gather_period_ms: int = 5,
        kv_events_config: Any = None,
        enable_partial_reuse: bool = True,
        copy_on_partial_reuse: bool = True,
        use_uvm: bool = False,
        max_gpu_total_bytes: int = 0,
        iteration_stats_interval: int = 1,
        dtype: str = "auto",
        mamba_ssm_cache_dtype: str = "auto",
        mamba_ssm_stochastic_rounding: bool = False,
        mamba_ssm_philox_rounds: int = 10,
        tokens_per_block: int = 32,
        mamba_state_cache_interval: Optional[int] = None,
        mamba_state_config: Any = None,
        use_kv_cache_manager_v2: Union[bool, str] = "auto",
        enable_swa_scratch_reuse: bool = False,
        kv_cache_event_hash_algo: str = "auto",
        max_util_for_resume: float = 0.95,
        enable_kv_pool_rebalance: bool = False,
        kv_pool_rebalance_min_sampled_kv_caches: int = 2000,
        kv_pool_rebalance_cooldown_secs: float = 120.0,
        kv_pool_rebalance_target_ratio_update_interval: int = 100,
        kv_pool_rebalance_ratio_threshold: float = 1.25,
        kv_pool_rebalance_moving_average_decay: float = 0.9999,
        kv_pool_rebalance_check_interval: int = 10,
        disk_prefetch_num_reqs: int = 0,
        fp8_context_mla_kv_len_cap: Optional[int] = None,
        pool_ratio: Optional[List[float]] = None,
        avg_seq_len: Optional[int] = None,
        block_reuse_config: Any = None,
    ):
        if free_gpu_memory_fraction is not None and not 0 <= free_gpu_memory_fraction <= 1:
            raise ValueError("kv_cache_config.free_gpu_memory_fraction must be a float between 0 and 1")
        self.enable_block_reuse = enable_block_reuse
        self.max_tokens = max_tokens
        self.free_gpu_memory_fraction = free_gpu_memory_fraction
        self.tokens_per_block = tokens_per_block


# The field names of BaseLlmArgs and TorchLlmArgs: `LLM(**kwargs)` refuses any other key.
LLM_ARGUMENT_NAMES = frozenset(
    """
    model tokenizer tokenizer_mode custom_tokenizer post_processor_hook skip_tokenizer_init trust_remote_code
    tensor_parallel_size dtype revision tokenizer_revision model_kwargs pipeline_parallel_size context_parallel_size
    gpus_per_node moe_cluster_parallel_size moe_tensor_parallel_size moe_expert_parallel_size enable_attention_dp
    enable_lm_head_tp_in_adp pp_partition cp_config load_format enable_lora lora_config kv_cache_config
    enable_chunked_prefill guided_decoding_backend batched_logits_processor iter_stats_max_iterations
    request_stats_max_iterations peft_cache_config scheduler_config cache_transceiver_config sparse_attention_config
    kv_cache_compression_config speculative_config max_batch_size max_input_len max_seq_len max_beam_width
    max_num_tokens gather_generation_logits num_postprocess_workers postprocess_tokenizer_dir num_serve_frontends
    reasoning_parser decoding_config mpi_session otlp_traces_endpoint backend return_perf_metrics
    perf_metrics_output_dir perf_metrics_max_requests prometheus_metrics_config enable_energy_metrics
    orchestrator_type env_overrides telemetry_config
    generation_config garbage_collection_gen0_threshold cuda_graph_config encoder_cuda_graph_config
    enable_encoder_decoder_mixed_cuda_graph multimodal_config attention_dp_config disable_overlap_scheduler
    moe_config nvfp4_gemm_config dwdp_config encoder_max_batch_size encoder_max_num_tokens attn_backend
    enable_mla_skip_correction mla_skip_correction_threshold sampler_force_async_worker enable_in_graph_sampling
    enable_speculative_beam_history_d2h enable_early_first_token_response enable_low_latency_host_dispatch
    enable_iter_perf_stats enable_iter_req_stats print_iter_log batch_wait_timeout_ms batch_wait_timeout_iters
    batch_wait_max_tokens_ratio torch_compile_config prefill_cuda_graph_backend prefill_capture_num_tokens
    enable_autotuner use_fine_grained_sync enable_layerwise_nvtx_marker enable_min_latency stream_interval
    force_dynamic_quantization allreduce_strategy checkpoint_loader checkpoint_format checkpoint_io_policy mx_config
    gms_config kv_connector_config mm_encoder_only disable_mm_encoder encode_only ray_worker_extension_cls
    ray_placement_config ray_worker_nsight_options sleep_config reorder_policy_config enable_resource_governor
    use_cute_dsl_blockscaling_mm use_cute_dsl_blockscaling_bmm use_cute_dsl_bf16_bmm use_cute_dsl_bf16_gemm
    max_stats_len layer_wise_benchmarks_config
""".split()
)


# -- sampling_params.py -----------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: Any = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[str] = None

    def __post_init__(self):
        if sum(bool(getattr(self, name)) for name in ("json", "regex", "grammar", "json_object", "structural_tag")) > 1:
            raise ValueError("Only one guide can be used for a request")


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    instances: ClassVar[list] = []

    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    bad: Optional[Union[str, List[str]]] = None
    bad_token_ids: Optional[List[int]] = None
    _bad_word_ids: Optional[List[List[int]]] = field(default=None, init=False, repr=False)
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    _stop_word_ids: Optional[List[List[int]]] = field(default=None, init=False, repr=False)

    embedding_bias: Optional[torch.Tensor] = None
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False

    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False

    top_k: Optional[int] = None
    top_p: Optional[float] = None
    top_p_min: Optional[float] = None
    top_p_reset_ids: Optional[int] = None
    top_p_decay: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    beam_search_diversity_rate: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    prompt_ignore_length: Optional[int] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[int] = None
    no_repeat_ngram_size: Optional[int] = None
    min_p: Optional[float] = None
    beam_width_array: Optional[List[int]] = None

    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: Optional[List[str]] = None

    _context_logits_auto_enabled: bool = False
    _generation_logits_auto_enabled: bool = False
    _return_log_probs: bool = False

    lookahead_config: Any = None
    guided_decoding: Any = None

    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    _stream_interval: Optional[int] = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.pad_id is None:
            self.pad_id = self.end_id
        if self.best_of is None:
            self.best_of = self.n
        if self.embedding_bias is not None and not isinstance(self.embedding_bias, torch.Tensor):
            self.embedding_bias = torch.tensor(self.embedding_bias, dtype=torch.float32)
        self._check()
        SamplingParams.instances.append(self)

    def _check(self) -> None:
        """The LLM API's own refusals that a request from us could meet."""
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p out of [0, 1]: {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k < 0: {self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature < 0: {self.temperature}")
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) < n ({self.n})")
        # Several returns from greedy decoding are refused unless an environment variable allows them.
        if self.best_of > 1 and self._is_greedy() and not os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING"):
            raise ValueError(f"greedy decoding does not allow best_of={self.best_of} > 1")
        if self.logprobs:
            self.logprobs = int(self.logprobs)

    def _is_greedy(self) -> bool:
        if self.use_beam_search:
            return False
        unset = self.temperature is None and self.top_p is None and self.top_k is None
        return unset or self.top_k == 1 or self.top_p == 0.0 or self.temperature == 0

    def _setup(self, tokenizer, hf_model_config, generation_config, add_special_tokens: bool = False):
        if self.end_id is None:
            self.end_id = tokenizer.eos_token_id
            self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_id
        if self.bad is not None:
            self._bad_word_ids = [tokenizer.encode(text) for text in _as_list(self.bad)]
        if self.stop is not None:
            self._stop_word_ids = [tokenizer.encode(text) for text in _as_list(self.stop)]
        return self

    def _get_bad_words(self) -> List[List[int]]:
        words = [[token] for token in self.bad_token_ids or []]
        if self.bad is None:
            return words
        if self._bad_word_ids is None:
            raise RuntimeError("SamplingParams.bad is not processed by the tokenizer")
        return words + self._bad_word_ids

    def _get_stop_words(self) -> List[List[int]]:
        words = [[token] for token in self.stop_token_ids or []]
        if self.stop is None:
            return words
        if self._stop_word_ids is None:
            raise RuntimeError("SamplingParams.stop is not processed by the tokenizer")
        return words + self._stop_word_ids

    def _get_stop_reasons_and_words(self):
        reasons = list(self.stop_token_ids or []) + (_as_list(self.stop) if self.stop is not None else [])
        return list(zip(reasons, self._get_stop_words()))


@dataclass(frozen=True)
class _LookaheadDecodingConfig:
    """bindings.executor.LookaheadDecodingConfig(windowSize, ngramSize, verificationSetSize) (executor.h)."""

    window_size: int
    ngram_size: int
    verification_set_size: int


class bindings:  # noqa: N801 - the library's module path tensorrt_llm.bindings.executor
    class executor:  # noqa: N801
        LookaheadDecodingConfig = _LookaheadDecodingConfig


def _as_list(text: Union[str, List[str]]) -> List[str]:
    return [text] if isinstance(text, str) else list(text)


# -- executor/result.py -----------------------------------------------------------------------------------------


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None


@dataclass
class TimingMetrics:
    arrival_time: datetime.timedelta = datetime.timedelta(0)
    first_scheduled_time: datetime.timedelta = datetime.timedelta(0)
    first_token_time: datetime.timedelta = datetime.timedelta(0)
    last_token_time: datetime.timedelta = datetime.timedelta(0)


@dataclass
class KvCacheMetrics:
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class SpeculativeDecodingMetrics:
    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0


@dataclass
class RequestPerfMetrics:
    """bindings.executor.RequestPerfMetrics: timings are steady-clock timedeltas."""

    timing_metrics: TimingMetrics = field(default_factory=TimingMetrics)
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)
    speculative_decoding: SpeculativeDecodingMetrics = field(default_factory=SpeculativeDecodingMetrics)
    first_iter: Optional[int] = None
    last_iter: Optional[int] = None
    iter: Optional[int] = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: Optional[List[int]] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Any = field(default_factory=list)
    prompt_logprobs: Any = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    generation_logits: Any = None
    additional_context_outputs: Any = None
    additional_generation_outputs: Any = None
    disaggregated_params: Any = None
    request_perf_metrics: Any = None
    _last_token_ids_len: int = field(default=0, init=False, repr=False)

    @property
    def token_ids_diff(self) -> List[int]:
        return self.token_ids[self._last_token_ids_len :]


@dataclass
class Update:
    """One executor response in a script: sequence `index` now holds `token_ids` (cumulative, as are
    `logprobs`); a set `finish_reason` ends that sequence."""

    token_ids: List[int]
    index: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None
    request_perf_metrics: Optional[RequestPerfMetrics] = None


WAIT_FOR_ABORT = "wait-for-abort"  # a script step: no response until the request is aborted


def default_script(n: int) -> list:
    steps = [Update([10 + i], index=i) for i in range(n)]
    return steps + [Update([10 + i, 20 + i], index=i, finish_reason="length") for i in range(n)]


class GenerationResult:
    """What `LLM.generate_async` returns (the real one is `llmapi.llm.RequestOutput`, a GenerationResult)."""

    def __init__(
        self,
        llm: "LLM",
        request_id: int,
        prompt_token_ids: List[int],
        sampling_params: SamplingParams,
        streaming: bool,
        script: list,
    ):
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None  # as in the library: without a running loop there is no async queue
        self._llm = llm
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self._streaming = streaming
        self._script = deque(script)
        self._outputs = [CompletionOutput(i) for i in range(sampling_params.best_of)]
        self._done = False
        self._aborted = asyncio.Event() if self._loop else None

    @property
    def outputs(self) -> List[CompletionOutput]:
        return self._outputs[: self.sampling_params.n]

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._llm.aborted.append(self.request_id)
        self._llm.abort_threads.append(threading.current_thread().name)
        if self._aborted is not None:
            self._aborted.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        await self._next_response()
        return self

    async def aresult(self):
        while not self._done:
            await self._next_response()
        return self

    async def _next_response(self) -> None:
        if self._loop is None:
            raise AssertionError(
                "The asyncio event loop was not present during initialization, so async operations are not available."
            )
        # Without streaming the executor sends only the final response.
        while True:
            await self._play_step()
            if self._done or self._streaming:
                return

    async def _play_step(self) -> None:
        await asyncio.sleep(0)  # responses arrive from another thread, never synchronously
        if self._aborted.is_set() or not self._script:
            self._cancel()
            return
        step = self._script.popleft()
        if step == WAIT_FOR_ABORT:
            await self._aborted.wait()
            self._cancel()
            return
        self._apply(step)

    def _apply(self, step: Update) -> None:
        output = self._outputs[step.index]
        output._last_token_ids_len = len(output.token_ids)
        output.token_ids = list(step.token_ids)
        if step.logprobs is not None:
            output.logprobs = list(step.logprobs)
        if step.cumulative_logprob is not None:
            output.cumulative_logprob = step.cumulative_logprob
        if step.request_perf_metrics is not None:
            output.request_perf_metrics = step.request_perf_metrics
        output.finish_reason = step.finish_reason
        output.stop_reason = step.stop_reason
        self._done = all(o.finish_reason is not None for o in self.outputs)

    def _cancel(self) -> None:
        for output in self._outputs:
            if output.finish_reason is None:
                output.finish_reason = "cancelled"
        self._done = True


# -- llmapi/llm.py ----------------------------------------------------------------------------------------------


class FakeTokenizer:
    eos_token_id = 2
    pad_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return [ord(ch) for ch in text]


@dataclass
class LoRARequest:
    """tensorrt_llm.executor.request.LoRARequest: an adapter folder under a name and an id."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class LLM:
    instances: ClassVar[list] = []

    @_recording
    def __init__(
        self,
        model,
        tokenizer=None,
        tokenizer_mode="auto",
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        revision: Optional[str] = None,
        tokenizer_revision: Optional[str] = None,
        **kwargs: Any,
    ):
        for key in kwargs:
            if key not in LLM_ARGUMENT_NAMES | {"_mpi_session", "backend"}:
                raise ValueError(f"LLM got invalid argument: {key}")
        self.model = model
        self.tokenizer = None if skip_tokenizer_init else FakeTokenizer()
        self.scripts: deque = deque()  # tests push scripts; each generate_async takes the next one
        self.generate_calls: list[dict] = []
        self.aborted: list[int] = []
        self.abort_threads: list[str] = []
        self.stats_records: list = []  # iteration stats that the next get_stats returns
        self.get_stats_timeouts: list = []
        self.shutdown_calls = 0
        self._ids = itertools.count(1000)
        LLM.instances.append(self)

    def generate_async(
        self,
        inputs,
        sampling_params: Optional[SamplingParams] = None,
        lora_request=None,
        prompt_adapter_request=None,
        streaming: bool = False,
        kv_cache_retention_config=None,
        disaggregated_params=None,
        _postproc_params=None,
        scheduling_params=None,
        cache_salt: Optional[str] = None,
    ) -> GenerationResult:
        if self.shutdown_calls:
            raise RuntimeError("LLM is shutting down")
        params = self._prepare_sampling_params(sampling_params)
        prompt = _prompt_token_ids(inputs)
        try:
            loop_running = asyncio.get_running_loop() is not None
        except RuntimeError:
            loop_running = False
        self.generate_calls.append(
            {
                "inputs": inputs,
                "sampling_params": params,
                "streaming": streaming,
                "lora_request": lora_request,
                "thread": threading.current_thread().name,
                "loop_running": loop_running,
            }
        )
        script = self.scripts.popleft() if self.scripts else default_script(params.n)
        return GenerationResult(self, next(self._ids), prompt, params, streaming, script)

    def _prepare_sampling_params(self, params: Optional[SamplingParams]) -> SamplingParams:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"The sampling_params must be type SamplingParams or None, got {type(params)}")
        if params.end_id is None:
            if self.tokenizer is None:
                raise ValueError("tokenizer is required to reset end_id if it is None")
            params._setup(self.tokenizer, None, None)
        return params

    def get_stats(self, timeout: Optional[float] = 2) -> List[dict]:
        self.get_stats_timeouts.append(timeout)
        records, self.stats_records = self.stats_records, []
        return records

    def get_kv_cache_events(self, timeout: Optional[float] = 2) -> List[dict]:
        return []

    def shutdown(self) -> None:
        self.shutdown_calls += 1


def _prompt_token_ids(inputs) -> List[int]:
    if isinstance(inputs, list) and all(isinstance(t, int) for t in inputs):
        return list(inputs)
    if isinstance(inputs, dict) and "prompt_token_ids" in inputs:
        return list(inputs["prompt_token_ids"])
    raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
