"""Paged KV cache bookkeeping: which fixed-size blocks each sequence owns.

Blocks are plain integers into the cache tensors the model runner owns. A sequence's `block_table` lists its blocks
in token order; token `p` lives in slot `block_table[p // block_size] * block_size + p % block_size`.
Reference counts let several sequences share a block later (prefix reuse); today each block has one owner."""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one KV block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # Blocks handed out since the runner last looked: it zeroes them before first use.
        self.newly_allocated: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """How many more blocks `seq` needs so that it can hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` enough blocks for `num_tokens` tokens; False (and nothing changed) if too few are free."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
            self.newly_allocated.append(block_id)
        seq.metrics.kv_cache_alloc_new_blocks += needed
        seq.metrics.kv_cache_alloc_total_blocks += needed
        return True

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq`; tail blocks first so that early (shareable) blocks stay cached longest."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def take_newly_allocated(self) -> list[int]:
        blocks, self.newly_allocated = self.newly_allocated, []
        return blocks
