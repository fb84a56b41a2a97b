"""FP8 matmul with row-wise scales in Triton: out = (a_q b_q^T) * a_scale[:, None] * b_scale[None, :] (+ bias),
a_q float8_e4m3fn [M, K] (per-token scales a_scale [M]), b_q float8_e4m3fn [N, K] (per-channel b_scale [N]),
fp32 accumulation, bf16 / fp16 out. Both operands are K-major, as Hopper's FP8 tensor-core instructions take them.

An alternative to torch._scaled_mm's row-wise path, whose kernels are slow at the row counts of a decode batch
(0.9-1.5x bf16 at 256 rows on an H200, docs/benchmarks.md); ci/gpu_quant_kernels.py times both, and kernels.py
takes the faster per row count (FP8_MATMUL)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Fp8Tiles:
    block_m: int
    block_n: int
    block_k: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


@triton.jit(do_not_specialize=["M"])
def _fp8_matmul_kernel(
    a,
    b,
    a_scale,
    b_scale,
    bias,
    out,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """One program an output tile; tiles ordered in bands of GROUP_M row blocks, so that a band's programs share
    the same columns of b while they are in L2."""
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * blocks_n)
    first_m = band * GROUP_M
    band_rows = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * blocks_n)) % band_rows
    pid_n = (pid % (GROUP_M * blocks_n)) // band_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a + rows.to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = b + cols.to(tl.int64)[:, None] * stride_bn + ks[None, :]
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a_tile = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_tile = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:  # the interpreter: exact products of the fp8 values
            acc += tl.dot(a_tile.to(tl.float32), tl.trans(b_tile.to(tl.float32)), input_precision="ieee")
        else:
            acc = tl.dot(a_tile, tl.trans(b_tile), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    sa = tl.load(a_scale + rows, mask=row_ok, other=0.0)
    sb = tl.load(b_scale + cols, mask=col_ok, other=0.0)
    acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_matmul(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiles: Fp8Tiles,
) -> torch.Tensor:
    """a_q [M, K], b_q [N, K] (float8_e4m3fn, last dims contiguous), a_scale fp32 [M] or [M, 1], b_scale fp32
    [N] -> [M, N] in out_dtype."""
    M, K = a_q.shape
    N = b_q.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=a_q.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n),)
    _fp8_matmul_kernel[grid](
        a_q,
        b_q,
        a_scale.reshape(-1),
        b_scale.reshape(-1),
        bias if bias is not None else b_scale,
        out,
        M,
        N,
        K,
        a_q.stride(0),
        b_q.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=a_q.device.type != "cuda",
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
