"""Triton paged attention for prefill and extend steps: any number of queries a sequence (prompts, chunks over a
cached prefix, decodes among them) and draft trees, in one launch for all of a step's sequences. Layouts and
semantics: tile_ops.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

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

# Prefill: a program holds PREFILL_ROWS (token, head) rows (more only when one padded head group alone is larger),
# so TOKENS_PER_TILE = PREFILL_ROWS // padded group size: 128 for MHA, 64 for groups of 2, 16 for groups of 5-8.
PREFILL_ROWS = 128
PREFILL_BLOCK_N = 64
TREE_BLOCK_N = 16  # tree keys go in narrow tiles: each gathers a [rows, TREE_BLOCK_N] block of mask bytes

PREFILL_STEP_ARGS = STEP_ARGS + [
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
    return max(1, PREFILL_ROWS // triton.next_power_of_2(group_size(num_heads, num_kv_heads)))


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
    kv,
    rows,
    tree,
    state,
    scoring,
    start,
    end,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Fold keys start .. start + BLOCK_N - 1 (those < end) into the running softmax state (m, l, acc), hiding
    per MASK and, WINDOWED, the keys before each row's first visible one (row_lo); keys before every row's are
    not even read. kv: the caches and where the tile's rows live (k_cache, v_cache, table_row, kv_head, their
    strides, d, d_ok); rows: (token, q_pos, tree_row, row_lo) of each row; tree: (tree_first, tree_key0,
    tree_n, tree_mask); scoring: tile_scores' (scale_log2, cap_log2, scale_over_cap)."""
    k_cache, v_cache, table_row, kv_head, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, d, d_ok = kv
    token, q_pos, tree_row, row_lo = rows
    tree_first, tree_key0, tree_n, tree_mask = tree
    m, l, acc = state
    scale_log2, cap_log2, scale_over_cap = scoring
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < end
    if WINDOWED:
        key_ok = key_ok & (keys >= tl.min(row_lo, 0))
    block, offset = key_slots(table_row, keys, key_ok, BLOCK_SIZE)
    k = load_kv(k_cache, block, offset, kv_head, stride_kb, stride_ks, stride_kh, d, key_ok, d_ok, UPCAST)
    v = load_kv(v_cache, block, offset, kv_head, stride_vb, stride_vs, stride_vh, d, key_ok, d_ok, UPCAST)
    k, v = k.to(queries.dtype), v.to(queries.dtype)  # an FP8 cache's tiles widened (a no-op otherwise)
    scores = tile_scores(queries, k, scale_log2, cap_log2, scale_over_cap, SOFTCAP, IEEE)
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
    return online_softmax(scores, v, m, l, acc, IEEE)


@triton.jit(do_not_specialize=PREFILL_STEP_ARGS)
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
    kv = (
        k_cache,
        v_cache,
        table_row,
        kv_head,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        d,
        d_ok,
    )
    rows = (token, q_pos, tree_row, row_lo)
    tree = (tree_first, tree_key0, tree_n, tree_mask)
    scoring = (scale_log2, cap_log2, scale_over_cap)
    for start in range(tile_lo, full_end, BLOCK_N):
        m, l, acc = _prefill_tile(
            queries,
            kv,
            rows,
            tree,
            (m, l, acc),
            scoring,
            start,
            full_end,
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
            kv,
            rows,
            tree,
            (m, l, acc),
            scoring,
            start,
            causal_end,
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
                kv,
                rows,
                tree,
                (m, l, acc),
                scoring,
                start,
                hi,
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
    group = group_size(num_heads, num_kv_heads)
    check_layouts(q, k_cache, v_cache)
    out = torch.empty_like(q) if out is None else out
    tile_seqs, tile_starts = tiles
    if tile_seqs.shape[0] == 0:
        return out
    tokens = tokens_per_tile(num_heads, num_kv_heads)
    group_p = triton.next_power_of_2(group)
    block_d = padded_head_dim(head_dim)
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
        *softcap_args(scale * k_scale, softcap),
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
