"""Paged attention behind one backend choice (`attn_backend`): the portable PyTorch path (portable.py) and the
Triton kernels that read the KV blocks in place (triton_backend.py). The model calls `paged_attention`; the step's
metadata says which backend runs it."""

from __future__ import annotations

import torch

from ..rotary_ops import apply_rotary
from .metadata import (
    AttentionMetadata,
    add_step_arrays,
    attach_masks,
    build_decode_mask,
    metadata_from,
    sequence_mask,
    step_metadata,
)
from .portable import portable_attention, write_kv, zero_blocks

__all__ = [
    "AttentionMetadata",
    "add_step_arrays",
    "attach_masks",
    "build_decode_mask",
    "metadata_from",
    "paged_attention",
    "sequence_mask",
    "step_metadata",
    "write_kv",
    "zero_blocks",
]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    stored: bool = False,
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (this step's, written into the caches first);
    caches: [blocks, block_size, kv_heads, head_dim]; window: the layer's attention window (windows.py), None for
    full attention; softcap: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2), None
    for plain scores; k_scale, v_scale: the layer's FP8 cache scales (fp8_cache.py), unused by caches in another
    dtype; rotary: (cos, sin) [T, head_dim] when q and k are not rotated yet (the Triton backend rotates them in
    place as it stores k, kv_store.rotate_and_store_kv), None when they are; stored: k and v are in the caches
    already (the Triton backend only, quant/qkv_rotary.py). Returns [T, heads, head_dim]."""
    if meta.kernel is not None:
        return meta.kernel.attend(
            q, k, v, k_cache, v_cache, scale, window, softcap, k_scale, v_scale, rotary=rotary, stored=stored
        )
    if stored:
        raise ValueError("keys and values stored before attention need the Triton backend's metadata")
    if rotary is not None:
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
    return portable_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap, k_scale, v_scale)


def resolve_backend(requested: str, device: torch.device) -> str:
    """TRITON or VANILLA for `attn_backend` (validated, upper case): TRTLLM, TensorRT-LLM's default, picks TRITON
    where its kernels run (CUDA with triton installed) and VANILLA elsewhere; TRITON where they cannot run is a
    ConfigError that says why."""
    from ...config import ConfigError
    from .triton_backend import triton_usable

    problem = triton_usable(device)
    if requested == "TRTLLM":
        return "TRITON" if problem is None and device.type == "cuda" else "VANILLA"
    if requested == "TRITON" and problem is not None:
        raise ConfigError(f"attn_backend='TRITON': {problem}")
    return requested
