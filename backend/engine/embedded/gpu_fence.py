"""Ordering between the programs of one launch: where the last program to finish a piece of work sums what the
others wrote (the split-K int4 GEMVs), each program's writes must be visible before it counts itself done."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fence_gpu(value):
    """`value`, returned after this thread's earlier memory operations are ordered before its later ones at GPU
    scope (a fence.acq_rel.gpu each thread runs). CUDA only: the interpreter knows no PTX (and runs programs one
    after another)."""
    return tl.inline_asm_elementwise(
        "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [value], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def count_slice(counters, tile, INTERPRETED: tl.constexpr):
    """After a program's adds into a split-K workspace: counts it as one more slice of `tile` and returns how many
    counted before it (the last of SPLIT_K slices sees SPLIT_K - 1 and takes the sums out). Every thread fences
    its own adds, as CUDA's fence-then-count reductions do; then the program's warps meet, because one thread
    counts for all (an H100 sweep found sums missing a later warp's adds without the barrier, Triton 3.6 putting
    none before a scalar atomic); the counter's acquire makes the other slices' adds visible to the last one."""
    if not INTERPRETED:  # the interpreter runs programs one after another (and knows no PTX)
        tile = fence_gpu(tile)
    tl.debug_barrier()
    return tl.atomic_add(counters + tile, 1, sem="acq_rel")
