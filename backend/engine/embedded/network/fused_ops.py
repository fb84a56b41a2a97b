"""Fused Triton kernels for the elementwise steps of a decoder layer: RMSNorm (with the residual add folded in),
rotary embedding in place, and SiLU-gated multiply. At batch 1 a decode step on a large GPU is bound by how many
tiny kernels it launches, not by their work; each of these replaces a handful of PyTorch ops with one launch. They
compute what layers.py computes (RMSNorm, apply_rotary, F.silu(gate) * up), in fp32, and round where it does or,
for rotary and SiLU, once at the end.

Layouts: 2-D (rotary: 3-D) tensors whose last dimension is contiguous; rows may be any stride apart (column slices
of a fused matmul's output). fp32, bf16 and fp16.

Every launch is CUDA-graph capturable: grids and constexprs depend on shapes only, outputs come from torch.empty,
nothing syncs with the host. The token count only sets the grid (one program a row), never a kernel argument, so a
new token count compiles nothing.

FP8 rows: where an FP8 projection with dynamic per-token scales reads a norm's or the SiLU's output, the kernel
also writes that output quantized as quant/fp8_kernel.quantize_rows would quantize it (each row's absmax / 448 of
the rounded values), saving the projection a launch that reads the rows again. The pair rides on the output
tensor as its `fp8_rows` attribute (fp8_rows_of); a projection handed any other tensor quantizes it itself.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported). Its bfloat16
arithmetic is wrong; these kernels never do any: every loaded value is converted to fp32 first, on every device
(nothing here wants low-precision math on the GPU, so unlike triton_kernels they need no UPCAST switch). Its fp32 ->
bf16 cast truncates where a GPU (and torch) rounds to nearest even, so there (ROUND_BF16) the kernels round the
bits by hand before casting (rounding.py), and give the GPU's results on CPU too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import begin, small_kernel_args
from ..quant.formats import FP8_DTYPE
from ..quant.fp8_kernel import row_scale, store_fp8
from ..rotary_ops import check_rotary, load_rotation, rotate_pairs
from ..rounding import DTYPES, round_to, rounds_bf16_by_hand

MAX_NORM_BLOCK = 65536  # a row of rms_norm lives in one program's registers
ROTARY_BLOCK = 1024  # (head, pair) elements a rotary program rotates at most
SILU_BLOCK = 1024  # output columns a silu_and_mul program writes (a step of its FP8 rows' loop)
SILU_FP8_WARPS = 8


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x,
    residual,
    weight,
    out,
    sum_out,
    fp8_out,
    fp8_scales,
    eps,
    num_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    row_scales,
    col_scales,
    HAS_RESIDUAL: tl.constexpr,
    FP8_ROWS: tl.constexpr,
    SCALED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Program (row): out = weight * round(h * rsqrt(mean(h^2) + eps)), h = x (+ residual, rounded and stored to
    sum_out), rounding to out's dtype (a no-op in fp32) and the product rounded once; FP8_ROWS: out's row
    quantized into fp8_out (contiguous) and its scale into fp8_scales too. SCALED: x is an unscaled fp32 FP8
    product, first scaled by its row's and columns' scales and rounded to out's dtype (as fp8_linear's would)."""
    begin(RELEASE, WAIT)  # the matmul after it may start reading its weights (pdl.py)
    dtype = out.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < num_cols
    # the weight requested first: after the sum's barrier its DRAM round trip would be a second one in a row
    w = tl.load(weight + cols, mask=ok, other=0.0).to(tl.float32)
    h = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if SCALED:
        h *= tl.load(row_scales + row)
        h = round_to(h * tl.load(col_scales + cols, mask=ok, other=0.0), dtype, ROUND_BF16).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        rounded = round_to(h, dtype, ROUND_BF16)
        tl.store(sum_out + row * stride_s + cols, rounded, mask=ok)
        h = rounded.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / num_cols + eps)
    normed = round_to(h * rstd, dtype, ROUND_BF16).to(tl.float32)
    result = round_to(normed * w, dtype, ROUND_BF16)
    tl.store(out + row * stride_o + cols, result, mask=ok)
    if FP8_ROWS:
        values = result.to(tl.float32)
        scale = row_scale(tl.max(tl.abs(values), 0))
        tl.store(fp8_scales + row, scale)
        store_fp8(fp8_out + row * num_cols + cols, values, scale, ok)


