"""Paged attention in plain PyTorch: writes new K/V into the block cache by slot, then attends over each sequence's
cached context. Runs anywhere PyTorch runs; decode-only steps take one batched SDPA call."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .block_manager import blocks_for


@dataclass
class AttentionMetadata:
    """How this step's flat token batch maps onto sequences and KV blocks.

    Tokens of one sequence are contiguous: sequence i owns tokens `query_starts[i] : query_starts[i] + query_lens[i]`,
    which sit at the last `query_lens[i]` positions of its `context_lens[i]` cached tokens (after this step's write).
    """

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks] int64, padded with 0
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    # Steps where every sequence has the same number of query rows Q use one batched kernel: decode-only steps
    # (Q = 1, mask built once per step by the runner) and CUDA graphs (cuda_graphs.py pads every sequence to Q).
    decode_mask: torch.Tensor | None = None  # [S, 1, Q, max_context], bool or additive (build_decode_mask)
    # Speculative drafts: per sequence, None (causal) or a [n, n] bool mask over its last n query tokens (the root
    # and its draft tree); those tokens see the whole context before them and, among themselves, only this mask.
    tail_masks: list[torch.Tensor | None] | None = None
    # Other steps: per sequence, its additive mask [1, 1, q_len, whole blocks of ctx_len] (None: a whole prompt,
    # causal over its own keys), built once per step rather than in every layer.
    sequence_masks: list[torch.Tensor | None] | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.decode_mask is not None


def build_decode_mask(context_lens: list[int], block_size: int, num_blocks: int, device,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """[S, 1, 1, num_blocks * block_size]: which gathered positions each sequence sees. Bool, or with `dtype` (the
    queries' dtype) additive 0 / -inf, which SDPA takes as is; a bool mask it converts again in every layer."""
    lens = torch.tensor(context_lens, device=device)
    positions = torch.arange(num_blocks * block_size, device=device)
    visible = (positions[None, :] < lens[:, None])[:, None, None, :]
    return visible if dtype is None else _additive(visible, dtype)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `visible`, -inf elsewhere: the mask form SDPA adds as it is."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def step_metadata(slots: list[int], block_tables: list[list[int]], query_starts: list[int], query_lens: list[int],
                  context_lens: list[int], block_size: int, tail_masks: list, device, dtype: torch.dtype,
                  masks: bool = True) -> AttentionMetadata:
    """The metadata of one step from per-sequence lists: block tables are cut / padded to the step's widest
    context, tail masks kept only if some sequence has one, and (unless `masks` is False: a CUDA graph builds its
    own) the step's attention masks (`attach_masks`)."""
    max_blocks = max(blocks_for(context, block_size) for context in context_lens)
    tables = [(table[:max_blocks] + [0] * max_blocks)[:max_blocks] for table in block_tables]
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=torch.tensor(tables, dtype=torch.long, device=device), query_starts=query_starts,
        query_lens=query_lens, context_lens=context_lens, block_size=block_size,
        tail_masks=tail_masks if any(m is not None for m in tail_masks) else None)
    if masks:
        attach_masks(attn, device, dtype)
    return attn


def attach_masks(attn: AttentionMetadata, device, dtype: torch.dtype) -> None:
    """The masks every layer of an eager forward uses, built once: the decode mask when every query is one token
    (`dtype`: the queries' dtype, see build_decode_mask), else each sequence's own."""
    if all(n == 1 for n in attn.query_lens):
        attn.decode_mask = build_decode_mask(attn.context_lens, attn.block_size, attn.block_tables.shape[1], device,
                                             dtype)
    else:
        tails = attn.tail_masks or [None] * len(attn.query_lens)
        attn.sequence_masks = [None if q_len == ctx_len and tail is None else
                               sequence_mask(q_len, ctx_len, tail, device, dtype, attn.block_size)
                               for q_len, ctx_len, tail in zip(attn.query_lens, attn.context_lens, tails)]


def sequence_mask(q_len: int, ctx_len: int, tail_mask: torch.Tensor | None, device, dtype: torch.dtype,
                  block_size: int) -> torch.Tensor:
    """[1, 1, q_len, whole blocks of ctx_len] additive mask of a sequence's queries (its last q_len positions) over
    its context: causal, except that the last `len(tail_mask)` queries see each other only where `tail_mask` says.
    Attention reads whole blocks, so the key length changes once a block rather than every step: fewer shapes for
    the kernels (CUDA's cuDNN attention, which the engine turns off, built a plan for every new one)."""
    width = blocks_for(ctx_len, block_size) * block_size
    query_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    visible = torch.arange(width, device=device)[None, :] <= query_pos[:, None]
    if tail_mask is not None:  # the tail rows already see all columns before the tail (causal)
        tail = tail_mask.shape[0]
        visible[q_len - tail:, ctx_len - tail:ctx_len] = tail_mask.to(device)
    return _additive(visible, dtype)[None, None]


def zero_blocks(caches, block_ids: list[int]) -> None:
    """Zero whole blocks of every cache tensor in `caches`: attention reads whole blocks (masking the tail), so a
    block handed out must never hold NaN/Inf garbage."""
    if not block_ids:
        return
    index = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
    for cache in caches:
        cache.index_fill_(0, index, 0)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values ([T, kv_heads, head_dim]) at their slots."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim].
    Returns [T, heads, head_dim]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.is_decode_only:
        return _decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    tail_masks = meta.tail_masks or [None] * len(meta.query_starts)
    masks = meta.sequence_masks or [None] * len(meta.query_starts)
    for start, q_len, ctx_len, table, tail_mask, mask in zip(meta.query_starts, meta.query_lens, meta.context_lens,
                                                             meta.block_tables, tail_masks, masks):
        rows = slice(start, start + q_len)
        if q_len == ctx_len and tail_mask is None:  # a whole prompt: its own keys, causal, nothing to gather
            out[rows] = _causal_attention(q[rows], k[rows], v[rows], scale)
        else:
            if mask is None:  # metadata not made by step_metadata
                mask = sequence_mask(q_len, ctx_len, tail_mask, q.device, q.dtype, meta.block_size)
            out[rows] = _sequence_attention(q[rows], k_cache, v_cache, table, ctx_len, meta.block_size, scale, mask)
    return out


def _causal_attention(q, k, v, scale):
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                         scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] for any shape of ids; index_select is several times faster than advanced indexing here."""
    return torch.index_select(cache, 0, block_ids.reshape(-1)).view(*block_ids.shape, *cache.shape[1:])


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The whole blocks holding a sequence's first `length` positions (the mask hides the tail)."""
    return _gather_blocks(cache, table[:blocks_for(length, block_size)]).flatten(0, 1)


def _sequence_attention(q, k_cache, v_cache, table, ctx_len, block_size, scale, mask):
    """Batched 4-D SDPA with an additive mask, which CPU PyTorch runs in its flash kernel (a bool mask on 3-D
    inputs took the slower math path)."""
    keys = _gather(k_cache, table, ctx_len, block_size).transpose(0, 1)[None]  # [1, kv_heads, whole blocks, d]
    values = _gather(v_cache, table, ctx_len, block_size).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale):
    """Every sequence's Q rows (consecutive in q) at once over its gathered blocks."""
    tables = meta.block_tables
    keys = _gather_blocks(k_cache, tables).flatten(1, 2).transpose(1, 2)  # [S, kv_heads, max_ctx, d]
    values = _gather_blocks(v_cache, tables).flatten(1, 2).transpose(1, 2)
    queries = q.view(tables.shape[0], -1, *q.shape[1:]).transpose(1, 2)  # [S, heads, Q, d]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.decode_mask, scale=scale,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)
