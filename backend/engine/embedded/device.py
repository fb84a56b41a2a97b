"""Where the embedded engine runs, in which dtype, and how many tokens of KV cache it can afford."""

from __future__ import annotations

import logging

import torch

from ..config import ConfigError, EngineConfig, kv_cache_fp8

log = logging.getLogger("tritonllm.engine")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(requested: str, model_dtype: str | None, device: torch.device) -> torch.dtype:
    """An explicit dtype wins. 'auto' is float32 on CPU (most CPUs have no fast bf16/fp16 matmul: on the AVX2
    machines here bf16 ran at half the speed of fp32) and the checkpoint's dtype on GPU."""
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cpu":
        return torch.float32
    name = (model_dtype or "bfloat16").replace("torch.", "")
    return _DTYPES.get(name, torch.bfloat16)


def resolve_kv_cache_dtype(
    config: EngineConfig, dtype: torch.dtype, device: torch.device, attn_backend: str
) -> torch.dtype:
    """The KV cache's element type: the model's `dtype`, or float8 e4m3 when the config asks for an FP8 cache
    (config.kv_cache_fp8). CPU PyTorch holds float8 tensors, so the portable path runs anywhere; the Triton
    kernels' float8 conversions need compute capability 8.9 (Ada, Hopper) or newer, refused by name below it."""
    if not kv_cache_fp8(config):
        return dtype
    asked = (
        "kv_cache_config.dtype='fp8'"
        if config.kv_cache_config.dtype == "fp8"
        else "quant_config.kv_cache_quant_algo='FP8'"
    )
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        raise ConfigError(f"{asked}: this PyTorch ({torch.__version__}) has no float8_e4m3fn type")
    if device.type == "cuda" and attn_backend == "TRITON":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(
                f"{asked} with the Triton attention kernels needs a GPU of compute capability 8.9 or newer "
                f"(float8 e4m3 conversions); this one is {capability[0]}.{capability[1]}: use attn_backend: "
                "VANILLA, or kv_cache_config.dtype: auto"
            )
    return fp8


def avoid_cudnn_attention(device: torch.device) -> None:
    """On CUDA, turn off SDPA's cuDNN backend for this process. cuDNN builds an execution plan for every new shape
    (60-700 ms each on an H200 in bf16, docs/benchmarks.md), and the engine's attention shapes change with the batch
    size, every KV block a context grows and every chunk or prefix-hit suffix; the flash and memory-efficient kernels
    that take over need no plan. Global, as PyTorch's backend switches are: the engine owns its process."""
    if device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        log.info("cuDNN attention off for this process: it builds a plan for every new shape")


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def kv_cache_token_budget(
    config: EngineConfig,
    model_config,
    dtype: torch.dtype,
    device: torch.device,
    max_seq_len: int,
    reserved_bytes: int = 0,
) -> int:
    """`kv_cache_config.max_tokens` if given; else the free-memory fraction (of GPU memory, or of available host
    memory on CPU) of what is free once `reserved_bytes` (activations, CUDA graphs: memory_profile.py) are set
    aside, capped at what `max_batch_size` sequences of `max_seq_len` tokens can use. `dtype`: the cache's
    element type (an FP8 cache's tokens take half the bytes of bf16 ones)."""
    kv = config.kv_cache_config
    if kv.max_tokens is not None:
        return kv.max_tokens
    per_token = model_config.kv_bytes_per_token(dtype)
    free = max(0, available_memory_bytes(device) - reserved_bytes)
    affordable = int(free * kv.free_gpu_memory_fraction) // per_token
    return max(kv.tokens_per_block, min(affordable, config.max_batch_size * max_seq_len))
