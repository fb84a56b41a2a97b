"""What the TensorRT-LLM adapter hands the library: `LLM(...)` keyword arguments for our `EngineConfig`
(`llm_kwargs`) and `tensorrt_llm.SamplingParams` for ours (`trtllm_sampling_params`). Pure functions, built with the
library's own config classes (`trtllm` is the imported module, or the tests' recording stand-in)."""

from __future__ import annotations

from typing import Any, Optional

from .config import ConfigError, EngineConfig
from .types import SamplingParams

# Strings that stand in for our token-level stop/bad words in `SamplingParams.stop` / `.bad` (see
# `trtllm_sampling_params`). They never reach a tokenizer: `detokenize=False`, and `end_id` is set whenever they are.
STOP_WORD_PREFIX = "\x00tritonllm-stop-word-"
BAD_WORD_PREFIX = "\x00tritonllm-bad-word-"


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
    # Passed only when set, so a TensorRT-LLM without these keys still takes the defaults.
    optional: dict[str, Any] = {}
    if kv.max_attention_window is not None:
        optional["max_attention_window"] = list(kv.max_attention_window)
    if kv.dtype != "auto":
        optional["dtype"] = kv.dtype
    return trtllm.KvCacheConfig(
        enable_block_reuse=kv.enable_block_reuse,
        tokens_per_block=kv.tokens_per_block,
        max_tokens=kv.max_tokens,
        free_gpu_memory_fraction=kv.free_gpu_memory_fraction,
        **optional,
    )


def trtllm_scheduler_config(config: EngineConfig, trtllm: Any) -> Any:
    policy = trtllm.CapacitySchedulerPolicy[config.scheduler_config.capacity_scheduler_policy]
    return trtllm.SchedulerConfig(capacity_scheduler_policy=policy)


def _optional_llm_kwargs(config: EngineConfig) -> dict[str, Any]:
    """Settings passed only when set, so the library's own defaults apply otherwise."""
    optional = {
        "tokenizer": config.tokenizer,
        "max_seq_len": config.max_seq_len,
        "backend": config.backend,
        "lora_config": config.lora_config,
        "speculative_config": config.speculative_config,
        "guided_decoding_backend": config.guided_decoding_backend,
        "moe_expert_parallel_size": config.moe_expert_parallel_size,
        "moe_tensor_parallel_size": config.moe_tensor_parallel_size,
        "quant_config": config.quant_config,
    }
    kwargs: dict[str, Any] = {key: value for key, value in optional.items() if value is not None}
    if config.speculative_config is not None:
        _check_speculative_config(config.speculative_config)
    if config.enable_lora:
        kwargs["enable_lora"] = True
    # Our defaults are TensorRT-LLM's: passed only when changed. Its validator reads load_format by name.
    if config.attn_backend == "TRITON":
        raise ConfigError(
            "attn_backend='TRITON' names the embedded engine's kernels; TensorRT-LLM takes TRTLLM, "
            "FLASHINFER or VANILLA (or use engine: embedded)"
        )
    if config.attn_backend != "TRTLLM":
        kwargs["attn_backend"] = config.attn_backend
    if config.disable_overlap_scheduler:
        kwargs["disable_overlap_scheduler"] = True
    if config.load_format != "auto":
        kwargs["load_format"] = config.load_format
    if config.cuda_graph_config != {}:  # set: as given (None turns graphs off there too); unset: the library's
        kwargs["cuda_graph_config"] = config.cuda_graph_config
    return kwargs


# speculative_config keys only the embedded engine knows (TensorRT-LLM's decoding configs refuse unknown keys).
EMBEDDED_SPEC_KEYS = ("min_path_probability",)


def _check_speculative_config(spec: dict[str, Any]) -> None:
    """Refuse, naming the key, what only the embedded engine can do: our extension keys, and the drafters shipped
    in this package (`builtin:NAME`, saved with our checkpoint-format extensions)."""
    from tritonllm.spec_decode.checkpoint_files import BUILTIN_PREFIX

    ours = [key for key in EMBEDDED_SPEC_KEYS if key in spec]
    if ours:
        raise ConfigError(
            f"speculative_config.{ours[0]} is an extension of the embedded engine; TensorRT-LLM has "
            "no such setting (remove it, or use engine: embedded)"
        )
    folder = str(spec.get("speculative_model_dir") or "")
    if folder.startswith(BUILTIN_PREFIX):
        raise ConfigError(
            f"speculative_config.speculative_model_dir={folder}: the drafters shipped with tritonllm "
            "use its own checkpoint-format extensions, which TensorRT-LLM cannot load (use engine: "
            "embedded, or a Medusa / EAGLE checkpoint in the standard format)"
        )


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
        end_id=params.end_id,
        pad_id=params.pad_id,
        max_tokens=params.max_tokens,
        n=params.n,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        min_tokens=params.min_tokens,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        length_penalty=params.length_penalty,
        early_stopping=params.early_stopping,
        stop_token_ids=list(params.stop_token_ids) if params.stop_token_ids else None,
        embedding_bias=_embedding_bias_tensor(params.embedding_bias),
        # Top-1 logprobs: the library returns the sampled token's logprob among them.
        logprobs=1 if params.logprobs else None,
        ignore_eos=params.ignore_eos,
        return_perf_metrics=params.return_perf_metrics,
        # Triton's pre/postprocessing models own the text; the engine works on token ids only.
        detokenize=False,
        include_stop_str_in_output=True,
        lookahead_config=_lookahead_config(params.lookahead_config, trtllm),
        guided_decoding=_guided_decoding(params, trtllm),
        **_beam_search_kwargs(params.beam_width),
        **_word_placeholders(params),
    )
    if params.stop_words:
        sampling._stop_word_ids = [list(word) for word in params.stop_words]
    if params.bad_words:
        sampling._bad_word_ids = [list(word) for word in params.bad_words]
    return sampling


def _guided_decoding(params: SamplingParams, trtllm: Any):
    """Ours as the library's `GuidedDecodingParams` (the same field names); None when the request is not guided."""
    guide = params.guided_decoding
    if guide is None or not guide.is_set:
        return None
    return trtllm.GuidedDecodingParams(
        json=guide.json,
        regex=guide.regex,
        grammar=guide.grammar,
        json_object=guide.json_object,
        # The library takes the structural tag as JSON text only.
        structural_tag=guide.guide()[1] if guide.structural_tag is not None else None,
    )


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
