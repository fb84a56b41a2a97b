"""The Triton paged-attention kernels under one name, for the attention backend and the tests:
- tile_ops.py: the layouts, the semantics and the device helpers both kernels share;
- decode_kernels.py: decode steps (one query a sequence, split over the keys);
- prefill_kernels.py: every other step (prompts, chunks, draft trees);
- kv_store.py: a step's keys and values into the caches (with the rotary embedding of queries and keys, or not).

Tuning constants live in the module that uses them (decode_kernels.DECODE_BLOCK_N, say): set them there."""

from .decode_kernels import MAX_DECODE_SPLITS, decode_attention, decode_splits
from .kv_store import rotate_and_store_kv, store_kv
from .prefill_kernels import TreeMasks, prefill_attention, prefill_tiles, tokens_per_tile, tree_mask_arrays, tree_masks

__all__ = [
    "MAX_DECODE_SPLITS",
    "TreeMasks",
    "decode_attention",
    "decode_splits",
    "prefill_attention",
    "prefill_tiles",
    "rotate_and_store_kv",
    "store_kv",
    "tokens_per_tile",
    "tree_mask_arrays",
    "tree_masks",
]
