"""Engine arguments: TensorRT-LLM's `LLM()` keyword arguments (as written in `model.yaml`), parsed once into typed,
validated objects. A key the chosen engine cannot honour is an error at load, never silently dropped."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """An engine argument with a bad value or an unknown key; the message names it."""


ENGINE_CHOICES = ("auto", "embedded", "tensorrt_llm")
DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
SCHEDULER_POLICIES = ("GUARANTEED_NO_EVICT", "MAX_UTILIZATION")
# TensorRT-LLM's `attn_backend` values. TRTLLM (its default) means, in the embedded engine, its fastest backend for
# the device: TRITON on CUDA, VANILLA elsewhere. FLASHINFER is refused by the embedded engine (not built in).
ATTN_BACKENDS = ("TRTLLM", "TRITON", "VANILLA", "FLASHINFER")
# TensorRT-LLM's `guided_decoding_backend` values (None: guided decoding off); the embedded engine has xgrammar.
GUIDED_DECODING_BACKENDS = ("xgrammar", "llguidance")
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights from config.json alone (TensorRT-LLM's LoadFormat.DUMMY)
# TensorRT-LLM's QuantConfig: the keys and algorithms the embedded engine knows (docs/quantization.md).
QUANT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ", None)
KV_CACHE_QUANT_ALGOS = ("FP8", None)
QUANT_CONFIG_KEYS = ("quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules")
# TensorRT-LLM's KvCacheConfig.dtype: "auto" keeps the model's dtype, "fp8" stores keys and values as float8 e4m3.
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    tokens_per_block: int = 32
    # An explicit token budget wins; otherwise the fraction of free memory (GPU memory, or host memory on CPU).
    max_tokens: Optional[int] = None
    free_gpu_memory_fraction: float = 0.9
    # Attention window of each layer, in tokens (TensorRT-LLM's key): a list shorter than the layer count repeats
    # over the layers; a window at least max_seq_len attends to everything. None: full attention.
    max_attention_window: Optional[list[int]] = None
    # The cache's element type (KV_CACHE_DTYPES); quant_config.kv_cache_quant_algo FP8 also asks for fp8.
    dtype: str = "auto"

    def validate(self) -> None:
        check_attention_windows(self.max_attention_window, "kv_cache_config.max_attention_window")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_config.dtype must be one of {KV_CACHE_DTYPES}, got {self.dtype!r}")
        if self.tokens_per_block < 1:
            raise ConfigError(f"kv_cache_config.tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"kv_cache_config.max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 < self.free_gpu_memory_fraction <= 1:
            raise ConfigError(
                f"kv_cache_config.free_gpu_memory_fraction must be in (0, 1], got {self.free_gpu_memory_fraction}"
            )


def check_quant_config(quant_config: Any) -> None:
    """TensorRT-LLM's QuantConfig keys with values the embedded engine knows; what quant/settings.py reads."""
    if quant_config is None:
        return
    if not isinstance(quant_config, dict):
        raise ConfigError(f"quant_config must be a mapping of {list(QUANT_CONFIG_KEYS)}, got {quant_config!r}")
    unknown = sorted(set(quant_config) - set(QUANT_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"quant_config: unknown key(s) {unknown}; known: {list(QUANT_CONFIG_KEYS)}")
    for key, allowed in (("quant_algo", QUANT_ALGOS), ("kv_cache_quant_algo", KV_CACHE_QUANT_ALGOS)):
        if quant_config.get(key) not in allowed:
            raise ConfigError(f"quant_config.{key} must be one of {list(allowed)}, got {quant_config.get(key)!r}")
    group = quant_config.get("group_size")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise ConfigError(f"quant_config.group_size must be an integer >= 1, got {group!r}")
    excluded = quant_config.get("exclude_modules")
    if excluded is not None and not (isinstance(excluded, list) and all(isinstance(p, str) for p in excluded)):
        raise ConfigError(f"quant_config.exclude_modules must be a list of module name patterns, got {excluded!r}")


def kv_cache_fp8(config: "EngineConfig") -> bool:
    """Whether the KV cache holds float8 e4m3: `kv_cache_config.dtype: fp8`, or TensorRT-LLM's
    `quant_config.kv_cache_quant_algo: FP8` (check_quant_config has checked its value)."""
    return config.kv_cache_config.dtype == "fp8" or (config.quant_config or {}).get("kv_cache_quant_algo") == "FP8"


def check_attention_windows(windows: Any, name: str) -> None:
    """A non-empty list of integers >= 1 (TensorRT-LLM refuses a window <= 0), or None."""
    if windows is None:
        return
    if not isinstance(windows, list) or not windows:
        raise ConfigError(f"{name} must be a non-empty list of integers (one window per layer), got {windows!r}")
    for window in windows:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"{name}: every window must be an integer >= 1, got {window!r} in {windows!r}")


