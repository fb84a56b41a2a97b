"""Writing a step's keys and values into the paged KV caches in one launch (quantized into FP8 caches)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import begin, small_kernel_args
from .fp8_cache import is_fp8
from .tile_ops import FP8_MAX


@triton.jit
def _store_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ks,
    stride_kc,
    stride_vs,
    stride_vc,
    num_kv_heads,
    k_inv_scale,
    v_inv_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Program (token): its K and V rows [kv_heads, head_dim] into the caches at its slot (slot s of the caches
    viewed as [slots, kv_heads, head_dim]: stride_ks per slot, stride_kc per head); QUANTIZE (FP8 caches):
    times 1 / scale and clamped first."""
    begin(RELEASE, WAIT)  # (pdl.py)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    head = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    ok = (head < num_kv_heads) & (d < HEAD_DIM)
    key = tl.load(k + token * stride_kt + head * stride_kh + d, mask=ok)
    if QUANTIZE:
        key = _scaled_in_range(key, k_inv_scale).to(k_cache.dtype.element_ty)
    tl.store(k_cache + slot * stride_ks + head * stride_kc + d, key, mask=ok)
    value = tl.load(v + token * stride_vt + head * stride_vh + d, mask=ok)
    if QUANTIZE:
        value = _scaled_in_range(value, v_inv_scale).to(v_cache.dtype.element_ty)
    tl.store(v_cache + slot * stride_vs + head * stride_vc + d, value, mask=ok)


@triton.jit
def _scaled_in_range(x, inv_scale):
    """fp8_cache.quantize before its rounding: x * (1 / scale) in fp32, clamped to +-FP8_MAX."""
    scaled = x.to(tl.float32) * inv_scale
    return tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """portable.write_kv in one launch: k, v [T, kv_heads, head_dim] (last dim contiguous, any token and head
    strides: views of a fused qkv output) at slots slot_mapping [T] of caches [blocks, block_size, kv_heads,
    head_dim] whose blocks are contiguous runs of slots; into FP8 caches quantized with k_scale, v_scale."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"keys {tuple(k.shape)} and values {tuple(v.shape)} (contiguous head_dim) do not fit the "
            f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"the key cache is {k_cache.dtype} but the value cache {v_cache.dtype}")
    for cache in (k_cache, v_cache):
        if cache.stride(0) != cache.shape[1] * cache.stride(1) or cache.stride(-1) != 1:
            raise ValueError("a KV cache's blocks must be contiguous runs of slots")
    if num_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        num_kv_heads,
        1.0 / k_scale,
        1.0 / v_scale,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        QUANTIZE=is_fp8(k_cache),
        num_warps=1 if block_h * block_d <= 256 else 4,
        **small_kernel_args(k.device),
    )
