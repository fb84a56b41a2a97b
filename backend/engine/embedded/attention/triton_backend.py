"""The Triton attention backend (`attn_backend: TRITON`, the default on CUDA): kernels that read the paged KV cache
in place through the block tables (triton_kernels.py). A decode-only step runs the split-KV decode kernel; any
other step (prompts, chunks over a cached prefix, prefix-hit suffixes, decodes among them, draft trees) runs one
prefill launch per layer for all its sequences. Nothing is gathered and no [queries, keys] mask is built.

`KernelMetadata` holds a step's device tensors; the runner builds it once a step (`TritonAttention.metadata`), and
CUDA graphs keep one per captured shape whose tensors they refill (cuda_graphs.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .triton_kernels import TreeMasks

# Fused models rotate queries and keys in the KV store's launch (kv_store.rotate_and_store_kv: one small kernel fewer
# a layer; network/llama.py reads this at each forward). Llama-3.1-8B's shape at batch 1 on an H100: W4A16 +1.2% in
# three calls (docs/gpu-runs.md, thirty-third session), bf16 about +0.9%.
ROTATE_WHILE_STORING = True


def triton_usable(device: torch.device) -> Optional[str]:
    """None if Triton kernels can run on `device`, else why not: CUDA with the `triton` package, or the CPU under
    Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported: slow, for tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed (pip install triton)"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU, for tests); this engine runs on {device}"


@dataclass
class KernelMetadata:
    """One step's (or one CUDA graph's) inputs of the kernels, all int32 on the device."""

    slot_mapping: torch.Tensor  # [T] int64: where this step's K/V go
    block_tables: torch.Tensor  # [S, W]
    seq_lens: torch.Tensor  # [S]: context length after this step's tokens
    max_seq_len: int  # W * block_size: the decode kernel's split count follows from it
    decode: bool  # one query per sequence, no tree: the decode kernel
    query_starts: Optional[torch.Tensor] = None  # [S] (prefill kernel)
    query_lens: Optional[torch.Tensor] = None  # [S]
    tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (tile_seqs, tile_starts)
    tree: Optional[TreeMasks] = None  # None without draft trees
    positions: Optional[torch.Tensor] = None  # [T] int64: query positions (draft nodes at their depth), if known

    def attend(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        scale: float,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        stored: bool = False,
    ) -> torch.Tensor:
        """rotary: (cos, sin) by which q and k, not rotated yet, rotate in place as k is stored; stored: q rotated
        and k and v in the caches already (quant/qkv_rotary.py), so nothing is stored here."""
        from . import triton_kernels as kernels

        if rotary is not None and not stored:
            kernels.rotate_and_store_kv(q, k, v, *rotary, k_cache, v_cache, self.slot_mapping, k_scale, v_scale)
        elif not stored:
            kernels.store_kv(k, v, k_cache, v_cache, self.slot_mapping, k_scale, v_scale)
        if self.decode:
            return kernels.decode_attention(
                q,
                k_cache,
                v_cache,
                self.block_tables,
                self.seq_lens,
                scale,
                self.max_seq_len,
                window=window,
                softcap=softcap,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        # set for every step that is not decode-only (TritonAttention.metadata, CUDA graphs of several rows)
        assert self.query_starts is not None and self.query_lens is not None and self.tiles is not None
        return kernels.prefill_attention(
            q,
            k_cache,
            v_cache,
            self.block_tables,
            self.query_starts,
            self.query_lens,
            self.seq_lens,
            scale,
            self.tiles,
            self.tree,
            window=window,
            positions=self.positions,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )


class TritonAttention:
    """Builds each step's KernelMetadata for one model's head counts."""

    def __init__(self, num_heads: int, num_kv_heads: int, block_size: int, device: torch.device):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.device = device

    def add_arrays(
        self, host, query_starts: list[int], query_lens: list[int], context_lens: list[int], tail_masks: list
    ) -> None:
        """Put what the kernels need besides the block tables into the step's HostArrays (one upload)."""
        from .triton_kernels import prefill_tiles, tree_mask_arrays

        host.add("seq_lens", context_lens, int32=True)
        if self._is_decode(query_lens, tail_masks):
            return
        host.add("query_starts", query_starts, int32=True)
        host.add("query_lens", query_lens, int32=True)
        tile_seqs, tile_starts = prefill_tiles(query_lens, self.num_heads, self.num_kv_heads)
        host.add("tile_seqs", tile_seqs, int32=True)
        host.add("tile_starts", tile_starts, int32=True)
        if any(mask is not None for mask in tail_masks):
            lens, starts, flat = tree_mask_arrays(tail_masks)
            host.add("tree_lens", lens, int32=True)
            host.add("tree_starts", starts, int32=True)
            host.add("tree_masks", flat, int32=True)

    def metadata(
        self, arrays: dict[str, torch.Tensor], slot_mapping: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> KernelMetadata:
        """The step's KernelMetadata from the uploaded arrays (see add_arrays; int32 `block_tables` among them);
        `positions`: the queries' positions, which windowed layers need where a step has draft trees."""
        tables = arrays["block_tables"]
        decode = "query_lens" not in arrays
        meta = KernelMetadata(
            slot_mapping, tables, arrays["seq_lens"], tables.shape[1] * self.block_size, decode, positions=positions
        )
        if not decode:
            meta.query_starts, meta.query_lens = arrays["query_starts"], arrays["query_lens"]
            meta.tiles = (arrays["tile_seqs"], arrays["tile_starts"])
            if "tree_masks" in arrays:
                meta.tree = _tree(arrays["tree_lens"], arrays["tree_starts"], arrays["tree_masks"])
        return meta

    @staticmethod
    def _is_decode(query_lens: list[int], tail_masks: list) -> bool:
        return all(n == 1 for n in query_lens) and all(mask is None for mask in tail_masks)


def _tree(lens: torch.Tensor, starts: torch.Tensor, flat: torch.Tensor):
    from .triton_kernels import TreeMasks

    return TreeMasks(lens, starts, flat.to(torch.bool))
