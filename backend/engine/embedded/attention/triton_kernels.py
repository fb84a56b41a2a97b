"""Triton paged attention: decode (split-KV, one query a sequence) and prefill / extend (any number of queries a
sequence, draft trees), both reading K/V in place through the block tables. They compute what the portable path
(portable.py) computes.

Layouts (one layer):
- q, out: [T, heads, head_dim], last dim contiguous. Query head h reads KV head h // (heads // kv_heads) (GQA).
- k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim], last dim contiguous. Position p of sequence s
  lives at block `block_tables[s, p // block_size]`, offset `p % block_size`. This step's K/V are already written
  (`write_kv`), so every key is read from the caches.
- block_tables: [S, W] int32 or int64, padded with 0; seq_lens: [S]: sequence s has keys at positions
  0 .. seq_lens[s] - 1. Slots at later positions are never read (they may hold another sequence's data, NaN).

Semantics: softmax(q k^T * scale) v in fp32 (online softmax in base 2), output in q's dtype; with a softcap c
(Gemma 2) the scores are c * tanh(q k^T * scale / c) before anything is hidden. Decode: the query of
sequence s sits at position seq_lens[s] - 1 and sees every key. Prefill: query i of sequence s sits at position
seq_lens[s] - query_lens[s] + i and sees keys at positions <= its own, except in a draft tree (TreeMasks): the last
n queries see every key before the tree and, among the tree's n keys, those their mask row allows.
With a window W (a layer's attention window, attention/windows.py) a query at position p sees, of those, only the
keys at positions > p - W; a draft node's p is its root's position plus its depth (the step's `positions`).

Both kernels group the query heads that share a KV head into the rows of one program, so each K/V tile is loaded
once per KV head, and are CUDA-graph capturable: grids and constexprs depend on shapes and host ints only, scratch
comes from torch.empty, nothing syncs with the host.

FP8 caches (fp8_cache.py): the store quantizes (x / scale, clamped to +-448, rounded to float8 e4m3); the
attention kernels load float8 tiles and widen them to the queries' dtype, with k_scale folded into the score
scale and v_scale applied to the output (both linear), so the inner loop does no extra multiply. Decode widens
them to fp16 instead (FP8_DECODE_IN_FP16), queries and probabilities converted to fp16 too: e4m3 values are
exact in fp16, and the widening is one instruction a pair where bf16's takes several. The scales are
host floats fixed at load, so CUDA graphs capture them.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported). Its bfloat16
arithmetic is wrong, so there (UPCAST) every loaded value is converted to fp32 first and dots run in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ..pdl import begin, small_kernel_args
from .fp8_cache import FP8_MAX as _FP8_MAX
from .fp8_cache import is_fp8

LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(_FP8_MAX)

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

# Prefill: a program holds PREFILL_ROWS (token, head) rows (more only when one padded head group alone is larger),
# so TOKENS_PER_TILE = PREFILL_ROWS // padded group size: 128 for MHA, 64 for groups of 2, 16 for groups of 5-8.
PREFILL_ROWS = 128
PREFILL_BLOCK_N = 64
FP8_DECODE_IN_FP16 = True
TREE_BLOCK_N = 16  # tree keys go in narrow tiles: each gathers a [rows, TREE_BLOCK_N] block of mask bytes


# ----------------------------------------------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; IEEE: fp32 operands without tf32 rounding."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _scores(queries, k, scale_log2, cap_log2, scale_over_cap, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """q k^T * scale in base 2 (times log2(e)); SOFTCAP: softcap * tanh(q k^T * scale / softcap) in base 2
    (cap_log2 = softcap * log2(e), scale_over_cap = scale / softcap), tanh(x) as 2 sigmoid(2x) - 1."""
    raw = _dot(queries, tl.trans(k), IEEE)
    if SOFTCAP:
        scores = (2.0 * tl.sigmoid(2.0 * raw * scale_over_cap) - 1.0) * cap_log2
    else:
        scores = raw * scale_log2
    return scores


@triton.jit
def _key_slots(table_row, keys, key_ok, BLOCK_SIZE: tl.constexpr):
    """(block id as int64, offset in block) of each key position, through the sequence's block table row."""
    block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    return block, keys % BLOCK_SIZE


