"""Writing a step's keys and values into the paged KV caches in one launch (quantized into FP8 caches); or, with
the rotary embedding of its queries and keys done in that same launch, rotating them first (rotate_and_store_kv:
one small kernel fewer a layer at a decode step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..pdl import begin, small_kernel_args
from ..rotary_ops import check_rotary, load_rotation, rotate_pairs
from ..rounding import rounds_bf16_by_hand
from .fp8_cache import is_fp8
from .tile_ops import FP8_MAX

ROTATE_BLOCK = 1024  # (head, pair) elements a rotating program holds at most, as fused_ops.rotary_inplace's


@dataclass(frozen=True)
class RotaryStore:
    """What rotate_and_store_kv does to one step's fused qkv rows, handed to the projection that computes them
    (quant/qkv_rotary.py: the one-row int4 GEMV does it in its epilogue): cos, sin [T, head_dim], the caches,
    slot_mapping [T] and the FP8 scales, for num_heads query and num_kv_heads key and value heads."""

    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: float
    v_scale: float
    num_heads: int
    num_kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[-1]

    def check(self, qkv: torch.Tensor) -> None:
        """qkv [T, (heads + 2 kv_heads) head_dim] fits: the same checks as rotate_and_store_kv's."""
        d, heads, kv = self.head_dim, self.num_heads, self.num_kv_heads
        if qkv.dim() != 2 or qkv.shape[1] != (heads + 2 * kv) * d:
            raise ValueError(f"qkv {tuple(qkv.shape)} is not [tokens, ({heads} + 2 x {kv}) x {d}]")
        q, k, v = qkv.split([heads * d, kv * d, kv * d], dim=1)
        check_rotary("q", q.view(-1, heads, d), self.cos, self.sin)
        _check_store(k.view(-1, kv, d), v.view(-1, kv, d), self.k_cache, self.v_cache)
        if self.k_cache.stride() != self.v_cache.stride():
            raise ValueError("the key and value caches need the same strides")


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
    tl.store(
        k_cache + slot * stride_ks + head * stride_kc + d, cache_values(key, k_inv_scale, k_cache, QUANTIZE), mask=ok
    )
    value = tl.load(v + token * stride_vt + head * stride_vh + d, mask=ok)
    tl.store(
        v_cache + slot * stride_vs + head * stride_vc + d, cache_values(value, v_inv_scale, v_cache, QUANTIZE), mask=ok
    )


@triton.jit
def cache_values(x, inv_scale, cache, QUANTIZE: tl.constexpr):
    """x as the cache at `cache` stores it, in its dtype: QUANTIZE (FP8 caches) times 1 / scale and clamped first."""
    if QUANTIZE:
        return _scaled_in_range(x, inv_scale).to(cache.dtype.element_ty)
    return x.to(cache.dtype.element_ty)


@triton.jit
def _scaled_in_range(x, inv_scale):
    """fp8_cache.quantize before its rounding: x * (1 / scale) in fp32, clamped to +-FP8_MAX."""
    scaled = x.to(tl.float32) * inv_scale
    return tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)


@triton.jit
def _rotate_store_kv_kernel(
    q,
    k,
    v,
    cos,
    sin,
    k_cache,
    v_cache,
    slot_mapping,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_st,
    stride_ks,
    stride_kc,
    stride_vs,
    stride_vc,
    num_heads,
    num_kv_heads,
    k_inv_scale,
    v_inv_scale,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    QUANTIZE: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Program (token, head block): the first cdiv(num_heads, BLOCK_H) blocks rotate BLOCK_H query heads in place
    (rotary_ops.rotate_pairs, as fused_ops._rotary_kernel); the others BLOCK_H key heads, in place too, and store
    them and the same heads' values into the caches at the token's slot (_store_kv_kernel's placement and
    quantization). Every row is handled as its two halves [i] and [i + HALF], the pairs the rotation mixes."""
    begin(RELEASE, WAIT)  # (pdl.py)
    token = tl.program_id(0).to(tl.int64)
    q_blocks = tl.cdiv(num_heads, BLOCK_H)
    d = tl.arange(0, HALF_P)
    d_ok = d < HALF
    cos1, cos2, sin1, sin2 = load_rotation(cos, sin, token, stride_ct, stride_st, d, d_ok, HALF)
    if tl.program_id(1) < q_blocks:
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = (head < num_heads)[:, None] & d_ok[None, :]
        query = q + token * stride_qt + head[:, None] * stride_qh + d[None, :]
        rotate_pairs(query, ok, cos1, cos2, sin1, sin2, HALF, ROUND_BF16)
    else:
        head = (tl.program_id(1) - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = (head < num_kv_heads)[:, None] & d_ok[None, :]
        slot = tl.load(slot_mapping + token).to(tl.int64)
        key = k + token * stride_kt + head[:, None] * stride_kh + d[None, :]
        key1, key2 = rotate_pairs(key, ok, cos1, cos2, sin1, sin2, HALF, ROUND_BF16)
        key_slot = k_cache + slot * stride_ks + head[:, None] * stride_kc + d[None, :]
        _store_halves(key_slot, key1, key2, ok, k_inv_scale, HALF, QUANTIZE)
        value = v + token * stride_vt + head[:, None] * stride_vh + d[None, :]
        value1 = tl.load(value, mask=ok)
        value2 = tl.load(value + HALF, mask=ok)
        value_slot = v_cache + slot * stride_vs + head[:, None] * stride_vc + d[None, :]
        _store_halves(value_slot, value1, value2, ok, v_inv_scale, HALF, QUANTIZE)


@triton.jit
def _store_halves(cached, half1, half2, ok, inv_scale, HALF: tl.constexpr, QUANTIZE: tl.constexpr):
    """A row's two halves into a cache at `cached` and `cached + HALF` (cache_values)."""
    tl.store(cached, cache_values(half1, inv_scale, cached, QUANTIZE), mask=ok)
    tl.store(cached + HALF, cache_values(half2, inv_scale, cached, QUANTIZE), mask=ok)


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
    _check_store(k, v, k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
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


def rotate_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """fused_ops.rotary_inplace of q [T, heads, head_dim] and of k [T, kv_heads, head_dim] by cos, sin [T, head_dim],
    then store_kv of the rotated k and of v, in one launch: the same values, bit for bit. q, k and v as those two
    take them (last dim contiguous, token and head strides free: views of a fused qkv output), q and k of one dtype."""
    check_rotary("q", q, cos, sin)
    check_rotary("k", k, cos, sin)
    _check_store(k, v, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.dtype != k.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) need one dtype")
    if num_tokens == 0 or head_dim == 0:
        return
    half = head_dim // 2
    half_p = triton.next_power_of_2(half)
    # as rotary_inplace blocks heads; the key blocks carry the same heads' values too
    block_h = max(1, min(triton.next_power_of_2(max(num_heads, num_kv_heads)), ROTATE_BLOCK // half_p))
    head_blocks = triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h)
    _rotate_store_kv_kernel[(num_tokens, head_blocks)](
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slot_mapping,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(1),
        v_cache.stride(2),
        num_heads,
        num_kv_heads,
        1.0 / k_scale,
        1.0 / v_scale,
        HALF=half,
        HALF_P=half_p,
        BLOCK_H=block_h,
        QUANTIZE=is_fp8(k_cache),
        ROUND_BF16=rounds_bf16_by_hand(q),
        num_warps=4,
        **small_kernel_args(q.device),
    )


def _check_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What store_kv takes: k and v of one shape with a contiguous head_dim, caches of one shape and dtype whose
    blocks are contiguous runs of slots."""
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
