"""W4A16 for decode (a few rows of x): y = x W^T + b with the int4 weight of formats.py, in one Triton launch.

Where weight_only_kernel.py's general kernel dequantizes every weight ((q - zero) * scale, with an integer to
float conversion and a float to bf16 one on each), this one does almost no arithmetic per weight, so that a
decode step is bound by reading the packed bytes, not by the CUDA cores unpacking them:
- A nibble q becomes the bf16 (or fp16) number 128 + q (1024 + q) by bit operations alone: OR-ing q into the
  mantissa of 128's (1024's) bit pattern (int4_bytes.py for the byte layout; int4_words.py, int4_lanes.py and
  int4_mma.py read the weights as int32 words for one row).
- The low nibbles (even input columns) and the high ones (odd columns) stay apart: the product is
  x[:, even] . lo^T + x[:, odd] . hi^T, two tl.dot calls, so no interleave is needed.
- Zero point and scale are applied once per (row, group) instead of once per weight: over one group,
  sum_k x_k (q_k - z) s = s (sum_k x_k (MAGIC + q_k) - (MAGIC + z) sum_k x_k). A K step therefore never crosses a
  group boundary (the group size is a multiple of BLOCK_K).
The products are exact (small integers times x) and accumulated in fp32; the subtraction loses a few of fp32's
bits, far below the bf16 output's rounding.

SPLIT_K > 1 cuts K into slices, for shapes whose column blocks alone do not fill the GPU: the slices add into a
persistent fp32 workspace and the last to finish a tile writes it out and zeroes it, all in the one launch (a
zeroed buffer and a cast after would be two more launches, as long at decode as the matmul itself).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .. import gpu_fence
from ..gpu_fence import add_slice
from ..pdl import launch_options, pdl_on
from . import int4_mma
from .gate_up_runs import store_activated
from .int4_bytes import tile_product
from .int4_lanes import WORDS_A_WARP, lanes_row
from .int4_mma import magic_value
from .int4_words import int32_viewable, words_row
from .norm_fold import SLOTS, FoldedInput, FoldingOutput, fold_epilogue, folded_scale
from .qkv_rotary import RotaryStore, rotary_args, rotary_constants, rotary_fits, rotary_rows, rotate_and_store

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # fp32: exact fp32 products instead of the magic
FOLD_SLOTS = tl.constexpr(SLOTS)


@dataclass(frozen=True)
class DecodeVariant:
    """One program shape; ci/gpu_quant_kernels.py --sweep times several (kernels.choose_decode_variant)."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    use_asm: bool = True  # CUDA only; the interpreter always takes the arithmetic path
    use_dot: bool = True  # False: the CUDA cores' multiply-and-sum, for one row or a few (block_m from 1)
    prefetch: bool = False  # load the next K step's weights before this one's arithmetic (tl.dot pipelines itself)
    words: bool = False  # one row: the weights read as int32 words, each made into eight fp32 values (_word_values)
    x_vector: bool = False  # words: each step's x read as one vector and split eight ways (int4_words._step_x)
    pdl: bool = False  # words: launched with PDL where the GPU has it (pdl.py), its first weights read early
    lanes: bool = False  # words: each lane's sums kept apart until the end (int4_lanes.py); block_k 1,024 a warp
    mma: bool = False  # words: on tensor cores (int4_mma.py); block_k 128, block_n 16 or 32 rows a warp
    max_registers: int = 0  # a cap on registers a thread (more programs an SM), 0: the compiler's choice

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            least = 1 if name == "block_m" and not self.use_dot else 4 if name == "block_n" and self.words else 16
            if value < least or value & (value - 1):
                raise ValueError(f"DecodeVariant.{name} must be a power of two >= {least}, got {value}")
        if self.split_k < 1:
            raise ValueError(f"DecodeVariant.split_k must be >= 1, got {self.split_k}")
        if self.words and (self.block_m != 1 or self.use_dot):
            raise ValueError("DecodeVariant.words is the one-row GEMV: block_m=1, use_dot=False")
        mma_rows = [int4_mma.TILE_ROWS * tiles * self.num_warps for tiles in (1, 2)]
        for name in ("x_vector", "pdl", "lanes", "mma"):
            if getattr(self, name) and not self.words:
                raise ValueError(f"DecodeVariant.{name} is the word GEMV's (words=True)")
        if self.lanes and (self.block_k != 8 * WORDS_A_WARP * self.num_warps or self.x_vector):
            raise ValueError(
                f"DecodeVariant.lanes reads 1,024 columns a warp a step: block_k {8 * WORDS_A_WARP * self.num_warps} "
                f"for {self.num_warps} warps (got {self.block_k}), and its own x (x_vector=False)"
            )
        if self.mma and (self.lanes or self.x_vector or self.block_k != int4_mma.STEP or self.block_n not in mma_rows):
            raise ValueError(
                f"DecodeVariant.mma reads {int4_mma.STEP} columns a step (block_k) and 16 or 32 rows a warp: block_n "
                f"{' or '.join(map(str, mma_rows))} for {self.num_warps} warps (got block_k {self.block_k}, block_n "
                f"{self.block_n}), without lanes or x_vector"
            )
        if self.max_registers and not 24 <= self.max_registers <= 255:
            raise ValueError(f"DecodeVariant.max_registers must be 0 or 24-255, got {self.max_registers}")