@triton.jit
def _load_kv(
    cache, block, offset, kv_head, stride_block, stride_slot, stride_head, d, key_ok, d_ok, UPCAST: tl.constexpr
):
    """[BLOCK_N, BLOCK_D] rows of one KV head at the given slots; masked keys are not read (0)."""
    rows = block * stride_block + offset * stride_slot + kv_head * stride_head
    tile = tl.load(cache + rows[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def _online_softmax(scores, v, m, l, acc, IEEE: tl.constexpr):
    """Fold one key tile (base-2 scores, -inf where hidden) into the running max m, sum l and output acc.
    A row that has seen no visible key yet keeps m = -inf, l = 0, acc = 0 (the shift avoids -inf - -inf)."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - shift[:, None])
    alpha = tl.exp2(m - shift)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


# ----------------------------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------------------------

# Arguments that change from step to step are not specialised on (Triton compiles a variant per value of 1, per
# multiple of 16 and per 16-byte alignment of a pointer): the step's metadata are views into one uploaded buffer
# at varying offsets, and table widths and counts vary, so specialising recompiled kernels mid-run (a second each).
_STEP_ARGS = ["block_tables", "seq_lens", "stride_table", "window"]
_PREFILL_STEP_ARGS = _STEP_ARGS + [
    "query_starts",
    "query_lens",
    "tile_seqs",
    "tile_starts",
    "tree_lens",
    "tree_starts",
    "tree_masks",
    "num_seqs",
    "num_rows",
    "positions",
]


@triton.jit(do_not_specialize=_STEP_ARGS)
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
        block, offset = _key_slots(table_row, keys, key_ok, BLOCK_SIZE)
        k = _load_kv(k_cache, block, offset, kv_head, stride_kb, stride_ks, stride_kh, d, key_ok, d_ok, UPCAST)
        v = _load_kv(v_cache, block, offset, kv_head, stride_vb, stride_vs, stride_vh, d, key_ok, d_ok, UPCAST)
        k, v = k.to(queries.dtype), v.to(queries.dtype)  # an FP8 cache's tiles widened (a no-op otherwise)
        scores = _scores(queries, k, scale_log2, cap_log2, scale_over_cap, SOFTCAP, IEEE)
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        m, l, acc = _online_softmax(scores, v, m, l, acc, IEEE)

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
    group = _group_size(num_heads, num_kv_heads)
    _check_layouts(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    splits = decode_splits(num_seqs, num_kv_heads, max_seq_len)
    block_d = _block_d(head_dim)
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
        *_softcap_args(scale * k_scale, softcap),
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


# ----------------------------------------------------------------------------------------------------------------
# Prefill / extend
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TreeMasks:
    """Draft trees of a step on the device. Sequence s with lens[s] = n > 0 has its last n queries (key positions
    seq_lens[s] - n .. seq_lens[s] - 1) as a tree, whose n x n row-major mask is masks[starts[s] : starts[s] + n*n]
    (row a sees tree key b iff nonzero). lens[s] = 0: no tree. The kernel reads nothing else of `masks`, so a CUDA
    graph can keep all three in static tensors (masks as large as the largest step needs) and copy each step in."""

    lens: torch.Tensor  # [S] int32
    starts: torch.Tensor  # [S] int32
    masks: torch.Tensor  # flat uint8 (or bool)


def tree_mask_arrays(per_seq_masks: list[torch.Tensor | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The TreeMasks layout on the host, from each sequence's [n, n] bool mask (None: no tree): lens and starts
    (int32) and the flat masks (uint8, one spare byte at the end so the kernel always gets a real pointer). The
    portable path's `AttentionMetadata.tail_masks` are exactly these per-sequence masks."""
    flat = [
        np.zeros(0, np.uint8) if m is None else m.detach().to("cpu", torch.bool).numpy().reshape(-1)
        for m in per_seq_masks
    ]
    lens = np.array([0 if m is None else m.shape[0] for m in per_seq_masks], np.int32)
    sizes = np.array([f.size for f in flat], np.int64)
    starts = (np.cumsum(sizes) - sizes).astype(np.int32)
    return lens, starts, np.concatenate(flat + [np.zeros(1, np.uint8)]).astype(np.uint8)


def tree_masks(per_seq_masks: list[torch.Tensor | None], device) -> TreeMasks:
    """TreeMasks from each sequence's [n, n] bool mask (tree_mask_arrays), copied in one transfer."""
    num_seqs = len(per_seq_masks)
    lens, starts, body = tree_mask_arrays(per_seq_masks)
    # One uint8 buffer: lens and starts as int32 (8 bytes a sequence, aligned at 0), then the masks.
    header = np.concatenate([lens, starts]).view(np.uint8)
    buffer = torch.from_numpy(np.concatenate([header, body])).to(device)
    ints = buffer[: header.size].view(torch.int32)
    return TreeMasks(lens=ints[:num_seqs], starts=ints[num_seqs:], masks=buffer[header.size :])


def tokens_per_tile(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens in one prefill tile: PREFILL_ROWS (token, head) rows over the head group padded to a power of
    two (at least one token). prefill_tiles and prefill_attention both use this, so tiles and launch agree."""
    return max(1, PREFILL_ROWS // triton.next_power_of_2(_group_size(num_heads, num_kv_heads)))


def prefill_tiles(
    query_lens, num_heads: int, num_kv_heads: int, tokens_per_seq: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The tiles of one prefill_attention launch: (tile_seqs, tile_starts) int32 host arrays, tile j covering
    tokens tile_starts[j] .. + tokens_per_tile(num_heads, num_kv_heads) - 1 of sequence tile_seqs[j]. With
    tokens_per_seq=R (CUDA graphs: R query rows reserved a sequence) the tiles cover R rows of every sequence
    whatever its query_lens, so the list is the same on every step."""
    tokens = tokens_per_tile(num_heads, num_kv_heads)
    rows = np.asarray(query_lens, np.int64) if tokens_per_seq is None else np.full(len(query_lens), tokens_per_seq)
    counts = -(-rows // tokens)
    first_tile = np.cumsum(counts) - counts
    tile_seqs = np.repeat(np.arange(len(rows)), counts)
    tile_starts = (np.arange(counts.sum()) - np.repeat(first_tile, counts)) * tokens
    return tile_seqs.astype(np.int32), tile_starts.astype(np.int32)


# What a prefill key tile masks: nothing (every row sees every key), causal order, or the draft tree.
ALL_VISIBLE = tl.constexpr(0)
CAUSAL = tl.constexpr(1)
TREE = tl.constexpr(2)


@triton.jit
def _prefill_tile(
    queries,
    k_cache,
    v_cache,
    table_row,
    start,
    end,
    kv_head,
    token,
    q_pos,
    tree_row,
    tree_first,
    tree_key0,
    tree_n,
    tree_mask,
    row_lo,
    m,
    l,
    acc,
    scale_log2,
    cap_log2,
    scale_over_cap,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    d,
    d_ok,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Fold keys start .. start + BLOCK_N - 1 (those < end) into the running softmax, hiding per MASK and, WINDOWED,
    the keys before each row's first visible one (row_lo); keys before every row's are not even read."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < end
    if WINDOWED:
        key_ok = key_ok & (keys >= tl.min(row_lo, 0))
    block, offset = _key_slots(table_row, keys, key_ok, BLOCK_SIZE)
    k = _load_kv(k_cache, block, offset, kv_head, stride_kb, stride_ks, stride_kh, d, key_ok, d_ok, UPCAST)
    v = _load_kv(v_cache, block, offset, kv_head, stride_vb, stride_vs, stride_vh, d, key_ok, d_ok, UPCAST)
    k, v = k.to(queries.dtype), v.to(queries.dtype)  # an FP8 cache's tiles widened (a no-op otherwise)
    scores = _scores(queries, k, scale_log2, cap_log2, scale_over_cap, SOFTCAP, IEEE)
    if MASK == CAUSAL:  # causal tiles end before the tree: tree rows see all of their keys
        visible = (keys[None, :] <= q_pos[:, None]) | tree_row[:, None]
    if MASK == TREE:  # tree tiles start at the tree's first key: rows before the tree see none of them
        bits = tl.load(
            tree_mask + (token - tree_first)[:, None] * tree_n + (keys - tree_key0)[None, :],
            mask=tree_row[:, None] & key_ok[None, :],
            other=0,
        )
        visible = bits != 0
    if MASK != ALL_VISIBLE:
        if WINDOWED:
            visible = visible & (keys[None, :] >= row_lo[:, None])
        scores = tl.where(visible & key_ok[None, :], scores, float("-inf"))
    elif WINDOWED:
        scores = tl.where((keys[None, :] >= row_lo[:, None]) & key_ok[None, :], scores, float("-inf"))
    return _online_softmax(scores, v, m, l, acc, IEEE)


@triton.jit(do_not_specialize=_PREFILL_STEP_ARGS)
def _prefill_kernel(
    q,
    k_cache,
    v_cache,
    out,
    block_tables,
    query_starts,
    query_lens,
    seq_lens,
    tile_seqs,
    tile_starts,
    tree_lens,
    tree_starts,
    tree_masks,
    positions,
    num_seqs,
    num_rows,
    scale_log2,
    v_scale,
    cap_log2,
    scale_over_cap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
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
    TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TREE_BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr,
    WINDOWED: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (tile, KV head): TOKENS query tokens of one sequence x the GROUP heads of this KV head (padded to
    GROUP_P) as TOKENS * GROUP_P rows. Keys run in three phases: those every real row sees (before the tile's
    first query and before any tree) unmasked, then causal up to the last key a row can see or the tree, then the
    tree's keys (only for a tile holding tree rows), in narrower tiles since each reads its mask bytes. WINDOWED,
    the keys start at the tile's first visible one, and every phase also hides what each row's window leaves out
    (measured from `positions` where HAS_POSITIONS, else from the row's key position)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seqs + tile)
    first = tl.load(tile_starts + tile)
    q_start = tl.load(query_starts + seq)
    q_len = tl.load(query_lens + seq)
    seq_len = tl.load(seq_lens + seq)
    # The sequence's rows in q run up to the next sequence's first row (the last one's: the end of q); rows past
    # its queries there (CUDA-graph padding) are written as zeros.
    next_start = tl.load(query_starts + seq + 1, mask=seq + 1 < num_seqs, other=num_rows)
    reserved = tl.maximum(next_start - q_start, q_len)

    row = tl.arange(0, TOKENS * GROUP_P)
    token = first + row // GROUP_P
    member = row % GROUP_P
    head = kv_head * GROUP + member
    real = (member < GROUP) & (token < q_len)
    q_pos = seq_len - q_len + token
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    queries = tl.load(
        q + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=real[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        queries = queries.to(tl.float32)

    if HAS_TREE:
        tree_n = tl.load(tree_lens + seq)
        tree_mask = tree_masks + tl.load(tree_starts + seq)
    else:
        tree_n = 0
        tree_mask = tree_masks
    tree_first = q_len - tree_n  # token index of the tree's root
    tree_key0 = seq_len - tree_n  # its key position
    tree_row = (token >= tree_first) & (token < q_len)
    last = tl.minimum(first + TOKENS, q_len) - 1  # the tile's last real token
    # Keys the tile reads: up to its last query's position, or the whole context once a tree row is in it; none
    # for a tile of padding rows only.
    hi = tl.where(last >= tree_first, seq_len, seq_len - q_len + last + 1)
    hi = tl.where(first < q_len, hi, 0)
    full_end = tl.minimum(tl.minimum(seq_len - q_len + first + 1, tree_key0) // BLOCK_N * BLOCK_N, hi)
    causal_end = tl.minimum(hi, tree_key0)
    if WINDOWED:
        if HAS_POSITIONS:
            pos = tl.load(positions + q_start + token, mask=real, other=0).to(tl.int32)
        else:
            pos = q_pos
        row_lo = tl.where(real, pos - window + 1, seq_len)  # each row's first visible key (padding rows: none)
        tile_lo = tl.maximum(tl.min(row_lo, 0), 0) // BLOCK_N * BLOCK_N
    else:
        row_lo = q_pos * 0
        tile_lo = seq_len * 0
    causal_start = tl.maximum(full_end, tile_lo)

    m = tl.full([TOKENS * GROUP_P], float("-inf"), tl.float32)
    l = tl.zeros([TOKENS * GROUP_P], tl.float32)
    acc = tl.zeros([TOKENS * GROUP_P, BLOCK_D], tl.float32)
    table_row = block_tables + seq * stride_table
    for start in range(tile_lo, full_end, BLOCK_N):
        m, l, acc = _prefill_tile(
            queries,
            k_cache,
            v_cache,
            table_row,
            start,
            full_end,
            kv_head,
            token,
            q_pos,
            tree_row,
            tree_first,
            tree_key0,
            tree_n,
            tree_mask,
            row_lo,
            m,
            l,
            acc,
            scale_log2,
            cap_log2,
            scale_over_cap,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            d,
            d_ok,
            BLOCK_SIZE,
            BLOCK_N,
            ALL_VISIBLE,
            WINDOWED,
            SOFTCAP,
            UPCAST,
            IEEE,
        )
    for start in range(causal_start, causal_end, BLOCK_N):
        m, l, acc = _prefill_tile(
            queries,
            k_cache,
            v_cache,
            table_row,
            start,
            causal_end,
            kv_head,
            token,
            q_pos,
            tree_row,
            tree_first,
            tree_key0,
            tree_n,
            tree_mask,
            row_lo,
            m,
            l,
            acc,
            scale_log2,
            cap_log2,
            scale_over_cap,
            stride_kb,
            stride_ks,
            stride_kh,
            stride_vb,
            stride_vs,
            stride_vh,
            d,
            d_ok,
            BLOCK_SIZE,
            BLOCK_N,
            CAUSAL,
            WINDOWED,
            SOFTCAP,
            UPCAST,
            IEEE,
        )
    if HAS_TREE:
        for start in range(tree_key0, hi, TREE_BLOCK_N):
            m, l, acc = _prefill_tile(
                queries,
                k_cache,
                v_cache,
                table_row,
                start,
                hi,
                kv_head,
                token,
                q_pos,
                tree_row,
                tree_first,
                tree_key0,
                tree_n,
                tree_mask,
                row_lo,
                m,
                l,
                acc,
                scale_log2,
                cap_log2,
                scale_over_cap,
                stride_kb,
                stride_ks,
                stride_kh,
                stride_vb,
                stride_vs,
                stride_vh,
                d,
                d_ok,
                BLOCK_SIZE,
                TREE_BLOCK_N,
                TREE,
                WINDOWED,
                SOFTCAP,
                UPCAST,
                IEEE,
            )

    result = acc / tl.where(l > 0, l, 1.0)[:, None] * v_scale
    result = tl.where(real[:, None], result, 0.0)
    keep = (member < GROUP) & (token < reserved)
    tl.store(
        out + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        result.to(out.dtype.element_ty),
        mask=keep[:, None] & d_ok[None, :],
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    tiles: tuple[torch.Tensor, torch.Tensor],
    tree: TreeMasks | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    positions: torch.Tensor | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Every sequence's queries of a step in one launch. q [T, heads, head_dim]; sequence s's queries are rows
    query_starts[s] .. + query_lens[s] - 1 (sequences in order: s's rows end where s + 1's begin, the last's at
    T), causal over its context except for its tree (TreeMasks). tiles: (tile_seqs, tile_starts) int32 device
    tensors from prefill_tiles. A tile's rows of its sequence past query_lens (up to the next sequence's first
    row) are written as zeros; rows no tile covers are left as they are. `window`: see the module's semantics;
    `positions` [T]: the queries' positions, needed with a window where a step has draft trees (without, a query's
    position is its key's); `softcap`: as decode_attention's. k_scale, v_scale: an FP8 cache's (1.0 for
    others). Returns out in q's dtype."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = _group_size(num_heads, num_kv_heads)
    _check_layouts(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    tile_seqs, tile_starts = tiles
    if tile_seqs.shape[0] == 0:
        return out
    tokens = tokens_per_tile(num_heads, num_kv_heads)
    group_p = triton.next_power_of_2(group)
    block_d = _block_d(head_dim)
    upcast = q.device.type != "cuda"
    if tree is None:
        tree_lens, tree_starts, masks = seq_lens, seq_lens, seq_lens  # unused (HAS_TREE off)
    else:
        tree_lens, tree_starts = tree.lens, tree.starts
        masks = tree.masks.view(torch.uint8) if tree.masks.dtype == torch.bool else tree.masks
    _prefill_kernel[(tile_seqs.shape[0], num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_starts,
        query_lens,
        seq_lens,
        tile_seqs,
        tile_starts,
        tree_lens,
        tree_starts,
        masks,
        seq_lens if positions is None else positions,  # unused unless HAS_POSITIONS
        query_starts.shape[0],
        num_rows,
        scale * LOG2E * k_scale,
        v_scale,
        *_softcap_args(scale * k_scale, softcap),
        window or 0,
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
        GROUP_P=group_p,
        TOKENS=tokens,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=PREFILL_BLOCK_N if block_d <= 128 else PREFILL_BLOCK_N // 2,
        TREE_BLOCK_N=TREE_BLOCK_N,
        HAS_TREE=tree is not None,
        WINDOWED=window is not None,
        HAS_POSITIONS=window is not None and positions is not None,
        SOFTCAP=softcap is not None,
        UPCAST=upcast,
        IEEE=upcast or q.dtype == torch.float32,
        num_warps=8 if tokens * group_p >= 128 else 4,
        num_stages=2,
    )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Storing a step's keys and values
# ----------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------
# Host helpers
# ----------------------------------------------------------------------------------------------------------------


def _softcap_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """(cap_log2, scale_over_cap) of the kernels' SOFTCAP scores (unused without a cap)."""
    if softcap is None:
        return 1.0, 1.0
    if softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    return softcap * LOG2E, scale / softcap


def _group_size(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    return num_heads // num_kv_heads


def _block_d(head_dim: int) -> int:
    """head_dim padded to a power of two, at least 16 (the smallest dot a GPU runs)."""
    return max(16, triton.next_power_of_2(head_dim))


def _check_layouts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the KV caches need a contiguous last (head_dim) dimension")
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"the key cache is {k_cache.dtype} but the value cache {v_cache.dtype}")
