"""The rotary embedding and the KV store in qkv_proj's one-row int4 GEMV, instead of a launch of their own after it
(attention/kv_store.py's rotate_and_store_kv, whose arithmetic this repeats bit for bit).

A one-row GEMV program computes BLOCK_N output rows of qkv. The rotation mixes rows i and i + head_dim / 2 of a
query or key head, so a program over those heads takes R = BLOCK_N / 2 rows from each half of one head: rows
j R .. j R + R - 1 of the head and the same rows plus head_dim / 2 (the weight is read where its rows are, not
reordered). Its epilogue rounds the products as the unfused GEMV stores them, rotates the pairs
(rotary_ops.rotated_halves), stores them where they belong in qkv's output and, for a key head, into the key cache
at the token's slot. Programs over the value heads take consecutive rows and store them into the output and the
value cache. Attention then reads the caches without storing (KernelMetadata.attend's `stored`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.fp8_cache import is_fp8
from ..attention.kv_store import RotaryStore, cache_values
from ..rotary_ops import rotated_halves


def rotary_fits(block_n: int, head_dim: int) -> bool:
    """A program of block_n rows can hold pairs of one head (and value programs stay inside one head)."""
    return block_n % 2 == 0 and head_dim % block_n == 0


def rotary_args(store: RotaryStore | None, out: torch.Tensor) -> tuple:
    """The decode kernel's rot_cos .. rot_v_inv arguments (out and zeros where unused)."""
    if store is None:
        return (out, out, out, out, out, 0, 0, 1.0, 1.0)
    cache = store.k_cache
    return (
        store.cos,
        store.sin,
        cache,
        store.v_cache,
        store.slot_mapping,
        cache.stride(1),
        cache.stride(2),
        1.0 / store.k_scale,
        1.0 / store.v_scale,
    )


def rotary_constants(store: RotaryStore | None) -> dict[str, int | bool]:
    """The decode kernel's ROTARY .. QUANTIZE_KV compile-time arguments (fixed placeholders where unused)."""
    if store is None:
        return dict(ROTARY=False, HEADS=1, KV_HEADS=1, HEAD_DIM=2, QUANTIZE_KV=False)
    return dict(
        ROTARY=True,
        HEADS=store.num_heads,
        KV_HEADS=store.num_kv_heads,
        HEAD_DIM=store.head_dim,
        QUANTIZE_KV=is_fp8(store.k_cache),
    )


@triton.jit
def rotary_rows(program, BLOCK_N: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The qkv rows program `program` computes: a run of R = BLOCK_N / 2 rows from each half of a query or key
    head (rows of the first half, then their partners), or BLOCK_N consecutive rows of the value heads."""
    PER_HEAD: tl.constexpr = HEAD_DIM // BLOCK_N
    R: tl.constexpr = BLOCK_N // 2
    r = tl.arange(0, BLOCK_N)
    paired = (program // PER_HEAD) * HEAD_DIM + (program % PER_HEAD) * R + (r % R) + (r // R) * (HEAD_DIM // 2)
    return tl.where(program < (HEADS + KV_HEADS) * PER_HEAD, paired, program * BLOCK_N + r)


@triton.jit
def rotate_and_store(
    y,
    cols,
    program,
    out,
    cos,
    sin,
    k_cache,
    v_cache,
    slot_mapping,
    stride_cs,
    stride_ch,
    k_inv_scale,
    v_inv_scale,
    BLOCK_N: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANTIZE_KV: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """One program's end: y [BLOCK_N] fp32, the products of qkv rows `cols` (rotary_rows) for the one token;
    stores them rotated (query and key heads) into out [1, N] and the key and value heads into the caches at the
    token's slot, as rotate_and_store_kv does after an unfused GEMV."""
    dtype = out.dtype.element_ty
    stored = y.to(dtype)  # qkv's output as the unfused GEMV stores it
    rounded = stored.to(tl.float32)
    slot = tl.load(slot_mapping).to(tl.int64)
    PER_HEAD: tl.constexpr = HEAD_DIM // BLOCK_N
    HALF: tl.constexpr = HEAD_DIM // 2
    R: tl.constexpr = BLOCK_N // 2
    if program < (HEADS + KV_HEADS) * PER_HEAD:
        head = program // PER_HEAD
        d = (program % PER_HEAD) * R + tl.arange(0, R)
        x1, x2 = tl.split(tl.trans(tl.reshape(rounded, (2, R))))
        cos1, cos2 = tl.load(cos + d).to(tl.float32), tl.load(cos + d + HALF).to(tl.float32)
        sin1, sin2 = tl.load(sin + d).to(tl.float32), tl.load(sin + d + HALF).to(tl.float32)
        out1, out2 = rotated_halves(x1, x2, cos1, cos2, sin1, sin2, dtype, ROUND_BF16)
        row = out + head * HEAD_DIM + d
        tl.store(row, out1)
        tl.store(row + HALF, out2)
        if head >= HEADS:
            cached = k_cache + slot * stride_cs + (head - HEADS) * stride_ch + d
            tl.store(cached, cache_values(out1, k_inv_scale, k_cache, QUANTIZE_KV))
            tl.store(cached + HALF, cache_values(out2, k_inv_scale, k_cache, QUANTIZE_KV))
    else:
        tl.store(out + cols, stored)
        values = cols - (HEADS + KV_HEADS) * HEAD_DIM
        cached = v_cache + slot * stride_cs + (values // HEAD_DIM) * stride_ch + values % HEAD_DIM
        tl.store(cached, cache_values(stored, v_inv_scale, v_cache, QUANTIZE_KV))
