"""Split-K reductions in one launch (the int4 kernels): the K range is cut into slices whose programs add into a
persistent fp32 workspace, and the last program to finish a tile takes the sum out and zeroes the workspace. Each
program's adds must be visible before it counts itself done (count_slice); split_buffers holds the workspaces
and their tile counters, k_slices says how K is cut."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TILES = 4096  # counters a workspace holds: output tiles of one launch
_buffers: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def split_buffers(device: torch.device, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 workspace [rows, n] and the MAX_TILES tile counters of split-K launches of up to `rows` rows and n
    columns, zero between launches (each launch's last slices leave them so). Made once: a CUDA graph captured
    later keeps using them. Launches share them in order on one stream; two streams running split launches of
    one shape at once would not (the engine runs its forward passes on one)."""
    key = (device, rows, n)
    if key not in _buffers:
        _buffers[key] = (
            torch.zeros((rows, n), dtype=torch.float32, device=device),
            torch.zeros((MAX_TILES,), dtype=torch.int32, device=device),
        )
    return _buffers[key]


def k_slices(K: int, step: int, wanted: int, splittable: bool) -> tuple[int, int]:
    """How many K slices a launch takes (at most `wanted`, one where its counters or workspace do not cover it)
    and the columns of each: whole steps, and no slice empty."""
    steps = triton.cdiv(K, step)
    k_per_split = triton.cdiv(steps, max(1, min(wanted, steps)) if splittable else 1) * step
    return triton.cdiv(K, k_per_split), k_per_split


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


@triton.jit
def add_slice(acc, ws_ptrs, out_ptrs, mask, counters, tile, SPLIT_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """A split-K program's part of a tile: acc (fp32) added into the workspace at ws_ptrs; the tile's last slice to
    arrive stores the sums at out_ptrs, in out's type, and leaves workspace and counter zero for the next launch."""
    tl.atomic_add(ws_ptrs, acc, mask=mask, sem="relaxed")
    if count_slice(counters, tile, INTERPRETED) == SPLIT_K - 1:
        total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # from L2, where atomics add
        tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
        # Where the layout gives two threads the same element, neither may zero it before both have read it
        # (without this barrier an H200 sweep saw sums zeroed: 16 x 32 tiles on two warps).
        tl.debug_barrier()
        tl.store(ws_ptrs, tl.zeros_like(total), mask=mask)
        tl.store(counters + tile, 0)
