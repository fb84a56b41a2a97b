"""Triton paged attention for decode steps: one query a sequence, its keys cut into splits that run side by side
(enough programs to fill the GPU at any batch), their partial results merged. Layouts and semantics: tile_ops.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gpu_fence import count_slice
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
# Several splits are merged by the last of them to finish (an atomic counter a (sequence, KV head)) rather than by
# a launch of their own: at batch 1 the merge launch costs ~2.6 us a layer (H200 profile, twenty-ninth session).
# A first version, where all NUM_SPLITS splits counted and the last merged all 32 partials, was slower on an H100
# (twenty-fifth session); here only the splits holding keys count and merge (4 at a 256-token context): +0.9% for
# W4A16 at batch 1 on an H100, bf16 unchanged (thirty-sixth session, docs/benchmarks.md). No H200 has timed it.
MERGE_IN_LAST_SPLIT = True
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
    arrivals,
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
    MERGE_HERE: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Program (sequence, KV head, split): the group's query heads over the split's share of the keys it sees
    (all, or WINDOWED the last `window`). Those keys are cut into NUM_SPLITS equal runs of whole BLOCK_N tiles;
    one split writes `out` directly, several write fp32 partials (normalised output and base-2 log-sum-exp, -inf
    for an empty run). MERGE_HERE: the last split of a (sequence, KV head) to finish merges them (_merge_if_last),
    instead of a merge launch."""
    begin(RELEASE, WAIT)  # (pdl.py)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, first_key, split_len, active = _splits_of(seq_lens, seq, window, NUM_SPLITS, BLOCK_N, WINDOWED)
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
        first_part = (seq * num_heads + head) * NUM_SPLITS  # [S, heads, NUM_SPLITS] scratch rows
        part = first_part + split
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        # Only the splits that hold keys store (one stands for a sequence without keys): at a short context most
        # of the NUM_SPLITS (sized for the longest) end here, and the merge reads few partials.
        if split < active:
            _store_partial(part_out, part_lse, part, result, lse, head_ok, d, d_ok, HEAD_DIM)
        if MERGE_HERE:
            if split < active:
                arrival = arrivals + seq * tl.num_programs(1) + kv_head
                out_rows = out + seq * stride_os + head * stride_oh
                _merge_if_last(
                    part_out,
                    part_lse,
                    out_rows,
                    arrival,
                    first_part,
                    active,
                    head_ok,
                    d,
                    d_ok,
                    HEAD_DIM,
                    GROUP_P,
                    BLOCK_D,
                    UPCAST,  # on CPU: in the interpreter
                )


@triton.jit
def _splits_of(seq_lens, seq, window, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """How the sequence's keys are split: its length, its first key seen (WINDOWED: the last `window`), the keys a
    split (whole BLOCK_N tiles) and the splits holding any (at least 1)."""
    seq_len = tl.load(seq_lens + seq)
    if WINDOWED:
        first_key = tl.maximum(seq_len - window, 0)
    else:
        first_key = seq_len * 0
    split_len = tl.cdiv(tl.cdiv(seq_len - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
    active = tl.maximum(tl.cdiv(seq_len - first_key, tl.maximum(split_len, 1)), 1)
    return seq_len, first_key, split_len, active


@triton.jit
def _store_partial(part_out, part_lse, part, result, lse, head_ok, d, d_ok, HEAD_DIM: tl.constexpr):
    """A split's normalised output and base-2 log-sum-exp for the group's heads, into their scratch rows."""
    tl.store(part_out + part[:, None] * HEAD_DIM + d[None, :], result, mask=head_ok[:, None] & d_ok[None, :])
    tl.store(part_lse + part, lse, mask=head_ok)


@triton.jit
def _merge_if_last(
    part_out,
    part_lse,
    out_rows,
    arrival,
    first_part,
    active,
    head_ok,
    d,
    d_ok,
    HEAD_DIM: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Count this split in at `arrival` (its (sequence, KV head)'s counter) as a split-K slice is counted
    (gpu_fence.count_slice: every thread's partial stores ordered before the count); the last of the `active`
    splits to arrive merges their partials of the group's heads into `out_rows` and sets the counter back to 0 for
    the next launch. Its loads bypass L1 (.cg), which may hold lines another SM has since rewritten."""
    if count_slice(arrival, 0, INTERPRETED) == active - 1:
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
        for split in range(0, active):
            part = first_part + split
            lse = tl.load(part_lse + part, mask=head_ok, other=float("-inf"), cache_modifier=".cg")
            ok = head_ok[:, None] & d_ok[None, :]
            values = tl.load(part_out + part[:, None] * HEAD_DIM + d[None, :], mask=ok, other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, lse)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha, weight = tl.exp2(m - shift), tl.exp2(lse - shift)
            acc = acc * alpha[:, None] + weight[:, None] * values
            total = total * alpha + weight
            m = m_new
        merged = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            out_rows[:, None] + d[None, :], merged.to(out_rows.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :]
        )
        tl.store(arrival, 0)


@triton.jit
def _decode_merge_kernel(
    part_out,
    part_lse,
    out,
    seq_lens,
    window,
    num_heads,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P: tl.constexpr,
    WINDOWED: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Program (sequence, head): the partial outputs of the splits that hold keys (_splits_of: only they
    stored any), weighted by their share of the softmax sum; a sequence with no keys at all gets zeros."""
    begin(RELEASE, WAIT)  # the output projection after it may start reading its weights (pdl.py)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    _, _, _, active = _splits_of(seq_lens, seq, window, NUM_SPLITS, BLOCK_N, WINDOWED)
    split = tl.arange(0, SPLITS_P)
    split_ok = split < active
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


# The merging splits' counters, one int32 a (sequence, KV head), zero between launches (the last split resets its
# own): one buffer a device, shared by every layer and CUDA graph, since a stream runs one launch at a time. A
# buffer outgrown is kept: graphs captured over it still point there.
_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []
MIN_ARRIVALS = 4096  # 512 sequences of 8 KV heads: enough for every graph of a usual batch


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed int32 counters on `device` for the merging splits (see _ARRIVALS)."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < count:
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(count, MIN_ARRIVALS), dtype=torch.int32, device=device)
        _ARRIVALS[device] = counters
    return counters


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
    block_n = DECODE_BLOCK_N if block_d <= 128 else DECODE_BLOCK_N // 2
    upcast = q.device.type != "cuda"
    merge_here = splits > 1 and MERGE_IN_LAST_SPLIT
    arrivals = arrival_counters(q.device, num_seqs * num_kv_heads) if merge_here else seq_lens  # (unused if not)
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
        arrivals,
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
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        UPCAST=upcast,
        IEEE=upcast or q.dtype == torch.float32,
        FP16_TILES=FP8_DECODE_IN_FP16 and is_fp8(k_cache) and not upcast and q.dtype != torch.float32,
        MERGE_HERE=merge_here,
        num_warps=DECODE_NUM_WARPS_FP8 if is_fp8(k_cache) else DECODE_NUM_WARPS,
        num_stages=DECODE_NUM_STAGES,
        **small_kernel_args(q.device),
    )
    if splits > 1 and not merge_here:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_out,
            part_lse,
            out,
            seq_lens,
            window or 0,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            NUM_SPLITS=splits,
            SPLITS_P=triton.next_power_of_2(splits),
            WINDOWED=window is not None,
            num_warps=4,
            **small_kernel_args(out.device),
        )
    return out
