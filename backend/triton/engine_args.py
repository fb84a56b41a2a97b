"""Settings of the `tensorrt_llm` model: engine arguments plus the Triton-side knobs, read once at load.

Engine arguments come from `1/model.yaml` (TensorRT-LLM `LLM()` keys); the TensorRT-LLM backend's
`config.pbtxt` parameters that are set override them. A bad value, or a parameter that asks for a feature this
package has not built, fails the load with a `ParameterError` naming the parameter; it is never silently dropped.
(Problems inside model.yaml itself raise `ConfigError`, naming the yaml key.)
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from tritonllm.checkpoints.model_ref import resolve_model_ref
from tritonllm.engine.config import (
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    ENGINE_CHOICES,
    GUIDED_DECODING_BACKENDS,
    ConfigError,
    EngineConfig,
    load_yaml_args,
)
from tritonllm.triton.params import ParameterError, Parameters

log = logging.getLogger("tritonllm.tensorrt_llm")
ENGINE_ARGS_FILE = "model.yaml"
SCHEDULER_POLICY_NAMES = {"max_utilization": "MAX_UTILIZATION", "guaranteed_no_evict": "GUARANTEED_NO_EVICT"}
BATCHING_STRATEGIES = ("inflight_fused_batching", "inflight_batching")
SAMPLING_DECODING_MODES = ("auto", "top_k", "top_p", "top_k_top_p", "beam_search")
# Speculative modes built in the embedded engine: they become speculative_config (see speculative_overrides).
SPECULATIVE_DECODING_MODES = ("lookahead", "medusa", "eagle")
UNBUILT_DECODING_MODES = ("redrafter",)
LOOKAHEAD_PARAMETERS = {
    "lookahead_window_size": "max_window_size",
    "lookahead_ngram_size": "max_ngram_size",
    "lookahead_verification_set_size": "max_verification_set_size",
}

# Parameters of the contract accepted at their harmless defaults (what we do anyway). Each is type-checked, so a
# typo fails as it would upstream; a value that asks for more than the default is refused (check_unbuilt_features).
ACCEPTED_PARAMETERS = (
    "FORCE_CPU_ONLY_INPUT_TENSORS",
    "executor_worker_path",
    "gpu_device_ids",
    "iter_stats_max_iterations",
    "request_stats_max_iterations",
    "kv_cache_onboard_blocks",
    "cross_kv_cache_fraction",
    "multi_block_mode",
    "cuda_graph_cache_size",
    "enable_context_fmha_fp32_acc",
    "lora_cache_optimal_adapter_size",
    "lora_cache_max_adapter_size",
    "lora_cache_gpu_memory_fraction",
    "lora_cache_host_memory_bytes",
    "lookahead_window_size",
    "lookahead_ngram_size",
    "lookahead_verification_set_size",
    "medusa_choices",
    "eagle_choices",
    "xgrammar_tokenizer_info_path",
    "gpt_model_type",
    "decoding_mode",
    "num_nodes",
    "gpu_weights_percent",
    "speculative_decoding_fast_logits",
    "kv_cache_host_memory_bytes",
    "sink_token_length",
    "enable_trt_overlap",
)
ENGINE_PARAMETERS = (
    "gpt_model_path",
    "tokenizer_dir",
    "max_beam_width",
    "max_tokens_in_paged_kv_cache",
    "kv_cache_free_gpu_mem_fraction",
    "enable_kv_cache_reuse",
    "enable_chunked_context",
    "batch_scheduler_policy",
    "normalize_log_probs",
    "engine",
    "dtype",
    "device",
    "max_num_tokens",
    "max_seq_len",
    "max_batch_size",
    "lora_prefetch_dir",
    "cuda_graph_mode",
    "attn_backend",
    "disable_overlap_scheduler",
    "max_attention_window_size",
    "guided_decoding_backend",
)
TRITON_PARAMETERS = ("exclude_input_in_output", "cancellation_check_period_ms", "stats_check_period_ms")
# Set at all, these ask for something not built; the value does not matter.
UNBUILT_WHEN_SET = {
    "encoder_model_path": "encoder-decoder models are not supported",
    "participant_ids": "multi-process (MPI orchestrator) execution is not supported",
    "worker_path": "worker_path is deprecated; executor_worker_path replaces it (and is not needed here)",
}
KNOWN_PARAMETERS = frozenset(ACCEPTED_PARAMETERS + ENGINE_PARAMETERS + TRITON_PARAMETERS) | set(UNBUILT_WHEN_SET)


@dataclass(frozen=True)
class TensorrtLLMSettings:
    """Everything the tensorrt_llm model needs to start, typed and validated."""

    engine: EngineConfig
    decoupled: bool
    exclude_input_in_output: bool = False
    cancellation_check_period_ms: int = 100
    stats_check_period_ms: int = 100
    max_queue_size: int = 0  # 0 = unlimited
    triton_max_batch_size: int = 0
    engine_args_path: Optional[Path] = None  # the model.yaml that was read, if any
    unknown_parameters: tuple[str, ...] = ()  # not in the contract; worth a warning at load


def load_tensorrt_llm_settings(
    model_config: Mapping[str, Any], model_dir: str | Path, model_version: int | str = 1
) -> TensorrtLLMSettings:
    """`model_config` is the dict Triton hands `initialize()`; `model_dir` holds `config.pbtxt` and `1/`."""
    params = Parameters.from_model_config(model_config)
    check_unbuilt_features(params)
    check_accepted_parameters(params)
    if "xgrammar_tokenizer_info_path" in params:
        log.warning(
            "%s: parameter 'xgrammar_tokenizer_info_path' is ignored: the engine derives xgrammar's tokenizer "
            "info from the tokenizer (tokenizer_dir, else the model folder)",
            params.model_name,
        )
    yaml_path = find_engine_args_file(Path(model_dir), model_version)
    args = load_yaml_args(yaml_path) if yaml_path else {}
    for key in ("model", "tokenizer"):  # a Hugging Face id resolves through the hub cache; folders stay as given
        if yaml_path and args.get(key):
            args[key] = resolve_model_ref(args[key], key, str(yaml_path))
    triton_max_batch_size = _int_field(model_config, "max_batch_size", 0)
    decoupled = is_decoupled(model_config)
    if yaml_path:
        check_triton_config(yaml_path, triton_max_batch_size, decoupled)
    args = merge_engine_args(args, engine_overrides(params))
    if "max_batch_size" not in args and triton_max_batch_size > 0:
        args["max_batch_size"] = triton_max_batch_size
    if not args.get("model"):
        raise ParameterError(
            f"{params.model_name}: parameter 'gpt_model_path' is unset and {ENGINE_ARGS_FILE} has "
            "no 'model': one of them must name the model folder"
        )
    return TensorrtLLMSettings(
        engine=EngineConfig.from_dict(args),
        decoupled=decoupled,
        exclude_input_in_output=params.bool("exclude_input_in_output", False),
        cancellation_check_period_ms=params.int("cancellation_check_period_ms", 100, minimum=1),
        stats_check_period_ms=params.int("stats_check_period_ms", 100, minimum=1),
        max_queue_size=max_queue_size(model_config),
        triton_max_batch_size=triton_max_batch_size,
        engine_args_path=yaml_path,
        unknown_parameters=tuple(sorted(set(params.values) - KNOWN_PARAMETERS)),
    )


def engine_overrides(params: Parameters) -> dict[str, Any]:
    """The set config.pbtxt parameters, as LLM() arguments (nested configs as partial dicts)."""
    out: dict[str, Any] = {}
    _put(out, "model", params.str("gpt_model_path"))
    _put(out, "tokenizer", params.str("tokenizer_dir"))
    _put(out, "engine", params.choice("engine", ENGINE_CHOICES))
    _put(out, "dtype", params.choice("dtype", DTYPE_CHOICES))
    _put(out, "device", params.choice("device", DEVICE_CHOICES))
    _put(out, "max_batch_size", params.int("max_batch_size", minimum=1))
    _put(out, "max_num_tokens", params.int("max_num_tokens", minimum=1))
    _put(out, "max_seq_len", params.int("max_seq_len", minimum=2))
    _put(out, "max_beam_width", beam_width(params))
    _put(out, "enable_chunked_prefill", params.bool("enable_chunked_context"))
    _put(out, "normalize_log_probs", params.bool("normalize_log_probs"))
    _put(out, "attn_backend", params.str("attn_backend"))  # checked (any case) by EngineConfig, naming the key
    _put(out, "disable_overlap_scheduler", params.bool("disable_overlap_scheduler"))
    _put(out, "guided_decoding_backend", params.choice("guided_decoding_backend", GUIDED_DECODING_BACKENDS))
    kv_cache: dict[str, Any] = {}
    _put(kv_cache, "max_tokens", params.int("max_tokens_in_paged_kv_cache", minimum=1))
    _put(kv_cache, "free_gpu_memory_fraction", memory_fraction(params, "kv_cache_free_gpu_mem_fraction"))
    _put(kv_cache, "enable_block_reuse", params.bool("enable_kv_cache_reuse"))
    _put(kv_cache, "max_attention_window", attention_windows(params))
    _put(out, "kv_cache_config", kv_cache or None)
    policy = lowercase_choice(params, "batch_scheduler_policy", tuple(SCHEDULER_POLICY_NAMES))
    if policy is not None:
        out["scheduler_config"] = {"capacity_scheduler_policy": SCHEDULER_POLICY_NAMES[policy]}
    _put(out, "lora_config", lora_overrides(params))
    _put(out, "speculative_config", speculative_overrides(params))
    graphs = params.bool("cuda_graph_mode")
    if graphs is not None:  # off, or on (with model.yaml's cuda_graph_config, if it has one)
        out["cuda_graph_config"] = {} if graphs else None
    return out


def speculative_overrides(params: Parameters) -> Optional[dict[str, Any]]:
    """TensorRT-LLM backend's decoding parameters as speculative_config keys. decoding_mode=lookahead needs the
    three lookahead_* parameters (as upstream); decoding_mode=medusa / eagle take medusa_choices / eagle_choices,
    and the heads' or draft layer's folder comes from model.yaml's speculative_config (speculative_model_dir),
    which the pbtxt cannot name."""
    mode = (params.str("decoding_mode") or "").lower()
    if mode == "lookahead":
        config: dict[str, Any] = {"decoding_type": "Lookahead"}
        for name, key in LOOKAHEAD_PARAMETERS.items():
            value = params.int(name, minimum=1)
            if value is None:
                raise ParameterError(
                    f"{params.model_name}: parameter '{name}' is required with decoding_mode="
                    f"lookahead (all of {sorted(LOOKAHEAD_PARAMETERS)})"
                )
            config[key] = value
        return config
    if mode in ("medusa", "eagle"):  # the heads' / draft layer's folder comes from model.yaml
        config = {"decoding_type": mode.capitalize()}
        _put(config, f"{mode}_choices", params.str(f"{mode}_choices"))
        return config
    return None


def lora_overrides(params: Parameters) -> Optional[dict[str, Any]]:
    """The PEFT-cache parameters as lora_config keys; any of them set turns LoRA on. lora_prefetch_dir holds
    adapter folders (TensorRT-LLM's `<task_id>/model.lora_{weights,config}.npy`, or PEFT folders) preloaded by
    name; lora_cache_max_adapter_size is the highest rank; lora_cache_host_memory_bytes caps the host tier.
    lora_cache_optimal_adapter_size and lora_cache_gpu_memory_fraction size TensorRT-LLM's cache pages; here the
    device tier holds lora_config.max_loras adapters, so they are only type-checked."""
    lora: dict[str, Any] = {}
    _put(lora, "lora_dir", params.str("lora_prefetch_dir"))
    _put(lora, "max_lora_rank", params.int("lora_cache_max_adapter_size", minimum=1))
    _put(lora, "host_cache_bytes", params.int("lora_cache_host_memory_bytes", minimum=1))
    return lora or None


def merge_engine_args(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Overrides win key by key; nested configs (kv_cache_config, scheduler_config) merge one level deep, so a
    yaml `kv_cache_config: {tokens_per_block: 64}` survives a pbtxt `max_tokens_in_paged_kv_cache`."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def lowercase_choice(params: Parameters, name: str, choices: tuple[str, ...]) -> Optional[str]:
    text = params.str(name)
    if text is not None and text.lower() not in choices:
        raise ParameterError(f"{params.model_name}: parameter '{name}' = {text!r} must be one of {choices}")
    return None if text is None else text.lower()


def beam_width(params: Parameters) -> Optional[int]:
    return params.int("max_beam_width", minimum=1)


def memory_fraction(params: Parameters, name: str) -> Optional[float]:
    value = params.float(name, maximum=1.0)
    if value is not None and value <= 0:
        raise ParameterError(f"{params.model_name}: parameter '{name}' = {value} must be in (0, 1]")
    return value


def check_unbuilt_features(params: Parameters) -> None:
    """Parameters whose value asks for a feature this package does not have: fail now, not at the first request."""
    for name, why in UNBUILT_WHEN_SET.items():
        if name in params:
            raise _unbuilt(params, name, why)
    if params.bool("enable_trt_overlap", False):
        raise _unbuilt(params, "enable_trt_overlap", "it is deprecated (as in TensorRT-LLM's backend); remove it")
    strategy = params.str("gpt_model_type")
    if strategy is not None and strategy.lower() not in BATCHING_STRATEGIES:
        why = (
            "static (v1) batching is not supported; use inflight_fused_batching"
            if strategy.lower() == "v1"
            else f"must be one of {BATCHING_STRATEGIES}"
        )
        raise _unbuilt(params, "gpt_model_type", why)
    mode = params.str("decoding_mode")
    if mode is not None and mode.lower() in UNBUILT_DECODING_MODES:
        raise _unbuilt(
            params,
            "decoding_mode",
            f"{mode} decoding is not supported yet; use one of {SAMPLING_DECODING_MODES} or leave it empty",
        )
    known = SAMPLING_DECODING_MODES + SPECULATIVE_DECODING_MODES
    if mode is not None and mode.lower() not in known:
        raise _unbuilt(params, "decoding_mode", f"must be one of {known + UNBUILT_DECODING_MODES}")
    _require(
        params,
        "kv_cache_host_memory_bytes",
        params.int("kv_cache_host_memory_bytes", 0, minimum=0) == 0,
        "offloading the KV cache to host memory is not supported yet; use 0",
    )
    _require(
        params,
        "sink_token_length",
        not params.int("sink_token_length", 0, minimum=0),
        "attention sinks are not supported yet; leave it empty",
    )
    _require(params, "num_nodes", params.int("num_nodes", 1, minimum=1) == 1, "multi-node execution is not supported")
    _require(
        params,
        "gpu_weights_percent",
        params.float("gpu_weights_percent", 1.0, minimum=0.0, maximum=1.0) == 1.0,
        "weight streaming is not supported; use 1.0",
    )
    _require(
        params,
        "speculative_decoding_fast_logits",
        not params.bool("speculative_decoding_fast_logits", False),
        "fast logits are not supported",
    )


def attention_windows(params: Parameters) -> Optional[list[int]]:
    """`max_attention_window_size`: one window for every layer, or windows separated by ',' (TensorRT-LLM's
    backend splits it so), which repeat over the layers; each an integer >= 1."""
    text = params.str("max_attention_window_size")
    if text is None:
        return None
    windows = []
    for part in text.split(","):
        try:
            window = int(part)
        except ValueError:
            raise _unbuilt(params, "max_attention_window_size", "must be integers separated by ','") from None
        if window < 1:
            raise _unbuilt(params, "max_attention_window_size", f"every window must be >= 1, got {window}")
        windows.append(window)
    return windows


def check_accepted_parameters(params: Parameters) -> None:
    """Type-check parameters we accept without acting on them."""
    for name in ("multi_block_mode", "enable_context_fmha_fp32_acc", "kv_cache_onboard_blocks"):
        params.bool(name)
    for name in (
        "cuda_graph_cache_size",
        "iter_stats_max_iterations",
        "request_stats_max_iterations",
        "lora_cache_optimal_adapter_size",
        "lora_cache_max_adapter_size",
        "lora_cache_host_memory_bytes",
    ):
        params.int(name, minimum=0)
    for name in ("cross_kv_cache_fraction", "lora_cache_gpu_memory_fraction"):
        params.float(name, minimum=0.0, maximum=1.0)
    device_ids = params.str("gpu_device_ids")
    if device_ids is not None:
        for part in device_ids.replace(";", ",").split(","):
            if not part.strip().isdigit():
                raise ParameterError(
                    f"{params.model_name}: parameter 'gpu_device_ids' = {device_ids!r} must be "
                    "device numbers separated by ','"
                )


def find_engine_args_file(model_dir: Path, model_version: int | str = 1) -> Optional[Path]:
    """`$LLM_CONFIG_PATH` (absolute, or relative to the version folder) or `<model_dir>/<version>/model.yaml`.
    A path named by the environment must exist; the default file is optional."""
    version_dir = model_dir / str(model_version)
    named = os.environ.get("LLM_CONFIG_PATH")
    if named:
        path = version_dir / named  # an absolute `named` replaces version_dir
        if not path.is_file():
            raise ConfigError(f"LLM_CONFIG_PATH names {path}, which is not a file")
        return path
    path = version_dir / ENGINE_ARGS_FILE
    return path if path.is_file() else None


def check_triton_config(yaml_path: Path, max_batch_size: int, decoupled: bool) -> None:
    """model.yaml's `triton_config` may restate config.pbtxt's settings but not contradict them."""
    try:
        section = (yaml.safe_load(yaml_path.read_text()) or {}).get("triton_config") or {}
    except (OSError, yaml.YAMLError, AttributeError) as exc:
        raise ConfigError(f"cannot read triton_config from {yaml_path}: {exc}") from exc
    if not isinstance(section, dict):
        raise ConfigError(f"{yaml_path}: triton_config must be a mapping")
    unknown = sorted(set(section) - {"max_batch_size", "decoupled"})
    if unknown:
        raise ConfigError(f"{yaml_path}: triton_config has unknown key(s) {unknown}; known: decoupled, max_batch_size")
    for key, actual in (("max_batch_size", max_batch_size), ("decoupled", decoupled)):
        if key in section and section[key] != actual:
            raise ConfigError(
                f"{yaml_path}: triton_config.{key} = {section[key]!r} but config.pbtxt has {actual!r}; "
                "config.pbtxt decides, so make them agree or drop the key"
            )


def is_decoupled(model_config: Mapping[str, Any]) -> bool:
    policy = model_config.get("model_transaction_policy") or {}
    value = policy.get("decoupled", False)
    return value if isinstance(value, bool) else str(value).strip().lower() == "true"


def max_queue_size(model_config: Mapping[str, Any]) -> int:
    policy = (model_config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
    return _int_field(policy, "max_queue_size", 0)


def _int_field(section: Mapping[str, Any], key: str, default: int) -> int:
    # Triton's JSON model config may carry 64-bit integers as strings.
    value = section.get(key, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ParameterError(f"model config field '{key}' = {value!r} must be an integer") from None
    if number < 0:
        raise ParameterError(f"model config field '{key}' = {number} must be >= 0")
    return number


def _put(target: dict, key: str, value: Any) -> None:
    if value is not None:
        target[key] = value


def _require(params: Parameters, name: str, ok: bool, why: str) -> None:
    if not ok:
        raise _unbuilt(params, name, why)


def _unbuilt(params: Parameters, name: str, why: str) -> ParameterError:
    return ParameterError(f"{params.model_name}: parameter '{name}' = {params.str(name)!r}: {why}")