def supports(x_dtype: torch.dtype, group_size: int, variant: DecodeVariant) -> bool:
    """This kernel applies: x of a float type it takes, and K steps that stay inside one scale group (the word
    GEMV's may also hold whole groups)."""
    whole_groups = variant.words and variant.block_k % group_size == 0
    lanes_fit = not variant.lanes or group_size % 32 == 0  # a lane's 32 columns inside one group
    # the mma's B is 16-bit, and a step's sums take one scale
    mma_fits = not variant.mma or (x_dtype in (torch.bfloat16, torch.float16) and group_size % variant.block_k == 0)
    return x_dtype in DTYPES and (group_size % variant.block_k == 0 or whole_groups) and lanes_fit and mma_fits


SPLIT_ROWS = 16  # a split K is for decode: at most this many rows, the workspace's
_MAX_TILES = gpu_fence.MAX_TILES  # (a name of this module's: tests lower it)


def _split_buffers(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace [SPLIT_ROWS, n] and counters of this kernel's split-K launches (gpu_fence.split_buffers)."""
    return gpu_fence.split_buffers(device, SPLIT_ROWS, n)


@triton.jit(do_not_specialize=["M"])
def _int4_decode_kernel(
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
    scale_sums,
    scale_eps,
    fold_residual,
    fold_weight,
    fold_h,
    fold_sums,
    fold_stale,
    rot_cos,
    rot_sin,
    rot_k_cache,
    rot_v_cache,
    rot_slots,
    rot_stride_cs,
    rot_stride_ch,
    rot_k_inv,
    rot_v_inv,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FOLD_IN: tl.constexpr,
    FOLD_OUT: tl.constexpr,
    GATED: tl.constexpr,
    ROTARY: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANTIZE_KV: tl.constexpr,
    USE_ASM: tl.constexpr,
    FP16: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr,
    WORDS: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    X_VECTOR: tl.constexpr,
    PDL: tl.constexpr,
    LANES: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (column block, row block, K slice): out[rows, cols] (+)= x[rows, slice] W[cols, slice]^T.
    FOLD_IN: x is a folded norm's h * g, the product scaled by its 1 / rms; FOLD_OUT (one row, whole K): the norm
    after this projection begins in the epilogue (norm_fold.py, both). GATED (one row, whole K): the rows are
    gate_up's in runs of BLOCK_N / 2, and out [1, N / 2] gets silu(gate) * up (gate_up_runs.py). ROTARY (one
    row, whole K): the rows are qkv's, rotated and stored into the KV caches as well (qkv_rotary.py)."""
    HALF: tl.constexpr = BLOCK_K // 2
    if ROTARY:
        cols = rotary_rows(tl.program_id(0), BLOCK_N, HEADS, KV_HEADS, HEAD_DIM)
    else:
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if EVEN_N:  # no clamp: the columns' scales then read as one vector where they are contiguous (group-major)
        kept = cols.to(tl.int64)
    else:  # columns past N read column N - 1's weights, never stored
        kept = tl.minimum(cols, N - 1).to(tl.int64)
    w_rows = w + kept[:, None] * stride_w
    x_rows = x + rows.to(tl.int64)[:, None] * stride_xm
    s_rows = scale + kept * stride_s
    z_rows = zero + kept * stride_z
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    residual_cols = tl.zeros((BLOCK_N,), dtype=tl.float32)  # FOLD_OUT's residual, read early by the lane GEMV
    if WORDS:  # w is the int32 view, stride_w in words (nested ifs: `WORDS and LANES` would not fold)
        scales = (s_rows, z_rows, stride_sg, stride_zg)
        span = (k_start, k_end, K)
        if LANES:
            early = fold_residual + kept  # FOLD_OUT's residual, read while the K loop runs
            row, residual_cols = lanes_row(
                w_rows, x, scales, span, GROUP_SIZE, USE_ASM, BLOCK_K, EVEN_K, PREFETCH, PDL, early, FOLD_OUT
            )
            acc += row[None, :]
        else:
            acc += words_row(
                w_rows, x, scales, span, col_ok, GROUP_SIZE, USE_ASM, BLOCK_K, EVEN_K, X_VECTOR, PREFETCH, PDL
            )[None, :]
    else:
        pairs = k_start // 2 + tl.arange(0, HALF)  # byte j holds columns 2j (low nibble) and 2j + 1 (high)
        if PREFETCH:
            upcoming = tl.load(w_rows + pairs[None, :], mask=col_ok[:, None] & (pairs < k_end // 2)[None, :], other=0)
        for k0 in range(k_start, k_end, BLOCK_K):
            if PREFETCH:  # the next step's bytes are requested before this step's arithmetic: two tiles in flight
                packed = upcoming
                pairs += HALF
                upcoming = tl.load(
                    w_rows + pairs[None, :], mask=col_ok[:, None] & (pairs < k_end // 2)[None, :], other=0
                )
            else:
                step_pairs = tl.multiple_of(k0 // 2, HALF) + tl.arange(0, HALF)
                if EVEN_K:  # no K mask: the bytes load in 16-byte vectors
                    packed = tl.load(w_rows + step_pairs[None, :], mask=col_ok[:, None], other=0)
                else:
                    packed = tl.load(
                        w_rows + step_pairs[None, :], mask=col_ok[:, None] & (step_pairs < K // 2)[None, :], other=0
                    )
            ks = k0 + tl.arange(0, BLOCK_K)
            x_tile = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
            x_even, x_odd = tl.split(tl.reshape(x_tile, (BLOCK_M, HALF, 2)))
            part = tile_product(packed, x_even, x_odd, USE_ASM, FP16, UPCAST, USE_DOT, BLOCK_M, BLOCK_N, HALF)
            x_sum = tl.sum(x_even.to(tl.float32) + x_odd.to(tl.float32), axis=1)
            group = k0 // GROUP_SIZE
            s = tl.load(s_rows + group * stride_sg, mask=col_ok, other=0.0).to(tl.float32)
            z = tl.load(z_rows + group * stride_zg, mask=col_ok, other=0).to(tl.float32) + magic_value(FP16)
            acc += (part - x_sum[:, None] * z[None, :]) * s[None, :]
    if FOLD_IN:  # (the slots read after lanes_row's PDL wait, as x is)
        acc *= folded_scale(scale_sums, K, scale_eps, FOLD_SLOTS)
    if HAS_BIAS:
        if tl.program_id(2) == 0:
            acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    ROUND_BF16: tl.constexpr = INTERPRETED and out.dtype.element_ty == tl.bfloat16  # the epilogues' (rounding.py)
    if FOLD_OUT:
        if not LANES:
            residual_cols = tl.load(fold_residual + kept).to(tl.float32)
        y = tl.sum(acc, axis=0)  # the one row
        outputs = (out, fold_weight, fold_h, fold_sums, fold_stale)  # (constexprs stay out of tuples)
        fold_epilogue(y, residual_cols, cols, col_ok, *outputs, FOLD_SLOTS, ROUND_BF16)
    elif GATED:
        store_activated(tl.sum(acc, axis=0), out, tl.program_id(0), N // 2, BLOCK_N // 2, ROUND_BF16)
    elif ROTARY:
        caches = (rot_k_cache, rot_v_cache, rot_slots, rot_stride_cs, rot_stride_ch, rot_k_inv, rot_v_inv)
        rotate_and_store(
            tl.sum(acc, axis=0),
            cols,
            tl.program_id(0),
            out,
            rot_cos,
            rot_sin,
            *caches,
            BLOCK_N,
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            QUANTIZE_KV,
            ROUND_BF16,
        )
    elif SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=mask)
    else:
        # Slices add into the fp32 workspace; the tile's last slice to arrive takes the sum out and leaves
        # workspace and counter zero for the next launch (gpu_fence.add_slice).
        ws_ptrs = workspace + rows.to(tl.int64)[:, None] * N + cols[None, :]
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        add_slice(acc, ws_ptrs, out_ptrs, mask, counters, tile, SPLIT_K, INTERPRETED)


def int4_decode_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    variant: DecodeVariant,
    folded_input: FoldedInput | None = None,
    folding: FoldingOutput | None = None,
    gate_up_runs: int = 0,
    rotary: RotaryStore | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16 / fp16 / fp32, last dim contiguous) times qweight uint8 [N, K // 2]
    -> [M, N] in x's dtype; scale and zero [N, groups] row- or group-major. Shapes are checked by the caller
    (kernels.py); supports() must hold. folded_input, folding: norm_fold.py's two halves (folding: one row, and
    folds() must hold). gate_up_runs: qweight is gate_up's in runs of that many rows, and the result [1, N / 2] is
    silu(gate) * up (gate_up_runs.py; one row, folds() must hold, a program's rows two runs). rotary: qweight is
    qkv_proj's, and its one row is rotated and stored into the caches too (qkv_rotary.py; folds() must hold)."""
    M, K = x.shape
    if variant.words and not int32_viewable(qweight):
        # rows not whole words: the byte GEMV reads them, in steps inside one scale group
        block_n, block_k = max(16, variant.block_n), math.gcd(variant.block_k, group_size)
        variant = replace(
            variant, words=False, x_vector=False, pdl=False, lanes=False, block_n=block_n, block_k=block_k
        )
    # int4_mma.py reads neither rows it cannot load in 16 bytes nor a folded input: a lane GEMV for one row,
    # 16-row tl.dot tiles for more
    if variant.mma and (folded_input is not None or not _mma_reads(x, qweight)):
        lanes = replace(variant, mma=False, lanes=True, block_n=4, block_k=8 * WORDS_A_WARP * variant.num_warps)
        variant = lanes if M == 1 else DecodeVariant(block_n=64, block_k=variant.block_k, num_warps=2)
    N = qweight.shape[0]
    if M == 0:
        return torch.empty((0, N), dtype=x.dtype, device=x.device)
    gated = gate_up_runs > 0
    if (folding is not None or gated) and not (M == 1 and folds(variant)):
        raise ValueError(f"a norm or the SiLU folds into one row's GEMV without split K, not {M} rows via {variant}")
    if gated and (folding is not None or N % variant.block_n or variant.block_n != 2 * gate_up_runs):
        raise ValueError(f"gate_up's {N} rows in runs of {gate_up_runs} through programs of {variant.block_n} rows")
    if rotary is not None and not (M == 1 and folds(variant) and folding is None and not gated):
        raise ValueError(f"qkv's rotation folds into one row's GEMV without split K or other epilogue, not {variant}")
    if rotary is not None and not rotary_fits(variant.block_n, rotary.head_dim):
        raise ValueError(f"programs of {variant.block_n} rows do not hold rotary pairs of head_dim {rotary.head_dim}")
    if variant.mma:
        return _mma_gemv(x, qweight.view(torch.int32), scale, zero, bias, group_size, variant)
    tiles = triton.cdiv(N, variant.block_n) * triton.cdiv(M, variant.block_m)
    splittable = M <= SPLIT_ROWS and tiles <= _MAX_TILES and folding is None
    split_k, k_per_split = gpu_fence.k_slices(K, variant.block_k, variant.split_k, splittable)
    out = torch.empty((M, N // 2 if gated else N), dtype=x.dtype, device=x.device)
    if rotary is not None:
        rotary.check(out)
    workspace, counters = _split_buffers(x.device, N) if split_k > 1 else (out, out)
    weights = qweight.view(torch.int32) if variant.words else qweight  # K // 2 bytes a row: a multiple of 4
    pdl, options = _launch(variant, x.device)  # (pdl is the word GEMV's: DecodeVariant checks it)
    grid = (triton.cdiv(N, variant.block_n), triton.cdiv(M, variant.block_m), split_k)
    _int4_decode_kernel[grid](
        x,
        weights,
        scale,
        zero,
        bias if bias is not None else scale,
        out,
        workspace,
        counters,
        M,
        N,
        K,
        k_per_split,
        x.stride(0),
        weights.stride(0),
        scale.stride(0),
        scale.stride(1),
        zero.stride(0),
        zero.stride(1),
        out.stride(0),
        *_fold_args(out, folded_input, folding),
        *rotary_args(rotary, out),
        GROUP_SIZE=group_size,
        HAS_BIAS=bias is not None,
        SPLIT_K=split_k,
        FOLD_IN=folded_input is not None,
        FOLD_OUT=folding is not None,
        GATED=gated,
        **rotary_constants(rotary),
        USE_ASM=variant.use_asm and x.device.type == "cuda",  # the interpreter knows no PTX
        FP16=x.dtype == torch.float16,
        UPCAST=x.device.type != "cuda" or x.dtype == torch.float32,
        USE_DOT=variant.use_dot,
        PREFETCH=variant.prefetch,
        WORDS=variant.words,
        EVEN_K=K % variant.block_k == 0,
        EVEN_N=N % variant.block_n == 0,
        X_VECTOR=variant.x_vector,
        PDL=pdl,
        LANES=variant.lanes,
        INTERPRETED=x.device.type != "cuda",
        BLOCK_M=variant.block_m,
        BLOCK_N=variant.block_n,
        BLOCK_K=variant.block_k,
        num_warps=variant.num_warps,
        num_stages=variant.num_stages,
        **options,
    )
    return out


def folds(variant: DecodeVariant) -> bool:
    """A one-row GEMV of this shape can end with a folded norm's first half (norm_fold.py): K whole, not split,
    and the rows one program's (not int4_mma.py's tiles)."""
    return variant.split_k == 1 and not variant.mma and variant.block_m == 1


def _fold_args(out: torch.Tensor, folded_input: FoldedInput | None, folding: FoldingOutput | None) -> tuple:
    """The kernel's scale_sums .. fold_stale arguments (out where unused)."""
    scale = (folded_input.sums, folded_input.eps) if folded_input is not None else (out, 0.0)
    if folding is None:
        return (*scale, out, out, out, out, out)
    return (*scale, folding.residual, folding.weight, folding.h_out, folding.sums, folding.stale)


def _launch(variant: DecodeVariant, device: torch.device) -> tuple[bool, dict[str, bool | int]]:
    """Whether the launch uses PDL here, and its launch options (PDL, a register cap on CUDA)."""
    pdl = variant.pdl and pdl_on(device)
    options: dict[str, bool | int] = dict(launch_options(pdl))
    if variant.max_registers and device.type == "cuda":
        options["maxnreg"] = variant.max_registers
    return pdl, options


def _mma_reads(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """int4_mma.py's 16-byte loads can read x (one row) and the weights' rows; else a lane GEMV instead."""
    aligned = x.data_ptr() % 16 == 0 and qweight.data_ptr() % 16 == 0 and qweight.stride(0) % 16 == 0
    return x.shape[0] == 1 and aligned and int32_viewable(qweight) and x.shape[1] % int4_mma.STEP == 0


def _mma_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    variant: DecodeVariant,
) -> torch.Tensor:
    """One row x [1, K] times the int32 words [N, K / 8] on tensor cores (int4_mma.py), K in split_k slices."""
    N, K = words.shape[0], x.shape[1]
    programs = triton.cdiv(N, variant.block_n)
    split_k, k_per_split = gpu_fence.k_slices(K, int4_mma.STEP, variant.split_k, programs <= _MAX_TILES)
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    workspace, counters = _split_buffers(x.device, N) if split_k > 1 else (out, out)
    pdl, options = _launch(variant, x.device)
    int4_mma.int4_mma_kernel[(programs, split_k)](
        x,
        words,
        scale,
        zero,
        bias if bias is not None else scale,
        out,
        workspace,
        counters,
        N,
        K,
        k_per_split,
        words.stride(0),
        scale.stride(0),
        scale.stride(1),
        zero.stride(0),
        zero.stride(1),
        GROUP_SIZE=group_size,
        HAS_BIAS=bias is not None,
        SPLIT_K=split_k,
        TILES=variant.block_n // (int4_mma.TILE_ROWS * variant.num_warps),
        WARPS=variant.num_warps,
        FP16=x.dtype == torch.float16,
        USE_ASM=variant.use_asm and x.device.type == "cuda",  # the interpreter knows no PTX
        PDL=pdl,
        INTERPRETED=x.device.type != "cuda",
        num_warps=variant.num_warps,
        num_stages=1,
        **options,
    )
    return out
