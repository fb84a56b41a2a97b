"""Triton paged attention for decode steps: one query a sequence, its keys cut into splits that run side by side
(enough programs to fill the GPU at any batch), their partial results merged. Layouts and semantics: tile_ops.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import begin, small_kernel_args
from .fp8_cache import is_fp8
from .tile_ops import (
    LOG2E,
    STEP_ARGS,
    check_layouts,
    group_size,
    key_slots,
    load_kv,
    online_softmax,
    padded_head_dim,
    softcap_args,
    tile_scores,
)

# Decode: an H200 has 132 SMs; it takes a few resident programs an SM to keep its memory pipes busy.
NUM_SMS = 132
DECODE_TARGET_PROGRAMS = 4 * NUM_SMS
MAX_DECODE_SPLITS = 32
MIN_SPLIT_KEYS = 128  # a split shorter than this costs more in setup and merging than it saves
DECODE_BLOCK_N = 64
# Warps a decode program: an H200 sweep (docs/gpu-runs.md, seventeenth session) found 4 best over bf16 caches but
# 2 over fp8 ones (0.050 against 0.073 ms at batch 256, context 256; 0.167 against 0.262 at 1k): halved tiles
# leave a 4-warp program too little to load, and more programs fit an SM.
DECODE_NUM_WARPS = 4
DECODE_NUM_WARPS_FP8 = 2
DECODE_NUM_STAGES = 2
# FP8 caches: tiles widened to fp16 rather than to the queries' bf16 (one instruction a pair; e4m3 is exact in fp16).
FP8_DECODE_IN_FP16 = True


@triton.jit(do_not_specialize=STEP_ARGS)
def _decode_split_kernel(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    out,
    part_out,
    part_lse,
    scale_log2,
    v_scale,
    cap_log2,
    scale_over_cap,
    window,
    num_heads,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    FP16_TILES: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Program (sequence, KV head, split): the group's query heads over the split's share of the keys it sees
    (all, or WINDOWED the last `window`). Those keys are cut into NUM_SPLITS equal runs of whole BLOCK_N tiles;
    one split writes `out` directly, several write fp32 partials (normalised output and base-2 log-sum-exp, -inf
    for an empty run)."""
    begin(RELEASE, WAIT)  # (pdl.py)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    if WINDOWED:
        first_key = tl.maximum(seq_len - window, 0)
    else:
        first_key = seq_len * 0
    split_len = tl.cdiv(tl.cdiv(seq_len - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first_key + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    member = tl.arange(0, GROUP_P)
    head = kv_head * GROUP + member
    head_ok = member < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    queries = tl.load(
        q + seq * stride_qs + head[:, None] * stride_qh + d[None, :], mask=head_ok[:, None] & d_ok[None, :], other=0.0
    )
    if UPCAST:
        queries = queries.to(tl.float32)
    elif FP16_TILES:  # float8 tiles widen to fp16 in one instruction a pair (to bf16 they take several)
        queries = tl.clamp(queries.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    table_row = block_tables + seq * stride_table
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        block, offset = key_slots(table_row, keys, key_ok, BLOCK_SIZE)
        k = load_kv(k_cache, block, offset, kv_head, stride_kb, stride_ks, stride_kh, d, key_ok, d_ok, UPCAST)
        v = load_kv(v_cache, block, offset, kv_head, stride_vb, stride_vs, stride_vh, d, key_ok, d_ok, UPCAST)
        k, v = k.to(queries.dtype), v.to(queries.dtype)  # an FP8 cache's tiles widened (a no-op otherwise)
        scores = tile_scores(queries, k, scale_log2, cap_log2, scale_over_cap, SOFTCAP, IEEE)
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m, l, acc = online_softmax(scores, v, m, l, acc, IEEE)

    result = acc / tl.where(l > 0, l, 1.0)[:, None] * v_scale
    if NUM_SPLITS == 1:
        tl.store(
            out + seq * stride_os + head[:, None] * stride_oh + d[None, :],
            result.to(out.dtype.element_ty),
            mask=head_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (seq * num_heads + head) * NUM_SPLITS + split  # [S, heads, NUM_SPLITS] scratch row
        tl.store(part_out + part[:, None] * HEAD_DIM + d[None, :], result, mask=head_ok[:, None] & d_ok[None, :])
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse + part, lse, mask=head_ok)


@triton.jit
def _decode_merge_kernel(
    part_out,
    part_lse,
    out,
    num_heads,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Program (sequence, head): the splits' partial outputs weighted by their share of the softmax sum. Empty
    splits (lse -inf) weigh 0; a sequence with no keys at all gets zeros."""
    begin(RELEASE, WAIT)  # the output projection after it may start reading its weights (pdl.py)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.arange(0, SPLITS_P)
    split_ok = split < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = (seq * num_heads + head) * NUM_SPLITS + split
    lse = tl.load(part_lse + part, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(part_out + part[:, None] * HEAD_DIM + d[None, :], mask=split_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(weight, 0)
    merged = tl.sum(weight[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + seq * stride_os + head * stride_oh + d, merged.to(out.dtype.element_ty), mask=d_ok)


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """How many key ranges each (sequence, KV head) of a decode step is split into: enough programs to cover
    DECODE_TARGET_PROGRAMS (4 per H200 SM), each range at least MIN_SPLIT_KEYS of max_seq_len keys, at most
    MAX_DECODE_SPLITS; 1 once num_seqs * num_kv_heads fills the target alone; rounded down to a power of two (the
    count is a compile-time constant: few values, few compiled variants). Host ints only, so a CUDA graph's
    launches are the same on every replay."""
    wanted = triton.cdiv(DECODE_TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    by_length = triton.cdiv(max(1, max_seq_len), MIN_SPLIT_KEYS)
    splits = max(1, min(wanted, by_length, MAX_DECODE_SPLITS))
    return 1 << (splits.bit_length() - 1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query a sequence: q [S, heads, head_dim], the query of sequence s at position seq_lens[s] - 1 seeing
    keys 0 .. seq_lens[s] - 1 (with `window`, only the last `window` of them; `softcap`: scores capped as
    softcap * tanh(scores / softcap)). max_seq_len: a host upper bound of seq_lens (e.g. W * block_size), which
    fixes the split count (decode_splits). k_scale, v_scale: an FP8 cache's (1.0 for others). Returns out
    [S, heads, head_dim] in q's dtype."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = group_size(num_heads, num_kv_heads)
    check_layouts(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    splits = decode_splits(num_seqs, num_kv_heads, max_seq_len)
    block_d = padded_head_dim(head_dim)
    upcast = q.device.type != "cuda"
    if splits == 1:
        part_out, part_lse = out, out  # unused: the kernel writes out directly
    else:
        part_out = torch.empty((num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E * k_scale,
        v_scale,
        *softcap_args(scale * k_scale, softcap),
        window or 0,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_P=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N if block_d <= 128 else DECODE_BLOCK_N // 2,
        NUM_SPLITS=splits,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        UPCAST=upcast,
        IEEE=upcast or q.dtype == torch.float32,
        FP16_TILES=FP8_DECODE_IN_FP16 and is_fp8(k_cache) and not upcast and q.dtype != torch.float32,
        num_warps=DECODE_NUM_WARPS_FP8 if is_fp8(k_cache) else DECODE_NUM_WARPS,
        num_stages=DECODE_NUM_STAGES,
        **small_kernel_args(q.device),
    )
    if splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            SPLITS_P=triton.next_power_of_2(splits),
            num_warps=4,
            **small_kernel_args(out.device),
        )
    return out
