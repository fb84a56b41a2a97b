"""Assembling the embedded engine from its config, in the order its parts depend on each other: where it computes
(`place`), the model and the limits it sets (`load_target`), the KV cache's size (`kv_block_count`), the model
runner with its CUDA graphs (`build_runner`) and LoRA (`lora_runtime`). EngineCore calls them once, at its start;
under tensor or pipeline parallelism each takes this rank's part (parallel/setup.py's `Parallel`)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

import torch

from ..config import EngineConfig
from ..types import InvalidRequestError
from .attention import resolve_backend
from .attention.triton_backend import TritonAttention
from .attention.windows import describe as describe_windows
from .attention.windows import layer_windows
from .block_manager import blocks_for
from .cuda_graphs import DecodeGraphs
from .device import avoid_cudnn_attention, kv_cache_token_budget, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from .loader import load_model, read_model_config
from .memory_profile import activation_bytes
from .model_runner import ModelRunner
from .network.llama import LlamaForCausalLM
from .network.model_config import ModelConfig
from .network.rope import uses_long_factors

if TYPE_CHECKING:
    from tritonllm.lora.runtime import LoraRuntime

    from .parallel.setup import Parallel

log = logging.getLogger("tritonllm.engine")


@dataclass(frozen=True)
class Placement:
    """Where and in what the engine computes."""

    device: torch.device
    attn_backend: str  # "TRITON" or "VANILLA" (attention/__init__.py)
    dtype: torch.dtype  # of the weights and activations
    kv_dtype: torch.dtype  # of the KV cache: the model's, or float8 (attention/fp8_cache.py)


def place(config: EngineConfig, parallel: Optional[Parallel]) -> Placement:
    device = resolve_device(config.device) if parallel is None else parallel.device
    avoid_cudnn_attention(device)
    attn_backend = resolve_backend(config.attn_backend, device)
    dtype = resolve_dtype(config.dtype, read_model_config(config.model).torch_dtype, device)
    return Placement(device, attn_backend, dtype, resolve_kv_cache_dtype(config, dtype, device, attn_backend))


@dataclass(frozen=True)
class Target:
    """The model as this process holds it. Under tensor or pipeline parallelism a shard: `layers` and the heads
    are this rank's part, while `config` stays the whole model's."""

    model: LlamaForCausalLM
    config: ModelConfig
    max_seq_len: int
    attention_windows: tuple[Optional[int], ...]  # every layer's, the whole model's
    layers: range
    num_heads: int
    num_kv_heads: int


def load_target(config: EngineConfig, parallel: Optional[Parallel], placement: Placement) -> Target:
    """The model loaded (or this rank's shard), with its context length, rotary factors and attention windows set."""
    if parallel is None:
        model, model_config = load_model(
            config.model, placement.dtype, placement.device, config.load_format, config.quant_config
        )
    else:
        model, model_config = parallel.load(config.model, placement.dtype, config.load_format)
    max_seq_len = max_seq_len_of(config, model_config)
    fix_rope_context(model, model_config, max_seq_len)
    windows = attention_windows(config, model_config, max_seq_len)
    layers = range(model_config.num_layers) if parallel is None else parallel.local_layers(model_config.num_layers)
    model.set_attention_windows(windows[layers.start : layers.stop])
    heads = (model_config.num_heads, model_config.num_kv_heads) if parallel is None else parallel.local_heads()
    return Target(model, model_config, max_seq_len, windows, layers, *heads)


def max_seq_len_of(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    wanted = config.max_seq_len or limit
    if wanted > limit:
        raise InvalidRequestError(f"max_seq_len={wanted} exceeds what the model supports ({limit})")
    return wanted


def fix_rope_context(model: LlamaForCausalLM, model_config: ModelConfig, max_seq_len: int) -> None:
    """The longest context a step attends over: a sequence's last token is never fed back, so max_seq_len - 1.
    Fixes longrope's factor set (RotaryEmbedding.set_context_length); other RoPE types ignore it."""
    rope = model_config.rope
    for rotary in model.rotary_embeddings():
        rotary.set_context_length(max_seq_len - 1)
    if rope.rope_type == "longrope":
        long = uses_long_factors(rope, max_seq_len - 1)
        log.info(
            "longrope: the %s factors for every sequence (max_seq_len %d, original_max_position_embeddings %d)",
            "long" if long else "short",
            max_seq_len,
            rope.params["original_max_position_embeddings"],
        )


def attention_windows(config: EngineConfig, model_config: ModelConfig, max_seq_len: int) -> tuple[Optional[int], ...]:
    """Each layer's window (attention/windows.py). Draft nodes measure theirs from their depth, but a tree's own
    keys are shown whole (every ancestor of a node), so a draft tail must fit in the smallest window."""
    windows = layer_windows(
        model_config.layer_windows, config.kv_cache_config.max_attention_window, model_config.num_layers, max_seq_len
    )
    spec = config.speculative_settings()
    smallest = min((w for w in windows if w is not None), default=None)
    if spec is not None and smallest is not None and 1 + spec.max_total_draft_tokens > smallest:
        raise InvalidRequestError(
            f"speculative_config drafts up to {spec.max_total_draft_tokens} tokens a step, which with the root "
            f"do not fit in the smallest attention window ({smallest}); use fewer draft tokens or a wider window"
        )
    log.info("%s", describe_windows(windows))
    return windows


def attention_kernels(placement: Placement, target: Target, block_size: int) -> Optional[TritonAttention]:
    if placement.attn_backend != "TRITON":
        return None
    return TritonAttention(target.num_heads, target.num_kv_heads, block_size, placement.device)


def kv_block_count(
    config: EngineConfig,
    parallel: Optional[Parallel],
    placement: Placement,
    target: Target,
    kernels: Optional[TritonAttention],
    graphs: bool,
) -> int:
    """How many KV blocks the cache holds; under parallelism the fewest any rank can hold, agreed by all."""
    if parallel is None:
        return single_kv_blocks(config, placement, target, kernels, graphs)
    return parallel.agree_num_blocks(rank_kv_blocks(config, placement, target))


def single_kv_blocks(
    config: EngineConfig, placement: Placement, target: Target, kernels: Optional[TritonAttention], graphs: bool
) -> int:
    """KV blocks for the memory left once the activations of a full step (and, with CUDA graphs, their pool) are
    set aside: measured by one forward at max_num_tokens (memory_profile.py; CUDA only)."""
    block_size = config.kv_cache_config.tokens_per_block
    activations = activation_bytes(
        target.model,
        target.config,
        placement.dtype,
        placement.device,
        config.max_num_tokens,
        target.max_seq_len,
        config.max_batch_size,
        block_size,
        kernels,
        placement.kv_dtype,
    )
    reserved = activations * (2 if graphs else 1)
    budget = kv_cache_token_budget(
        config, target.config, placement.kv_dtype, placement.device, target.max_seq_len, reserved
    )
    if reserved:
        log.info(
            "%.2f GiB set aside for activations%s before sizing the KV cache",
            reserved / 2**30,
            " and CUDA graphs" if graphs else "",
        )
    return max(1, budget // block_size)


def rank_kv_blocks(config: EngineConfig, placement: Placement, target: Target) -> int:
    """A parallel rank's KV blocks: a token's bytes are those of its stage's layers and its KV heads, and on CPU
    the ranks share the host's memory. The profile of memory_profile.py runs the whole model, so a rank's
    activations are not measured (a warning says so on CUDA)."""
    block_size = config.kv_cache_config.tokens_per_block
    if placement.device.type == "cuda" and config.kv_cache_config.max_tokens is None:
        log.warning(
            "parallel: activation memory is not measured on a rank; leave room for it with "
            "kv_cache_config.free_gpu_memory_fraction or max_tokens"
        )
    shape = replace(target.config, num_layers=len(target.layers), num_kv_heads=target.num_kv_heads)
    budget = kv_cache_token_budget(config, shape, placement.kv_dtype, placement.device, target.max_seq_len)
    if placement.device.type == "cpu" and config.kv_cache_config.max_tokens is None:
        budget = max(block_size, budget // config.world_size)  # every rank of a CPU run is on this host
    return max(1, budget // block_size)


def build_runner(
    config: EngineConfig,
    parallel: Optional[Parallel],
    placement: Placement,
    target: Target,
    num_blocks: int,
    kernels: Optional[TritonAttention],
    graph_settings,
) -> ModelRunner:
    """The model runner over a KV cache of `num_blocks` blocks, with CUDA graphs when `graph_settings` is set:
    then the cache has one block more than the block manager hands out, where padding rows write their K/V."""
    block_size = config.kv_cache_config.tokens_per_block
    runner_class = ModelRunner if parallel is None else parallel.runner_class()
    runner = runner_class(
        target.model,
        len(target.layers),
        target.num_kv_heads,
        target.config.head_dim,
        num_blocks + (graph_settings is not None),
        block_size,
        placement.dtype,
        placement.device,
        cache_dtype=placement.kv_dtype,
    )
    runner.kernels = kernels
    if parallel is not None:
        runner.group = parallel.group
    if graph_settings is not None:
        runner.graphs = DecodeGraphs(
            target.model,
            runner.kv_caches,
            graph_settings,
            block_size,
            blocks_for(target.max_seq_len, block_size),
            scratch_block=num_blocks,
            device=placement.device,
            kernels=kernels,
            dtype=placement.dtype,
        )
        log.info(
            "CUDA graphs for decode and verification steps of batch sizes %s%s (each captured on first use)",
            ", ".join(map(str, graph_settings.batch_sizes)),
            ", smaller batches padded up" if graph_settings.enable_padding else "",
        )
    return runner


def lora_runtime(
    config: EngineConfig, parallel: Optional[Parallel], placement: Placement, model_config: ModelConfig
) -> Optional[LoraRuntime]:
    """The LoRA runtime (adapter cache, device slots, preloaded adapters), or None when LoRA is off. Under tensor
    parallelism its slots hold this rank's part of each adapter (tritonllm.lora.layers.LoraSharding)."""
    settings = config.lora_settings()
    if settings is None:
        return None
    from tritonllm.lora.layers import WHOLE
    from tritonllm.lora.modules import LoraFormatError, ModuleShapes
    from tritonllm.lora.runtime import LoraRequestError, LoraRuntime

    if model_config.moe is not None:
        settings = _attention_only_lora(settings, config.lora_config or {}, model_config.architecture)
    sharding = WHOLE if parallel is None else parallel.lora_sharding(model_config)
    try:
        shapes = ModuleShapes.of_config(model_config)
        return LoraRuntime(settings, shapes, placement.dtype, placement.device, sharding)
    except (LoraFormatError, LoraRequestError) as exc:
        raise InvalidRequestError(f"lora_config: {exc}") from None


_MLP_LORA_MODULES = ("gate_proj", "up_proj", "down_proj")


def _attention_only_lora(settings, lora_config: dict, architecture: str):
    """A mixture of experts takes LoRA on attention only: MLP targets would name expert weights, which no adapter
    here applies. Named in lora_target_modules they are refused; left to the default (every module), dropped."""
    mlp = [name for name in settings.lora_target_modules if name in _MLP_LORA_MODULES]
    if mlp and lora_config.get("lora_target_modules"):
        raise InvalidRequestError(
            f"lora_config.lora_target_modules: {', '.join(mlp)} of {architecture} are expert weights, and LoRA on "
            "experts is not supported (target the attention: q_proj, k_proj, v_proj, o_proj)"
        )
    attention = tuple(name for name in settings.lora_target_modules if name not in _MLP_LORA_MODULES)
    return dataclasses.replace(settings, lora_target_modules=attention)
