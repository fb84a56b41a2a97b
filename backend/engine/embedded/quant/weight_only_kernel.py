"""Weight-only quantized matmul in Triton (W8A16 and W4A16): y = x W^T + b, W dequantized inside the kernel.

Formats (quant design, issue 25), per output row n and input column k, groups of `group_size` input columns:
- int8: weight int8 [N, K]; w = q * scale[n, k // group_size].
- int4: qweight uint8 [N, K // 2], low nibble = even column; w = (q - zero[n, g]) * scale[n, g], q and zero 0..15.
The weight is dequantized to x's dtype (one rounding of an exact fp32 product, as the reference dequantizer
rounds) and the products are accumulated in fp32.

One kernel, three shapes of program (a `Variant`):
- GEMV (use_dot False, block_m 1..8): rows of x times a [block_n, block_k] weight tile with broadcast
  multiply-and-sum on the CUDA cores. For decode: each weight byte is read once, little else is done.
- dot (use_dot True): the same tile through tl.dot (tensor cores); block_m >= 16, any M.
- split-K (split_k > 1, either of the above): the K range is cut into split_k slices so that small N still fills
  the SMs; slices add into an fp32 buffer with atomics, cast to x's dtype after.
Large M can instead dequantize the weight once into a scratch buffer and call F.linear (cuBLAS): `dequantize`.

On CPU the kernel runs in Triton's interpreter, whose low-precision arithmetic is wrong: there (UPCAST) x is
converted to fp32 on load and the weight stays fp32, so dots run in fp32 (IEEE, no tf32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ONE_GROUP, WHOLE_GROUPS, GATHER = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # scale_layout's answers


@dataclass(frozen=True)
class Variant:
    """One program shape of the kernel; ci/gpu_quant_kernels.py times several to pick the defaults below."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    use_dot: bool = True
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"Variant.{name} must be a power of two, got {value}")
        if self.use_dot and (self.block_m < 16 or self.block_n < 16 or self.block_k < 16):
            raise ValueError(f"a tl.dot variant needs blocks of at least 16, got {self}")
        if self.block_k < 2:
            raise ValueError("Variant.block_k must be at least 2 (one int4 byte holds two columns)")
        if self.split_k < 1:
            raise ValueError(f"Variant.split_k must be >= 1, got {self.split_k}")


