"""Rounding a Triton kernel's fp32 results into the activations' dtype the same way on a GPU and on CPU, where the
kernels run in Triton's interpreter: its fp32 -> bf16 cast truncates where a GPU (and torch) rounds to nearest
even, so there the bits are rounded by hand before the cast. Shared by the fused elementwise kernels
(network/fused_ops.py), the KV store that rotates (attention/kv_store.py) and the norm folds (quant/norm_fold.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the activations' dtypes these kernels take


@triton.jit
def round_to(h, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """fp32 h rounded to nearest even in dtype. ROUND_BF16 (the interpreter, bf16): round the bits here, since its
    cast truncates (the cast of a value bf16 holds exactly is then exact)."""
    if ROUND_BF16:
        bits = h.to(tl.int32, bitcast=True)
        h = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return h.to(dtype)


def rounds_bf16_by_hand(t: torch.Tensor) -> bool:
    """Whether kernels writing `t`'s dtype must round to bf16 by hand: bf16 off CUDA, in Triton's interpreter."""
    return t.dtype == torch.bfloat16 and t.device.type != "cuda"
