"""The portable attention backend (`attn_backend: VANILLA`): plain PyTorch, writes new K/V into the block cache by
slot, then gathers each sequence's blocks and attends with SDPA and the step's masks. Runs anywhere PyTorch runs
(the CPU path, and the reference the kernels are tested against); decode-only steps take one batched SDPA call.

An FP8 cache (fp8_cache.py) stores this step's keys and values quantized; attention then reads them back
dequantized, this step's own too (a whole prompt attends over its rounded K/V, as a chunked or prefix-hit one
does), so the result does not depend on how a prompt was split into steps."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..block_manager import blocks_for
from ..host_arrays import HostArrays
from .fp8_cache import as_bytes, dequantize, is_fp8, quantize
from .metadata import AttentionMetadata, sequence_mask, window_mask


def zero_blocks(caches, block_ids: list[int]) -> None:
    """Zero whole blocks of every cache tensor in `caches`: attention reads whole blocks (masking the tail), so a
    block handed out must never hold NaN/Inf garbage."""
    if not block_ids:
        return
    # Through pinned memory: a pageable copy would make the host wait for every step already queued on the GPU.
    index = HostArrays.one(block_ids, caches[0].device)
    for cache in caches:
        as_bytes(cache).index_fill_(0, index, 0)  # fp8 zero is all zero bits


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's keys and values ([T, kv_heads, head_dim]) at their slots; into an FP8 cache quantized
    with the layer's scales (fp8_cache.quantize)."""
    for values, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if is_fp8(cache):
            values = quantize(values, scale)
        flat = as_bytes(cache).view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
        flat.index_copy_(0, slot_mapping, as_bytes(values))


def portable_attention(
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
) -> torch.Tensor:
    """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim].
    `window`: the layer's attention window (attention/windows.py), None for full attention; `softcap`: scores
    capped at softcap * tanh(scores / softcap) before the mask and softmax, None for none. k_scale, v_scale: the
    layer's FP8 cache scales (unused by a cache in another dtype). Returns [T, heads, head_dim]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
    scales = (k_scale, v_scale)
    if meta.is_decode_only:
        return _decode_attention(q, k_cache, v_cache, meta, scale, window, scales, softcap)
    if is_fp8(k_cache):  # the prompt fast path below attends over this step's K/V as the cache holds them
        k = dequantize(quantize(k, k_scale), k_scale, q.dtype)
        v = dequantize(quantize(v, v_scale), v_scale, q.dtype)
    out = torch.empty_like(q)
    tail_masks = meta.tail_masks or [None] * len(meta.query_starts)
    masks = meta.sequence_masks or [None] * len(meta.query_starts)
    for start, q_len, ctx_len, table, tail_mask, mask in zip(
        meta.query_starts, meta.query_lens, meta.context_lens, meta.block_tables, tail_masks, masks
    ):
        rows = slice(start, start + q_len)
        if q_len == ctx_len and tail_mask is None and (window is None or ctx_len <= window):
            out[rows] = _causal_attention(q[rows], k[rows], v[rows], scale, softcap)  # a whole prompt: no gather
            continue
        if mask is None:  # a whole prompt, or metadata not made by step_metadata
            mask = sequence_mask(q_len, ctx_len, tail_mask, q.device, q.dtype, meta.block_size)
        if window is not None:
            mask = window_mask(mask, _query_positions(meta, start, q_len, ctx_len, q.device), window)
        out[rows] = _sequence_attention(
            q[rows], k_cache, v_cache, table, ctx_len, meta.block_size, scale, mask, scales, softcap
        )
    return out


def _query_positions(meta: AttentionMetadata, start: int, q_len: int, ctx_len: int, device) -> torch.Tensor:
    """[q_len] positions of a sequence's queries: the step's (draft nodes at their depth), or its last q_len."""
    if meta.positions is not None:
        return meta.positions[start : start + q_len]
    return torch.arange(ctx_len - q_len, ctx_len, device=device)


def _attend(q, k, v, scale, softcap, mask=None, is_causal=False):
    """SDPA ([..., heads, Q, d] queries, [..., kv_heads, K, d] keys and values, an additive or bool mask); with a
    softcap, the same written out (SDPA cannot cap), in the order transformers' eager attention takes: scale,
    cap, mask, softmax in fp32."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    groups = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _causal_attention(q, k, v, scale, softcap=None):
    out = _attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale, softcap, is_causal=True)
    return out.transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] for any shape of ids; index_select is several times faster than advanced indexing here."""
    picked = torch.index_select(as_bytes(cache), 0, block_ids.reshape(-1)).view(cache.dtype)
    return picked.view(*block_ids.shape, *cache.shape[1:])


def _gather(cache: torch.Tensor, table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """The whole blocks holding a sequence's first `length` positions (the mask hides the tail)."""
    return _gather_blocks(cache, table[: blocks_for(length, block_size)]).flatten(0, 1)


def _sequence_attention(q, k_cache, v_cache, table, ctx_len, block_size, scale, mask, scales, softcap=None):
    """Batched 4-D SDPA with an additive mask, which CPU PyTorch runs in its flash kernel (a bool mask on 3-D
    inputs took the slower math path)."""
    k_scale, v_scale = scales
    keys = dequantize(_gather(k_cache, table, ctx_len, block_size), k_scale, q.dtype)
    values = dequantize(_gather(v_cache, table, ctx_len, block_size), v_scale, q.dtype)
    keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, kv_heads, whole blocks, d]
    out = _attend(q.transpose(0, 1)[None], keys, values, scale, softcap, mask)
    return out[0].transpose(0, 1)


def _decode_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale, window: int | None, scales, softcap=None):
    """Every sequence's Q rows (consecutive in q) at once over its gathered blocks."""
    tables, (k_scale, v_scale) = meta.block_tables, scales
    keys = dequantize(_gather_blocks(k_cache, tables), k_scale, q.dtype).flatten(1, 2).transpose(1, 2)
    values = dequantize(_gather_blocks(v_cache, tables), v_scale, q.dtype).flatten(1, 2).transpose(1, 2)
    queries = q.view(tables.shape[0], -1, *q.shape[1:]).transpose(1, 2)  # [S, heads, Q, d]
    mask = meta.decode_mask
    if window is not None:
        assert mask is not None  # decode-only metadata carries its mask
        mask = window_mask(mask, _decode_positions(meta, queries.shape[2], q.device)[:, None], window)
    out = _attend(queries, keys, values, scale, softcap, mask)
    return out.transpose(1, 2).reshape(q.shape)


def _decode_positions(meta: AttentionMetadata, rows: int, device) -> torch.Tensor:
    """[S, Q] positions of a decode-shaped step's query rows: the step's (CUDA graphs: their static positions,
    padding rows at 0, which see key 0), or each context's last position (one query a sequence)."""
    if meta.positions is not None:
        return meta.positions.view(-1, rows)
    return torch.tensor(meta.context_lens, device=device)[:, None] - 1
