"""Paged KV cache bookkeeping: which fixed-size blocks each sequence owns, and which finished blocks can be reused.

Blocks are plain integers into the cache tensors the model runner owns. A sequence's `block_table` lists its blocks
in token order; token `p` lives in slot `block_table[p // block_size] * block_size + p % block_size`.

Prefix reuse: once a block is full of computed tokens it gets a hash that chains the hash of the block before it
with its own tokens (and an extra key: the LoRA adapter or a salt), so equal hashes mean equal prefixes. A freed
block keeps its hash and contents until its space is needed; free blocks are handed out least recently freed first.
A new sequence starts from the longest chain of cached blocks matching its tokens, never including the block of its
last token: that token's logits must be computed."""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Optional

from .sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


def chain_hash(parent: Optional[int], tokens: tuple[int, ...], extra_key: Hashable) -> int:
    return hash((parent, tokens, extra_key))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_reuse: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one KV block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_reuse = enable_reuse
        self.ref_counts = [0] * num_blocks
        # Free blocks, least recently freed first; a value of None means the block holds no reusable prefix.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        self.block_tokens: list[Optional[tuple[int, ...]]] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.num_cached_free_blocks = 0  # free blocks that still hold a registered prefix
        self.num_reused_blocks = 0  # blocks matched from the prefix cache, ever
        # Blocks handed out since the runner last looked: it zeroes them before first use.
        self.newly_allocated: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses (cached prefixes among them: they are reclaimed when needed)."""
        return len(self.free_blocks)

    # -- prefix reuse -----------------------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence, extra_key: Hashable = None) -> list[int]:
        """Cached blocks holding `seq`'s leading tokens, in order (none if reuse is off)."""
        if not self.enable_reuse:
            return []
        tokens = seq.all_token_ids()
        matched, parent = [], None
        for index in range((len(tokens) - 1) // self.block_size):
            block_tokens = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            parent = chain_hash(parent, block_tokens, extra_key)
            block = self.cached.get(parent)
            if block is None or self.block_tokens[block] != block_tokens:  # tokens guard against collisions
                break
            matched.append(block)
        return matched

    def num_free_after_reuse(self, blocks: list[int]) -> int:
        """Free blocks left once `blocks` (a prefix match) are taken."""
        return self.num_free_blocks - sum(1 for b in blocks if self.ref_counts[b] == 0)

    def reuse(self, seq: Sequence, blocks: list[int]) -> None:
        """Give `seq` the matched blocks: their tokens count as computed."""
        hashes = []
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
                self.num_cached_free_blocks -= 1
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            block_hash = self.block_hash[block]
            assert block_hash is not None  # a matched block is a cached one, which keeps its hash
            hashes.append(block_hash)
        seq.block_hashes = hashes
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.metrics.kv_cache_reused_blocks += len(blocks)
        self.num_reused_blocks += len(blocks)
        seq.metrics.kv_cache_alloc_total_blocks += len(blocks)

    def register_full_blocks(self, seq: Sequence, extra_key: Hashable = None) -> None:
        """Hash the blocks `seq` has completely computed since the last call, so later sequences can reuse them."""
        if not self.enable_reuse:
            return
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        tokens = None
        while len(seq.block_hashes) < full:
            index = len(seq.block_hashes)
            tokens = tokens or seq.all_token_ids()
            block_tokens = tuple(tokens[index * self.block_size : (index + 1) * self.block_size])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = chain_hash(parent, block_tokens, extra_key)
            seq.block_hashes.append(block_hash)
            block = seq.block_table[index]
            if block_hash not in self.cached and self.block_hash[block] is None:
                self.cached[block_hash] = block
                self.block_hash[block], self.block_tokens[block] = block_hash, block_tokens

    # -- allocation -------------------------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """How many more blocks `seq` needs so that it can hold `num_tokens` tokens."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` enough blocks for `num_tokens` tokens; False (and nothing changed) if too few are free."""
        if num_tokens <= len(seq.block_table) * self.block_size:  # most decode steps: the last block has room
            return True
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block, _ = self.free_blocks.popitem(last=False)
            if self.block_hash[block] is not None:
                self.num_cached_free_blocks -= 1
            self._forget(block)
            self.ref_counts[block] = 1
            seq.block_table.append(block)
            self.newly_allocated.append(block)
        seq.metrics.kv_cache_alloc_new_blocks += needed
        seq.metrics.kv_cache_alloc_total_blocks += needed
        return True

    def fork(self, parent: Sequence, child: Sequence, copy_block: Callable[[int, int], None]) -> bool:
        """Give `child` the KV of `parent`'s computed tokens: full blocks are shared, a partly filled last block
        is copied at once by `copy_block(source, destination)` (the two sequences will write different tokens
        into it). False (child left without blocks, to be recomputed) when no block is free for the copy."""
        computed = parent.num_computed_tokens
        if computed == 0:
            return False
        shared = parent.block_table[: blocks_for(computed, self.block_size)]
        partial = computed % self.block_size != 0
        if partial and not self.free_blocks:
            return False
        for block in shared[:-1] if partial else shared:
            self.ref_counts[block] += 1
            child.block_table.append(block)
        if partial:
            self.grow(child, computed)
            copy = child.block_table[-1]
            self.newly_allocated.remove(copy)  # the copy overwrites it whole: zeroing it later would wipe it
            copy_block(shared[-1], copy)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = computed
        return True

    def _forget(self, block: int) -> None:
        """The block's space is taken for new tokens: its cached prefix is gone."""
        block_hash = self.block_hash[block]
        if block_hash is not None and self.cached.get(block_hash) == block:
            del self.cached[block_hash]
        self.block_hash[block] = self.block_tokens[block] = None

    def free(self, seq: Sequence) -> None:
        """Return every block of `seq`; tail blocks first, so that a prefix's early blocks are reclaimed last."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                if self.block_hash[block] is None:  # nothing worth keeping: hand it out first
                    self.free_blocks.move_to_end(block, last=False)
                else:
                    self.num_cached_free_blocks += 1
        seq.block_table.clear()
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def slot_of(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free `seq`'s tail blocks past its first `num_tokens` tokens (rejected speculative drafts held them).
        Such blocks were never registered as prefixes: only computed, committed tokens are."""
        keep = blocks_for(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                self.free_blocks.move_to_end(block, last=False)

    def take_newly_allocated(self) -> list[int]:
        blocks, self.newly_allocated = self.newly_allocated, []
        return blocks
