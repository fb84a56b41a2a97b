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
