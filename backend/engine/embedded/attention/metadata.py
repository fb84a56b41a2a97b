"""What every attention backend reads about a step: how the flat token batch maps onto sequences and KV blocks,
and (for the portable backend) the additive masks built once a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..block_manager import blocks_for
from ..host_arrays import HostArrays, padded_rows

if TYPE_CHECKING:
    from .triton_backend import KernelMetadata


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
    # The Triton backend's device tensors for this step; None: the portable path.
    kernel: KernelMetadata | None = None
    # [T] each query's position (the model's RoPE positions: a draft node sits at its root's plus its depth), which
    # windowed layers measure their window from; None: the last q_len positions of each context (no draft trees).
    positions: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.decode_mask is not None


def build_decode_mask(
    context_lens: list[int], block_size: int, num_blocks: int, device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[S, 1, 1, num_blocks * block_size]: which gathered positions each sequence sees. Bool, or with `dtype` (the
    queries' dtype) additive 0 / -inf, which SDPA takes as is; a bool mask it converts again in every layer."""
    lens = torch.tensor(context_lens, device=device)
    positions = torch.arange(num_blocks * block_size, device=device)
    visible = (positions[None, :] < lens[:, None])[:, None, None, :]
    return visible if dtype is None else _additive(visible, dtype)


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where `visible`, -inf elsewhere: the mask form SDPA adds as it is."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def step_metadata(
    slots: list[int],
    block_tables: list[list[int]],
    query_starts: list[int],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    tail_masks: list,
    device,
    dtype: torch.dtype,
    masks: bool = True,
    kernels=None,
) -> AttentionMetadata:
    """The metadata of one step from per-sequence lists (`add_step_arrays`, one upload, `metadata_from`)."""
    host = HostArrays()
    add_step_arrays(host, slots, block_tables, query_starts, query_lens, context_lens, block_size, tail_masks, kernels)
    return metadata_from(
        host.upload(torch.device(device)),
        query_starts,
        query_lens,
        context_lens,
        block_size,
        tail_masks,
        device,
        dtype,
        masks,
        kernels,
    )


def add_step_arrays(
    host: HostArrays,
    slots: list[int],
    block_tables: list[list[int]],
    query_starts: list[int],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    tail_masks: list,
    kernels=None,
) -> None:
    """The step's slots and block tables (cut / padded to its widest context; int32 for kernels), and what the
    kernels (`kernels`: a triton_backend.TritonAttention, or None for the portable path) read besides."""
    max_blocks = max(blocks_for(context, block_size) for context in context_lens)
    host.add("slot_mapping", slots)
    host.add("block_tables", padded_rows(block_tables, max_blocks), int32=kernels is not None)
    if kernels is not None:
        kernels.add_arrays(host, query_starts, query_lens, context_lens, tail_masks)


def metadata_from(
    arrays: dict[str, torch.Tensor],
    query_starts: list[int],
    query_lens: list[int],
    context_lens: list[int],
    block_size: int,
    tail_masks: list,
    device,
    dtype: torch.dtype,
    masks: bool = True,
    kernels=None,
) -> AttentionMetadata:
    """AttentionMetadata over uploaded arrays: tail masks kept only if some sequence has one; with `kernels`, the
    kernels' metadata; else (unless `masks` is False: a CUDA graph builds its own) the step's attention masks."""
    attn = AttentionMetadata(
        slot_mapping=arrays["slot_mapping"],
        block_tables=arrays["block_tables"],
        query_starts=query_starts,
        query_lens=query_lens,
        context_lens=context_lens,
        block_size=block_size,
        tail_masks=tail_masks if any(m is not None for m in tail_masks) else None,
    )
    attn.positions = arrays.get("positions")
    if kernels is not None:
        attn.kernel = kernels.metadata(arrays, attn.slot_mapping, attn.positions)
    elif masks:
        attach_masks(attn, device, dtype)
    return attn


def attach_masks(attn: AttentionMetadata, device, dtype: torch.dtype) -> None:
    """The masks every layer of an eager forward of the portable backend uses, built once: the decode mask when
    every query is one token (`dtype`: the queries' dtype, see build_decode_mask), else each sequence's own."""
    if all(n == 1 for n in attn.query_lens):
        attn.decode_mask = build_decode_mask(
            attn.context_lens, attn.block_size, attn.block_tables.shape[1], device, dtype
        )
    else:
        tails = attn.tail_masks or [None] * len(attn.query_lens)
        attn.sequence_masks = [
            None
            if q_len == ctx_len and tail is None
            else sequence_mask(q_len, ctx_len, tail, device, dtype, attn.block_size)
            for q_len, ctx_len, tail in zip(attn.query_lens, attn.context_lens, tails)
        ]


def window_mask(mask: torch.Tensor, query_positions: torch.Tensor, window: int) -> torch.Tensor:
    """`mask` (additive, [..., Q, K] over key positions 0 .. K - 1) also hiding keys more than `window` - 1 positions
    before each query: query_positions broadcasts over mask's [..., Q]. Built per windowed layer, from tensors only,
    so a CUDA graph recomputes it on every replay."""
    keys = torch.arange(mask.shape[-1], device=mask.device)
    too_old = keys <= query_positions.to(mask.device)[..., None] - window
    if mask.dtype == torch.bool:
        return mask & ~too_old
    return mask.masked_fill(too_old, float("-inf"))


def sequence_mask(
    q_len: int, ctx_len: int, tail_mask: torch.Tensor | None, device, dtype: torch.dtype, block_size: int
) -> torch.Tensor:
    """[1, 1, q_len, whole blocks of ctx_len] additive mask of a sequence's queries (its last q_len positions) over
    its context: causal, except that the last `len(tail_mask)` queries see each other only where `tail_mask` says.
    Attention reads whole blocks, so the key length changes once a block rather than every step: fewer shapes for
    the kernels (CUDA's cuDNN attention, which the engine turns off, built a plan for every new one)."""
    width = blocks_for(ctx_len, block_size) * block_size
    query_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)
    visible = torch.arange(width, device=device)[None, :] <= query_pos[:, None]
    if tail_mask is not None:  # the tail rows already see all columns before the tail (causal)
        tail = tail_mask.shape[0]
        visible[q_len - tail :, ctx_len - tail : ctx_len] = tail_mask.to(device)
    return _additive(visible, dtype)[None, None]