@dataclass
class SchedulerConfig:
    capacity_scheduler_policy: str = "GUARANTEED_NO_EVICT"

    def validate(self) -> None:
        if self.capacity_scheduler_policy not in SCHEDULER_POLICIES:
            raise ConfigError(
                f"scheduler_config.capacity_scheduler_policy must be one of {SCHEDULER_POLICIES}, "
                f"got {self.capacity_scheduler_policy!r}"
            )


@dataclass
class EngineConfig:
    """Everything an engine needs to start. Field names are TensorRT-LLM `LLM()` argument names, except `engine`
    and `device`, which are ours."""

    model: str = ""
    tokenizer: Optional[str] = None
    engine: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    max_seq_len: Optional[int] = None
    max_beam_width: int = 1
    enable_chunked_prefill: bool = False
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # How TensorRT-LLM splits a mixture of experts over its tensor-parallel devices (None: its default).
    moe_expert_parallel_size: Optional[int] = None
    moe_tensor_parallel_size: Optional[int] = None
    backend: Optional[str] = None
    enable_lora: bool = False
    lora_config: Optional[dict] = None
    speculative_config: Optional[dict] = None
    # CUDA graphs for decode steps ({}: the defaults; None: none; see graph_settings.py).
    cuda_graph_config: Optional[dict] = field(default_factory=dict)
    normalize_log_probs: bool = True
    attn_backend: str = "TRTLLM"
    # TensorRT-LLM's overlap scheduler: the host prepares step N+1 while the GPU runs step N.
    disable_overlap_scheduler: bool = False
    load_format: str = "auto"
    # The grammar library of guided decoding (TensorRT-LLM's LLM argument); None refuses guided requests.
    guided_decoding_backend: Optional[str] = None
    # TensorRT-LLM's QuantConfig as a mapping (QUANT_CONFIG_KEYS); None: the checkpoint as it is quantized, if at all.
    quant_config: Optional[dict] = None
    # Keys passed through untouched to TensorRT-LLM (the embedded engine refuses them).
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> "EngineConfig":
        args = _legacy_cuda_graph_switch(dict(args))
        nested = {"kv_cache_config": KvCacheConfig, "scheduler_config": SchedulerConfig}
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values: dict[str, Any] = {"extra": {}}
        for key, value in args.items():
            if key in nested:
                values[key] = _build_nested(key, nested[key], value)
            elif key in known:
                values[key] = value
            else:
                values["extra"][key] = value
        config = cls(**values)
        config.validate()
        return config

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Optional[dict[str, Any]] = None) -> "EngineConfig":
        args = load_yaml_args(path)
        args.update(overrides or {})
        return cls.from_dict(args)

    def validate(self) -> None:
        for name, choices in (("engine", ENGINE_CHOICES), ("dtype", DTYPE_CHOICES), ("device", DEVICE_CHOICES)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        for name in (
            "max_batch_size",
            "max_num_tokens",
            "max_beam_width",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("moe_expert_parallel_size", "moe_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 2):
            raise ConfigError(f"max_seq_len must be an integer >= 2, got {self.max_seq_len!r}")
        self._validate_choices()
        check_quant_config(self.quant_config)
        self.kv_cache_config.validate()
        self.scheduler_config.validate()
        self.lora_settings()
        self.speculative_settings()
        self.cuda_graph_settings()

    def _validate_choices(self) -> None:
        """`attn_backend` and `load_format`, normalised as TensorRT-LLM reads them (any case)."""
        for name, choices, normal in (
            ("attn_backend", ATTN_BACKENDS, str.upper),
            ("load_format", LOAD_FORMATS, str.lower),
        ):
            value = getattr(self, name)
            if not isinstance(value, str) or normal(value) not in choices:
                raise ConfigError(f"{name} must be one of {choices}, got {value!r}")
            setattr(self, name, normal(value))
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in GUIDED_DECODING_BACKENDS:
            raise ConfigError(
                f"guided_decoding_backend must be one of {GUIDED_DECODING_BACKENDS} (or unset: off), "
                f"got {self.guided_decoding_backend!r}"
            )
        if not isinstance(self.disable_overlap_scheduler, bool):
            raise ConfigError(
                f"disable_overlap_scheduler must be true or false, got {self.disable_overlap_scheduler!r}"
            )

    def speculative_settings(self):
        """`speculative_config` typed and checked (tritonllm.spec_decode.config), or None without one."""
        if not self.speculative_config:
            return None
        from tritonllm.spec_decode.config import SpecConfigError, parse_speculative_config

        try:
            return parse_speculative_config(self.speculative_config)
        except SpecConfigError as exc:
            raise ConfigError(str(exc)) from None

    def _spec_kind(self) -> Optional[str]:
        """The speculative method's canonical decoding_type (Eagle3 is Eagle), or None without one."""
        spec = self.speculative_settings()
        return None if spec is None else spec.decoding_type

    def cuda_graph_settings(self):
        """`cuda_graph_config` typed and checked (graph_settings.CudaGraphSettings), or None when graphs are off;
        by default graphs cover batches up to `max_batch_size` (graph_settings says why)."""
        from .graph_settings import GraphSettingsError, parse_cuda_graph_config

        try:
            return parse_cuda_graph_config(self.cuda_graph_config, self.max_batch_size)
        except GraphSettingsError as exc:
            raise ConfigError(str(exc)) from None

    def lora_settings(self):
        """`lora_config` typed and checked (tritonllm.lora.settings.LoraSettings), or None when LoRA is off.
        A `lora_config` alone turns LoRA on, as in TensorRT-LLM."""
        if not (self.enable_lora or self.lora_config):
            return None
        from tritonllm.lora.settings import LoraSettings, LoraSettingsError

        if self.lora_config is not None and not isinstance(self.lora_config, dict):
            raise ConfigError(f"lora_config must be a mapping, got {self.lora_config!r}")
        try:
            return LoraSettings.from_dict(self.lora_config)
        except (LoraSettingsError, TypeError) as exc:
            raise ConfigError(str(exc)) from None

    def embedded_unsupported(self) -> list[str]:
        """Settings the embedded engine cannot honour, each as 'key=value (why)'."""
        problems = [f"{k}={v!r} (unknown to the embedded engine)" for k, v in self.extra.items()]
        if self.world_size > 1:
            problems.extend(self.parallel_unsupported())
        for name in ("moe_expert_parallel_size", "moe_tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value != 1:
                problems.append(
                    f"{name}={value} (splitting experts needs several devices; the embedded engine runs on one)"
                )
        if self.attn_backend == "FLASHINFER":
            problems.append(
                "attn_backend='FLASHINFER' (FlashInfer is not built into the embedded engine; its "
                "paged-attention kernels are attn_backend: TRITON, the default on CUDA)"
            )
        if self.guided_decoding_backend == "llguidance":
            problems.append("guided_decoding_backend='llguidance' (the embedded engine guides with xgrammar)")
        spec = self.speculative_settings()
        if spec is not None and self.max_beam_width > 1:
            problems.append(
                f"speculative_config with max_beam_width={self.max_beam_width} (speculative decoding "
                "does not combine with beam search)"
            )
        return problems

    @property
    def world_size(self) -> int:
        """Processes (ranks) the engine runs on: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def parallel_layout(self) -> str:
        """The sizes as a user wrote them, for messages: 'tensor_parallel_size=2 and pipeline_parallel_size=2'."""
        sizes = [
            ("tensor_parallel_size", self.tensor_parallel_size),
            ("pipeline_parallel_size", self.pipeline_parallel_size),
        ]
        shown = [f"{name}={value}" for name, value in sizes if value > 1] or ["tensor_parallel_size=1"]
        return " and ".join(shown)

    def parallel_unsupported(self) -> list[str]:
        """Settings the embedded engine's tensor and pipeline parallelism do not cover yet, each named."""
        size = f"with {self.parallel_layout()}"
        refused = {
            "speculative_config with Medusa or Eagle (tensor parallelism alone takes them: their drafts read the "
            "last stage's hidden states)": self._spec_kind() in ("Medusa", "Eagle") and self.pipeline_parallel_size > 1,
            "quant_config (quantization)": self.quant_config is not None,
            "kv_cache_config.dtype='fp8' (an FP8 KV cache)": kv_cache_fp8(self),
        }
        return [
            f"{what} {size} (not supported under tensor or pipeline parallelism yet)"
            for what, on in refused.items()
            if on
        ]


def _legacy_cuda_graph_switch(args: dict[str, Any]) -> dict[str, Any]:
    """`pytorch_backend_config: {use_cuda_graph: BOOL}` (older TensorRT-LLM, as the backend's LLM-API model.yaml
    ships it) as today's `cuda_graph_config`; a `pytorch_backend_config` with other keys stays as it is."""
    legacy = args.get("pytorch_backend_config")
    if not isinstance(legacy, dict) or set(legacy) != {"use_cuda_graph"}:
        return args
    switch = legacy["use_cuda_graph"]
    if not isinstance(switch, bool):
        raise ConfigError(f"pytorch_backend_config.use_cuda_graph must be true or false, got {switch!r}")
    if "cuda_graph_config" in args:
        raise ConfigError("give either cuda_graph_config or pytorch_backend_config.use_cuda_graph, not both")
    args.pop("pytorch_backend_config")
    args["cuda_graph_config"] = {} if switch else None
    return args


def _build_nested(key: str, kind: type, value: Any) -> Any:
    if value is None:
        return kind()
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping, got {value!r}")
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {unknown}; known: {sorted(names)}")
    return kind(**value)


def load_yaml_args(path: str | Path) -> dict[str, Any]:
    """Read a `model.yaml`; the `triton_config` section belongs to the Triton side and is left out."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read engine config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"engine config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"engine config {path} must be a mapping of LLM() arguments")
    data.pop("triton_config", None)
    return data