@triton.jit
def _rotary_kernel(
    x,
    cos,
    sin,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Program (token, head block): rotates pairs (i, i + HALF) of BLOCK_H heads in place, in fp32."""
    begin(RELEASE, WAIT)  # (pdl.py)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF_P)
    d_ok = d < HALF
    cos1, cos2, sin1, sin2 = load_rotation(cos, sin, token, stride_ct, stride_st, d, d_ok, HALF)
    ok = (head < num_heads)[:, None] & d_ok[None, :]
    first = x + token * stride_xt + head[:, None] * stride_xh + d[None, :]
    rotate_pairs(first, ok, cos1, cos2, sin1, sin2, HALF, ROUND_BF16)


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up in fp32, written once for every kernel that applies the SiLU (so all round alike)."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _silu_and_mul_kernel(
    gate_up,
    out,
    block_amax,
    size,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    AMAX: tl.constexpr,
    RUNS: tl.constexpr,
    RELEASE: tl.constexpr,
    WAIT: tl.constexpr,
):
    """Program (row, column block): out = silu(gate) * up in fp32, gate and up the two halves of the row (RUNS:
    alternating runs of RUNS gates and RUNS ups, layers.split_gate_up). AMAX: also the block's absmax of the
    rounded values, into block_amax [rows, column blocks] (for _fp8_blocks_kernel)."""
    begin(RELEASE, WAIT)  # the matmul after it may start reading its weights (pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    if RUNS:
        gates = (cols // RUNS) * (2 * RUNS) + cols % RUNS
        ups = gates + RUNS
    else:
        gates, ups = cols, size + cols
    gate = tl.load(gate_up + row * stride_in + gates, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row * stride_in + ups, mask=ok, other=0.0).to(tl.float32)
    result = round_to(silu_times(gate, up), out.dtype.element_ty, ROUND_BF16)
    tl.store(out + row * stride_out + cols, result, mask=ok)
    if AMAX:
        tl.store(block_amax + row * tl.num_programs(1) + tl.program_id(1), tl.max(tl.abs(result.to(tl.float32)), 0))


@triton.jit
def _fp8_blocks_kernel(
    x, block_amax, fp8_out, fp8_scales, size, stride_x, blocks, BLOCK: tl.constexpr, BLOCKS: tl.constexpr
):
    """Program (row, column block): the row's scale from the absmax of its blocks (written by the launch before),
    then the block quantized into fp8_out (contiguous); block 0 stores the scale."""
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, BLOCKS)
    amax = tl.max(tl.load(block_amax + row * blocks + index, mask=index < blocks, other=0.0), 0)
    scale = row_scale(amax)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < size
    values = tl.load(x + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    store_fp8(fp8_out + row * size + cols, values, scale, ok)
    if tl.program_id(1) == 0:
        tl.store(fp8_scales + row, scale)


@triton.jit
def _silu_and_mul_fp8_kernel(
    gate_up, out, fp8_out, fp8_scales, size, stride_in, stride_out, BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr
):
    """Program (row): _silu_and_mul_kernel's row, then that row quantized into fp8_out (contiguous) with its scale
    in fp8_scales: a second pass over the row just written (from the cache), once its absmax is known."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < size
        gate = tl.load(gate_up + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up + row * stride_in + size + cols, mask=ok, other=0.0).to(tl.float32)
        result = round_to(silu_times(gate, up), out.dtype.element_ty, ROUND_BF16)
        tl.store(out + row * stride_out + cols, result, mask=ok)
        amax = tl.maximum(amax, tl.abs(result.to(tl.float32)))
    scale = row_scale(tl.max(amax, 0))
    tl.store(fp8_scales + row, scale)
    tl.debug_barrier()  # the row's values, written by other threads, are read back below
    for start in range(0, size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < size
        values = tl.load(out + row * stride_out + cols, mask=ok, other=0.0).to(tl.float32)
        store_fp8(fp8_out + row * size + cols, values, scale, ok)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, fp8_rows: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """layers.RMSNorm over the rows of x [T, N] with weight [N] (x's dtype). With residual (x's shape and dtype):
    s = x + residual, rounded to x's dtype as torch's add rounds; returns (rms_norm(s), s), s a new tensor (x and
    residual are left as they are). Outputs are contiguous. fp8_rows: the normed output carries its FP8 rows.
    An unscaled FP8 product x (fp8_pending_of) is scaled first; its dtype is then the one it rounds to."""
    _check_rows("x", x)
    num_rows, num_cols = x.shape
    pending = fp8_pending_of(x)
    dtype = x.dtype if pending is None else pending[2]
    if weight.shape != (num_cols,) or weight.dtype != dtype or weight.device != x.device:
        raise ValueError(
            f"weight {tuple(weight.shape)} {weight.dtype} on {weight.device} does not fit x "
            f"{tuple(x.shape)} {dtype} on {x.device} (wanted [{num_cols}], the same dtype and device)"
        )
    if num_cols == 0:
        raise ValueError("x has no columns to normalise")
    if weight.stride(0) != 1 and num_cols > 1:
        raise ValueError("weight must be contiguous")
    block = triton.next_power_of_2(num_cols)
    if block > MAX_NORM_BLOCK:
        raise ValueError(f"rows of {num_cols} are too long for one program (at most {MAX_NORM_BLOCK})")
    out = torch.empty((num_rows, num_cols), dtype=dtype, device=x.device)
    if residual is None:
        sums, residual_arg = out, x  # unused (HAS_RESIDUAL off)
    else:
        _check_rows("residual", residual)
        if residual.shape != x.shape or residual.dtype != dtype or residual.device != x.device:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} on {residual.device} does not "
                f"match x {tuple(x.shape)} {dtype} on {x.device}"
            )
        sums, residual_arg = torch.empty_like(out), residual
    fp8_out, fp8_scales = _fp8_outputs(out) if fp8_rows else (out, out)
    row_scales, col_scales = pending[:2] if pending is not None else (out, out)
    if num_rows:
        _rms_norm_kernel[(num_rows,)](
            x,
            residual_arg,
            weight,
            out,
            sums,
            fp8_out,
            fp8_scales,
            eps,
            num_cols,
            x.stride(0),
            residual_arg.stride(0),
            out.stride(0),
            sums.stride(0),
            row_scales,
            col_scales,
            HAS_RESIDUAL=residual is not None,
            FP8_ROWS=fp8_rows,
            SCALED=pending is not None,
            BLOCK=block,
            ROUND_BF16=rounds_bf16_by_hand(out),
            num_warps=4 if block < 2048 else 8 if block < 8192 else 16,
            **small_kernel_args(x.device),
        )
    if fp8_rows:
        out.fp8_rows = (fp8_out, fp8_scales)  # type: ignore[attr-defined]  # see fp8_rows_of
    return out if residual is None else (out, sums)


