"""W4A16 for many rows of x (a prompt, a large decode batch): y = x W^T + b with the int4 weight of formats.py,
each weight dequantized once, in the program that multiplies it, and never written to memory.

Past a few rows the dequantize path (a scratch copy of the whole weight in x's dtype, then cuBLAS) reads and
writes five bytes for every packed half byte; the decode kernel's tl.dot tiles (int4_decode_kernel.py) keep x
as the A operand and apply scales after each step. Here the roles are swapped: a program computes
out^T[cols, rows] = W[cols, :] x[rows, :]^T, so the dequantized weight tile is the A operand, which Hopper's
wgmma reads straight from registers, and x's tile the B operand, staged in shared memory by Triton's pipeline.
The tile is dequantized in full, w = (q - zero) * scale, so the tensor cores accumulate across K steps with no
per-step correction; (MAGIC + q) - (MAGIC + zero) is exact in 16 bits and the one rounding is the product's, as
the reference dequantizer (formats.dequantize_int4) rounds, so the result equals dequantize-then-matmul up to
the order of fp32 sums. A K step never crosses a scale group (BLOCK_K divides the group size).

split_k > 1 cuts K into slices for shapes whose tiles alone leave SMs idle (down_proj: 4,096 columns, K 14,336):
the slices add into a persistent fp32 workspace and the last one to finish a tile writes it out and zeroes it, in
the one launch (gpu_fence.py).

On CPU (Triton's interpreter, whose 16-bit arithmetic is wrong) the tile is made in fp32 and the dots run in
fp32 (IEEE): the tests check the indexing and the groups there, and the 16-bit path on CUDA."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .. import gpu_fence
from ..gpu_fence import add_slice
from .int4_bytes import magic16


@dataclass(frozen=True)
class GemmTiles:
    """One program shape: BLOCK_N weight rows (output columns) by BLOCK_M rows of x, K steps of BLOCK_K, K cut
    into up to split_k slices."""

    block_n: int = 64
    block_m: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1

    def __post_init__(self) -> None:
        for name in ("block_n", "block_m", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmTiles.{name} must be a power of two >= 16, got {value}")
        if self.split_k < 1:
            raise ValueError(f"GemmTiles.split_k must be >= 1, got {self.split_k}")


DEFAULT_TILES = GemmTiles()
MAX_ROWS = 256  # past this, a scratch weight and cuBLAS win (H100: 522 against 559 us for Llama-3.1-8B at 512 rows)


def tiles_for(m: int, group_size: int) -> GemmTiles:
    """The H100 sweep's best for Llama-3.1-8B's four projections (docs/gpu-runs.md, twenty-eighth session): 64
    weight rows by 128 rows of x, K steps of 128, four warps, three stages (280 us at 128 rows against the
    dequantize path's 390); 64 rows of x up to 64 (223 against 381). Smaller groups take K steps of their size."""
    step = 128
    while step > 16 and group_size % step:
        step //= 2
    return replace(DEFAULT_TILES, block_m=128 if m > 64 else 64, block_k=step)


def fits(group_size: int, tiles: GemmTiles) -> bool:
    """Whether the kernel can take this group size: each K step inside one group (and K, whole groups, whole
    steps)."""
    return group_size % tiles.block_k == 0


@triton.jit
def _weight_tile(packed, s, z, FP16: tl.constexpr, UPCAST: tl.constexpr):
    """uint8 [BLOCK_N, BLOCK_K // 2] (low nibble the even column) with the rows' scale and zero point ([BLOCK_N])
    -> (q - zero) * scale, [BLOCK_N, BLOCK_K], columns in memory order."""
    if UPCAST:
        zero = z.to(tl.float32)[:, None]
        lo = ((packed & 0xF).to(tl.float32) - zero) * s.to(tl.float32)[:, None]
        hi = ((packed >> 4).to(tl.float32) - zero) * s.to(tl.float32)[:, None]
    else:
        zero = magic16(z, FP16)[:, None]
        lo = (magic16(packed & 0xF, FP16) - zero) * s[:, None]
        hi = (magic16(packed >> 4, FP16) - zero) * s[:, None]
    return tl.reshape(tl.join(lo, hi), (packed.shape[0], 2 * packed.shape[1]))


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    x,
    w,
    scale,
    zero,
    bias,
    out,
    workspace,
    counters,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_w,
    stride_s,
    stride_sg,
    stride_z,
    stride_zg,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP16: tl.constexpr,
    UPCAST: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (column block, row block, K slice): out[rows, cols] (+)= x[rows, slice] W[cols, slice]^T (+ bias),
    as its transpose."""
    HALF: tl.constexpr = BLOCK_K // 2
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    kept = tl.minimum(cols, N - 1).to(tl.int64)  # columns past N read column N - 1's weights, never stored
    w_rows = w + kept[:, None] * stride_w
    x_rows = x + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_xm  # rows past M: row M - 1, not stored
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        pairs = tl.multiple_of(k0 // 2, HALF) + tl.arange(0, HALF)
        ks = tl.multiple_of(k0, BLOCK_K) + tl.arange(0, BLOCK_K)
        packed = tl.load(w_rows + pairs[None, :])  # K is whole groups, so whole steps: nothing to mask
        group = k0 // GROUP_SIZE
        s = tl.load(scale + kept * stride_s + group * stride_sg)
        z = tl.load(zero + kept * stride_z + group * stride_zg)
        x_tile = tl.load(x_rows + ks[None, :])
        if UPCAST:
            acc = tl.dot(
                _weight_tile(packed, s, z, FP16, UPCAST), tl.trans(x_tile.to(tl.float32)), acc, input_precision="ieee"
            )
        else:
            acc = tl.dot(_weight_tile(packed, s, z, FP16, UPCAST), tl.trans(x_tile), acc)
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            acc += tl.load(bias + kept).to(tl.float32)[:, None]
    out_ptrs = out + rows.to(tl.int64)[None, :] * stride_om + cols[:, None]
    mask = col_ok[:, None] & row_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=mask)
    else:  # the tile's last slice to arrive takes the sum out, leaving workspace and counter zero
        ws_ptrs = workspace + rows.to(tl.int64)[None, :] * N + cols[:, None]
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        add_slice(acc, ws_ptrs, out_ptrs, mask, counters, tile, SPLIT_K, INTERPRETED)


def int4_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    tiles: GemmTiles = DEFAULT_TILES,
) -> torch.Tensor:
    """x [M, K] (last dim contiguous) times qweight uint8 [N, K // 2] -> [M, N] in x's dtype; scale [N, groups]
    in x's dtype and zero uint8 [N, groups], row- or group-major. Shapes are checked by the caller (kernels.py);
    fits(group_size, tiles) must hold."""
    M, K = x.shape
    N = qweight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    upcast = x.device.type != "cuda" or x.dtype == torch.float32
    grid = (triton.cdiv(N, tiles.block_n), triton.cdiv(M, tiles.block_m))
    splittable = M <= MAX_ROWS and grid[0] * grid[1] <= gpu_fence.MAX_TILES
    split_k, k_per_split = gpu_fence.k_slices(K, tiles.block_k, tiles.split_k, splittable)
    workspace, counters = gpu_fence.split_buffers(x.device, MAX_ROWS, N) if split_k > 1 else (out, out)
    _int4_gemm_kernel[(*grid, split_k)](
        x,
        qweight,
        scale,
        zero,
        bias if bias is not None else out,
        out,
        workspace,
        counters,
        M,
        N,
        K,
        k_per_split,
        x.stride(0),
        qweight.stride(0),
        scale.stride(0),
        scale.stride(1),
        zero.stride(0),
        zero.stride(1),
        out.stride(0),
        GROUP_SIZE=group_size,
        HAS_BIAS=bias is not None,
        FP16=x.dtype == torch.float16,
        UPCAST=upcast,
        SPLIT_K=split_k,
        INTERPRETED=x.device.type != "cuda",
        BLOCK_N=tiles.block_n,
        BLOCK_M=tiles.block_m,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
