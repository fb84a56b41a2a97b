"""Per-token FP8 activation quantization in one Triton launch (the torch ops it replaces are five launches, as
long at decode as the FP8 matmul itself): x [M, K] -> float8_e4m3fn [M, K] and fp32 scales [M, 1], x ~ x_q *
scale, each row's absmax / 448 (or a static per-tensor scale). kernels.quantize_per_token is its reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import FP8_MAX

MIN_SCALE = 1e-12  # an all-zero row still divides by something
MAX_BLOCK = 4096
_FP8_MAX, _MIN_SCALE = tl.constexpr(FP8_MAX), tl.constexpr(MIN_SCALE)  # what a kernel may read of the module


@triton.jit
def row_scale(amax):
    """A row's scale from its absmax (fp32): absmax / 448, at least MIN_SCALE."""
    return tl.maximum(amax / _FP8_MAX, _MIN_SCALE)


@triton.jit
def store_fp8(ptrs, values, scale, mask):
    """fp32 values / scale, clamped to +-448 and rounded to ptrs' float8 type: every FP8 activation's rounding
    (here and in the fused norm and SiLU's FP8 rows, network/fused_ops.py)."""
    q = tl.clamp(tl.div_rn(values, scale), -_FP8_MAX, _FP8_MAX)
    tl.store(ptrs, q.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_kernel(
    x, out, scales, static_scale, K, stride_x, STATIC: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr
):
    """Program (row): its scale (absmax / 448 in a first pass over K, or the static one), then x / scale clamped
    to +-448 and cast, in a second pass (x is small beside the weights; the second read hits the cache). ONE_BLOCK
    (K <= BLOCK): the row is loaded once and kept."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x + row * stride_x
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK)
        values = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(static_scale).to(tl.float32)
    elif ONE_BLOCK:
        scale = row_scale(tl.max(tl.abs(values), axis=0))
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            values = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(values))
        scale = row_scale(tl.max(amax, axis=0))
    tl.store(scales + row, scale)
    if ONE_BLOCK:
        store_fp8(out + row * K + cols, values, scale, cols < K)
    else:
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            values = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            store_fp8(out + row * K + cols, values, scale, cols < K)


def quantize_rows(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with a contiguous last dimension -> (float8_e4m3fn [M, K] row-major, fp32 [M, 1])."""
    m, k = x.shape
    out = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return out, scales
    static = input_scale.to(torch.float32).reshape(1) if input_scale is not None else scales
    block = min(MAX_BLOCK, triton.next_power_of_2(k))
    _quantize_rows_kernel[(m,)](
        x,
        out,
        scales,
        static,
        k,
        x.stride(0),
        STATIC=input_scale is not None,
        BLOCK=block,
        ONE_BLOCK=k <= block,
        num_warps=4,
    )
    return out, scales