@triton.jit
def _dequantized_tile(
    w,
    scale,
    zero,
    rows,
    row_ok,
    k0,
    K,
    stride_w,
    stride_s,
    stride_sg,
    stride_z,
    stride_zg,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[BLOCK_N, BLOCK_K] fp32 weights of output rows `rows`, input columns k0 .. k0 + BLOCK_K (0 past K; k0 a
    multiple of BLOCK_K). SCALES says how the tile meets the scale groups (scale_layout)."""
    row_base = rows.to(tl.int64)[:, None]
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    if BITS == 4:
        bytes_ = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte_ok = row_ok[:, None] & (bytes_ < K // 2)[None, :]
        packed = tl.load(w + row_base * stride_w + bytes_[None, :], mask=byte_ok, other=0)
        # join then reshape interleaves (low, high) pairs: column 2j is byte j's low nibble, 2j + 1 its high one
        q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K)).to(tl.float32)
    else:
        mask = row_ok[:, None] & k_ok[None, :]
        q = tl.load(w + row_base * stride_w + ks[None, :], mask=mask, other=0).to(tl.float32)
    if SCALES == ONE_GROUP:  # one scale (and zero) a row
        group = k0 // GROUP_SIZE
        s = tl.load(scale + row_base * stride_s + group * stride_sg, mask=row_ok[:, None], other=0.0).to(tl.float32)
        if BITS == 4:
            z = tl.load(zero + row_base * stride_z + group * stride_zg, mask=row_ok[:, None], other=0).to(tl.float32)
            q = q - z
        w_tile = q * s
    elif SCALES == WHOLE_GROUPS:  # BLOCK_K // GROUP_SIZE scales a row, broadcast over their groups
        groups = k0 // GROUP_SIZE + tl.arange(0, BLOCK_K // GROUP_SIZE)
        mask = row_ok[:, None] & (groups < K // GROUP_SIZE)[None, :]
        s = tl.load(scale + row_base * stride_s + groups[None, :] * stride_sg, mask=mask, other=0.0).to(tl.float32)
        q3 = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP_SIZE, GROUP_SIZE))
        if BITS == 4:
            z = tl.load(zero + row_base * stride_z + groups[None, :] * stride_zg, mask=mask, other=0).to(tl.float32)
            q3 = q3 - z[:, :, None]
        w_tile = tl.reshape(q3 * s[:, :, None], (BLOCK_N, BLOCK_K))
    else:  # GATHER: groups and tiles do not nest; one scale (and zero) loaded a weight
        groups = (ks // GROUP_SIZE)[None, :]
        mask = row_ok[:, None] & k_ok[None, :]
        s = tl.load(scale + row_base * stride_s + groups * stride_sg, mask=mask, other=0.0).to(tl.float32)
        if BITS == 4:
            z = tl.load(zero + row_base * stride_z + groups * stride_zg, mask=mask, other=0).to(tl.float32)
            q = q - z
        w_tile = q * s
    return w_tile


# M (the step's rows) is not specialised on: Triton compiles a variant for M == 1 and for M % 16 == 0 otherwise,
# which would recompile mid-run as batches vary (the decode variants are picked from M already).
@triton.jit(do_not_specialize=["M"])
def _weight_only_matmul_kernel(
    x,
    w,
    scale,
    zero,
    bias,
    out,
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
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (column block, row block, K slice): out[rows, cols] (+)= x[rows, slice] W[cols, slice]^T (+ bias,
    added by slice 0). SPLIT_K > 1: out is fp32 and zeroed; slices add atomically."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x + rows.to(tl.int64)[:, None] * stride_xm
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        b = _dequantized_tile(
            w,
            scale,
            zero,
            cols,
            col_ok,
            k0,
            K,
            stride_w,
            stride_s,
            stride_sg,
            stride_z,
            stride_zg,
            BITS,
            GROUP_SIZE,
            SCALES,
            BLOCK_N,
            BLOCK_K,
        )
        if UPCAST:
            a = a.to(tl.float32)
        else:
            b = b.to(a.dtype)
        if USE_DOT:
            if IEEE:
                acc += tl.dot(a, tl.trans(b), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(b))
        else:
            acc += tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptrs, acc, mask=mask, sem="relaxed")  # the sum is read after the launch ends


@triton.jit
def _dequantize_kernel(
    w,
    scale,
    zero,
    out,
    N,
    K,
    stride_w,
    stride_s,
    stride_sg,
    stride_z,
    stride_zg,
    stride_o,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (row block, column block): out[rows, cols] = the dense weight, in out's dtype."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    k0 = tl.program_id(1) * BLOCK_K
    tile = _dequantized_tile(
        w,
        scale,
        zero,
        rows,
        row_ok,
        k0,
        K,
        stride_w,
        stride_s,
        stride_sg,
        stride_z,
        stride_zg,
        BITS,
        GROUP_SIZE,
        SCALES,
        BLOCK_N,
        BLOCK_K,
    )
    ks = k0 + tl.arange(0, BLOCK_K)
    ptrs = out + rows.to(tl.int64)[:, None] * stride_o + ks[None, :]
    tl.store(ptrs, tile.to(out.dtype.element_ty), mask=row_ok[:, None] & (ks < K)[None, :])


def _zero_arg(zero: torch.Tensor | None, scale: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The zero points and their row and group strides. int8 has none: the kernel never reads them, so the scale
    stands in for the pointer."""
    return (scale, 0, 0) if zero is None else (zero, zero.stride(0), zero.stride(1))


def scale_layout(group_size: int, block_k: int) -> int:
    """How a BLOCK_K tile (aligned to BLOCK_K) meets the scale groups: inside one, a whole number of them, or
    neither (a per-channel group of an odd size)."""
    if group_size % block_k == 0:
        return ONE_GROUP.value
    return (WHOLE_GROUPS if block_k % group_size == 0 else GATHER).value


def weight_only_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    bits: int,
    variant: Variant,
) -> torch.Tensor:
    """x [M, K] (last dim contiguous) times the quantized weight (int8 [N, K] or int4 [N, K // 2]) -> [M, N] in
    x's dtype. Shapes are checked by the caller (kernels.py)."""
    M, K = x.shape
    N = weight.shape[0]
    out_dtype = x.dtype
    if M == 0:
        return torch.empty((0, N), dtype=out_dtype, device=x.device)
    k_tiles = triton.cdiv(K, variant.block_k)
    split_k = max(1, min(variant.split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split_k) * variant.block_k
    split_k = triton.cdiv(K, k_per_split)  # no empty slice
    out = (
        torch.empty((M, N), dtype=out_dtype, device=x.device)
        if split_k == 1
        else torch.zeros((M, N), dtype=torch.float32, device=x.device)
    )
    zero_arg, stride_z, stride_zg = _zero_arg(zero, scale)
    grid = (triton.cdiv(N, variant.block_n), triton.cdiv(M, variant.block_m), split_k)
    _weight_only_matmul_kernel[grid](
        x,
        weight,
        scale,
        zero_arg,
        bias if bias is not None else scale,
        out,
        M,
        N,
        K,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        scale.stride(1),
        stride_z,
        stride_zg,
        out.stride(0),
        BITS=bits,
        GROUP_SIZE=group_size,
        SCALES=scale_layout(group_size, variant.block_k),
        HAS_BIAS=bias is not None,
        SPLIT_K=split_k,
        USE_DOT=variant.use_dot,
        UPCAST=x.device.type != "cuda",
        IEEE=x.device.type != "cuda" or x.dtype == torch.float32,
        BLOCK_M=variant.block_m,
        BLOCK_N=variant.block_n,
        BLOCK_K=variant.block_k,
        num_warps=variant.num_warps,
        num_stages=variant.num_stages,
    )
    return out if split_k == 1 else out.to(out_dtype)


def dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bits: int,
    dtype: torch.dtype,
    block_n: int = 32,
    block_k: int = 128,
) -> torch.Tensor:
    """The dense weight [N, K] in `dtype`, written by one kernel launch (the large-M path's scratch buffer)."""
    N = weight.shape[0]
    K = weight.shape[1] * (2 if bits == 4 else 1)
    out = torch.empty((N, K), dtype=dtype, device=weight.device)
    zero_arg, stride_z, stride_zg = _zero_arg(zero, scale)
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    _dequantize_kernel[grid](
        weight,
        scale,
        zero_arg,
        out,
        N,
        K,
        weight.stride(0),
        scale.stride(0),
        scale.stride(1),
        stride_z,
        stride_zg,
        out.stride(0),
        BITS=bits,
        GROUP_SIZE=group_size,
        SCALES=scale_layout(group_size, block_k),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out