def _fp8_outputs(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for out's FP8 rows: float8 values of its shape and one fp32 scale a row."""
    return torch.empty(out.shape, dtype=FP8_DTYPE, device=out.device), torch.empty(
        (out.shape[0], 1), dtype=torch.float32, device=out.device
    )


def fp8_pending_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.dtype] | None:
    """(row scales fp32 [T, 1], column scales fp32 [N], the dtype the scaled values round to) when x is an unscaled
    FP8 product (quant/kernels.fp8_linear's defer_scales), else None. Only the very tensor returned carries them."""
    return getattr(x, "fp8_pending", None)


def fp8_rows_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(float8 [T, N], fp32 scales [T, 1]) of x when a kernel here wrote them beside it (fp8_rows=True), else None.
    Views of x do not carry them: only the very tensor the kernel returned."""
    return getattr(x, "fp8_rows", None)


def rotary_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """layers.apply_rotary, in place: x [T, H, D] (last dim contiguous, token and head strides free: a view into a
    fused qkv output works), cos and sin [T, D] (last dim contiguous). Computed in fp32, rounded once to x's dtype.
    Returns x."""
    check_rotary("x", x, cos, sin)
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens == 0 or num_heads == 0 or head_dim == 0:
        return x
    half = head_dim // 2
    half_p = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(num_heads), ROTARY_BLOCK // half_p))
    _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        x,
        cos,
        sin,
        num_heads,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=half,
        HALF_P=half_p,
        BLOCK_H=block_h,
        ROUND_BF16=rounds_bf16_by_hand(x),
        num_warps=4,
        **small_kernel_args(x.device),
    )
    return x


def silu_and_mul(gate_up: torch.Tensor, fp8_rows: bool = False, runs: int = 0) -> torch.Tensor:
    """gate_up [T, 2I] (last dim contiguous) -> silu(gate) * up [T, I], gate and up = gate_up.split(I, -1), or
    with `runs` layers.split_gate_up's runs (quant/gate_up_runs.py); computed in fp32, rounded once. The output
    is contiguous. fp8_rows: it carries its FP8 rows (halves only)."""
    _check_rows("gate_up", gate_up)
    num_rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has {width} columns, not two equal halves")
    size = width // 2
    if runs and (size % runs or fp8_rows):
        raise ValueError(f"gate_up's {size} columns in runs of {runs} (with FP8 rows: {fp8_rows}) are not taken")
    out = torch.empty((num_rows, size), dtype=gate_up.dtype, device=gate_up.device)
    if fp8_rows and not SILU_FP8_SPLIT:
        return _silu_and_mul_fp8_rows(gate_up, out)
    block = min(SILU_BLOCK, triton.next_power_of_2(max(size, 1)))
    blocks = triton.cdiv(size, block)
    block_amax = torch.empty((num_rows, blocks), dtype=torch.float32, device=gate_up.device) if fp8_rows else out
    if num_rows and size:
        _silu_and_mul_kernel[(num_rows, blocks)](
            gate_up,
            out,
            block_amax,
            size,
            gate_up.stride(0),
            out.stride(0),
            BLOCK=block,
            ROUND_BF16=rounds_bf16_by_hand(gate_up),
            AMAX=fp8_rows,
            RUNS=runs,
            num_warps=4,
            **small_kernel_args(gate_up.device),
        )
    if fp8_rows:
        out.fp8_rows = _fp8_blocks(out, block_amax)  # type: ignore[attr-defined]  # see fp8_rows_of
    return out


# SiLU's FP8 rows as two launches over column blocks (the SiLU writing each block's absmax, then the quantizer
# reading them), rather than one program a row walking its 14k columns twice (latency-bound at a decode batch).
SILU_FP8_SPLIT = True
FP8_BLOCK = 2048  # columns a _fp8_blocks_kernel program quantizes


def _fp8_blocks(out: torch.Tensor, block_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out's FP8 rows, from the absmax of each of its rows' column blocks."""
    fp8_out, fp8_scales = _fp8_outputs(out)
    num_rows, size = out.shape
    if num_rows and size:
        block = min(FP8_BLOCK, triton.next_power_of_2(size))
        blocks = block_amax.shape[1]
        _fp8_blocks_kernel[(num_rows, triton.cdiv(size, block))](
            out,
            block_amax,
            fp8_out,
            fp8_scales,
            size,
            out.stride(0),
            blocks,
            BLOCK=block,
            BLOCKS=triton.next_power_of_2(blocks),
            num_warps=4,
        )
    return fp8_out, fp8_scales


def _silu_and_mul_fp8_rows(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """silu_and_mul with FP8 rows in one launch, one program a row (SILU_FP8_SPLIT off)."""
    fp8_out, fp8_scales = _fp8_outputs(out)
    num_rows, size = out.shape
    if num_rows and size:
        _silu_and_mul_fp8_kernel[(num_rows,)](
            gate_up,
            out,
            fp8_out,
            fp8_scales,
            size,
            gate_up.stride(0),
            out.stride(0),
            BLOCK=min(SILU_BLOCK, triton.next_power_of_2(size)),
            ROUND_BF16=rounds_bf16_by_hand(gate_up),
            num_warps=SILU_FP8_WARPS,
        )
    out.fp8_rows = (fp8_out, fp8_scales)  # type: ignore[attr-defined]  # see fp8_rows_of
    return out


def _check_rows(name: str, t: torch.Tensor) -> None:
    """A 2-D tensor of a supported dtype whose last dimension is contiguous."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, columns], got shape {tuple(t.shape)}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; supported: {', '.join(map(str, DTYPES))}")
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{name} needs a contiguous last dimension (strides {t.stride()})")
