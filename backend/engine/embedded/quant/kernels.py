"""Quantized linear layers: y = x W^T + b with W in one of the internal formats (quant design, issue 25).

- fp8_linear: on a GPU with FP8 tensor cores (fp8_supported), x is quantized to float8_e4m3fn per token (its
  absmax / 448, or the checkpoint's static input_scale; one Triton launch, fp8_kernel.py) and torch._scaled_mm
  multiplies with row-wise scales (scale_a [M, 1], scale_b [1, N], fp32). Row-wise scaling is only sure to give
  bf16 output on every torch and backend (CUTLASS or cuBLAS), so the product and the bias are bf16 and a fp16 /
  fp32 model casts after.
- int8_linear, int4_linear: Triton kernels (weight_only_kernel.py) that dequantize the weight inside the
  matmul. M <= SMALL_M (decode): a GEMV or a 16-row tl.dot program, split along K when N alone does not fill
  the GPU. Larger M: LARGE_M_STRATEGY, "dequantize" (one kernel writes the dense weight into a scratch buffer,
  then F.linear), "tiled" (the tl.dot kernel) or, for int4, "int4_gemm" (int4_gemm.py).
Anywhere else (CPU, an older GPU, shapes _scaled_mm refuses) each falls back to the portable path: dequantize the
weight into x's dtype, then F.linear.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..attention.kv_store import RotaryStore
from ..network.fused_ops import fp8_rows_of
from . import int4_decode_kernel as int4_decode
from . import int4_gemm
from . import weight_only_kernel as wo
from .formats import FP8_MAX, dequantize_fp8, dequantize_int4, dequantize_int8
from .fp8_kernel import MIN_SCALE, quantize_rows
from .fp8_matmul_kernel import Fp8Tiles, fp8_matmul
from .int4_decode_kernel import DecodeVariant
from .int4_words import int32_viewable
from .norm_fold import FoldedInput, FoldingOutput
from .qkv_rotary import rotary_fits
from .weight_only_kernel import Variant

TRITON_ACTIVATION_QUANT = True  # False: quantize_per_token's torch ops on CUDA too
# FP8 GEMMs accumulate in the tensor cores' own precision, without promoting partial sums to fp32 along K (as
# vLLM's Hopper FP8 kernels do): ~8% faster on an H200 (docs/benchmarks.md); False promotes.
FP8_FAST_ACCUM = True

SMALL_M = 16
# Past SMALL_M rows: "int4_gemm" (int4_gemm.py, the weight tile as the tensor cores' register operand) for int4 up
# to int4_gemm.MAX_ROWS rows, "dequantize" (a scratch weight, then cuBLAS) past them and for int8, or "tiled"
# (weight_only_kernel's tl.dot). ci/gpu_quant_kernels.py times them (--int4-gemm, --sweep).
LARGE_M_STRATEGY = "int4_gemm"
NUM_SMS = 132  # an H200's; the decode variant's column blocks times its K split should reach it


# ---- FP8 ------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _fp8_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores (compute capability 8.9: Ada, Hopper and later) and a torch with _scaled_mm."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return _fp8_capable(device.index if device.index is not None else torch.cuda.current_device())


def quantize_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], fp32 scales [M, 1]) with x ~ x_q * scale: each row's absmax / 448, or
    the static per-tensor input_scale on every row (values past its range are clamped)."""
    if input_scale is None:
        amax = x.abs().amax(dim=-1, keepdim=True).to(torch.float32)
        scale = (amax / FP8_MAX).clamp_(min=MIN_SCALE)
    else:
        scale = input_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1).contiguous()
    x_q = (x.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x_q, scale


def fp8_tiles(m: int) -> Fp8Tiles | None:
    """The Triton FP8 matmul's tiles for m rows, or None where torch._scaled_mm is the faster (FP8_TRITON_ROWS:
    the row counts, from an H200 sweep, at which the Triton kernel won)."""
    if not FP8_TRITON_ROWS[0] <= m <= FP8_TRITON_ROWS[1]:
        return None
    if m <= 64:
        return Fp8Tiles(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if m <= 256:
        return Fp8Tiles(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)
    return Fp8Tiles(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


FP8_TRITON_ROWS = (0, 0)  # (fewest, most) rows the Triton FP8 matmul takes; (0, 0): _scaled_mm everywhere


# Rows up to which deferred scales pay (H200, Llama-3.1-8B's o_proj and down_proj: tensor-wise against row-wise
# 10.4 / 14.3 and 27.9 / 37.4 us at 256 rows, 7.7 / 13.8 and 18.2 / 37.1 at 64; even at 1,024).
DEFER_MAX_ROWS = 256
_ones: dict[torch.device, torch.Tensor] = {}


def _fp8_unscaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    x_rows: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """x_q W_q^T in fp32 without its scales, which it carries (fp8_pending_of) for the fused RMSNorm to apply."""
    if x_rows is not None:
        x_q, scale_a = x_rows
    else:
        x_q, scale_a = (quantize_rows if TRITON_ACTIVATION_QUANT else quantize_per_token)(x, input_scale)
    one = _ones.get(x.device)
    if one is None:  # made once, before any CUDA graph captures a launch that reads it
        one = _ones[x.device] = torch.ones((), dtype=torch.float32, device=x.device)
    out = torch._scaled_mm(
        x_q, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=FP8_FAST_ACCUM
    )
    out.fp8_pending = (scale_a, weight_scale.to(torch.float32), x.dtype)  # type: ignore[attr-defined]
    return out


def _fp8_scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    x_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    if x_rows is not None:  # quantized by the kernel that wrote x (network/fused_ops.py's FP8 rows)
        x_q, scale_a = x_rows
    else:
        x_q, scale_a = (quantize_rows if TRITON_ACTIVATION_QUANT else quantize_per_token)(x, input_scale)
    tiles = fp8_tiles(x.shape[0])
    if tiles is not None:
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        out = fp8_matmul(x_q, scale_a, weight, weight_scale.to(torch.float32), bias, out_dtype, tiles)
        return out if out.dtype == x.dtype else out.to(x.dtype)
    out = torch._scaled_mm(
        x_q,
        weight.t(),
        scale_a=scale_a,
        scale_b=weight_scale.to(torch.float32).reshape(1, -1),
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=torch.bfloat16,
        use_fast_accum=FP8_FAST_ACCUM,
    )
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
    defer_scales: bool = False,
) -> torch.Tensor:
    """x [..., K] times weight float8_e4m3fn [N, K] with weight_scale fp32 [N] (per output row); input_scale a
    static fp32 activation scale (one element) or None (dynamic, per token: the FP8 rows x carries, if any, are
    used as they are). Returns [..., N] in x's dtype.

    defer_scales (set by quant/fusion.py where the only reader is a fused RMSNorm, which applies them): at decode
    sizes on a GPU, a 2-D x without bias gets the unscaled product in fp32 instead, carrying its (row, column)
    scales (network/fused_ops.fp8_pending_of): cuBLASLt's tensor-wise FP8 GEMM is faster there than its row-wise one."""
    _check_fp8(x, weight, weight_scale, bias, input_scale)
    x2d = _rows(x)
    n, k = weight.shape
    if fp8_supported(x.device) and k % 16 == 0 and n % 16 == 0 and x2d.shape[0] > 0:
        x_rows = fp8_rows_of(x) if input_scale is None else None
        if defer_scales and x.dim() == 2 and bias is None and x2d.shape[0] <= DEFER_MAX_ROWS:
            return _fp8_unscaled_mm(x2d, weight, weight_scale, input_scale, x_rows)
        out = _fp8_scaled_mm(x2d, weight, weight_scale, bias, input_scale, x_rows)
    else:  # the same product in fp32, activations quantized as the GPU's are (so CPU accuracy figures are honest)
        x_q, scale_a = quantize_per_token(x2d, input_scale)
        out = F.linear(x_q.to(torch.float32) * scale_a, dequantize_fp8(weight, weight_scale))
        out = (out if bias is None else out + bias.to(torch.float32)).to(x.dtype)
    return out.reshape(*x.shape[:-1], n)


# ---- weight-only int8 / int4 ----------------------------------------------------------------------------------


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """x [..., K] times weight int8 [N, K] with weight_scale [N, K // group_size] in x's dtype. [..., N]."""
    _check_weight_only(x, weight, weight_scale, None, bias, group_size, bits=8)
    if x.device.type != "cuda":
        return F.linear(x, dequantize_int8(weight, weight_scale, group_size), bias)
    return weight_only_triton(x, weight, weight_scale, None, bias, group_size, bits=8)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """x [..., K] times qweight uint8 [N, K // 2] (two columns a byte, low nibble even) with weight_scale
    [N, K // group_size] in x's dtype and weight_zero uint8 of the same shape: w = (q - zero) * scale. [..., N]."""
    _check_weight_only(x, qweight, weight_scale, weight_zero, bias, group_size, bits=4)
    if x.device.type != "cuda":
        return F.linear(x, dequantize_int4(qweight, weight_scale, weight_zero, group_size), bias)
    return weight_only_triton(x, qweight, weight_scale, weight_zero, bias, group_size, bits=4)


def int4_one_row(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    folded_input: FoldedInput | None = None,
    folding: FoldingOutput | None = None,
    gate_up_runs: int = 0,
    rotary: RotaryStore | None = None,
) -> torch.Tensor:
    """int4_linear of one row through the decode kernel (CUDA, or Triton's interpreter), with norm_fold.py's
    halves: x a folded norm's h * g (folded_input), and/or the norm after it begun here (folding, where
    int4_folds holds). gate_up_runs (int4_gate_up_runs's): qweight's rows are gate_up's in such runs and the
    result is silu(gate) * up [..., N / 2] (gate_up_runs.py). rotary (where int4_rotates holds): qweight is
    qkv_proj's, and the row comes out rotated and stored into the KV caches (qkv_rotary.py)."""
    _check_weight_only(x, qweight, weight_scale, weight_zero, bias, group_size, bits=4)
    x2d = _rows(x)
    if x2d.shape[0] != 1:
        raise ValueError(f"int4_one_row takes one row of x, got {x2d.shape[0]}")
    variant = _one_row_variant(qweight.shape[0], x2d.shape[1], group_size, x.dtype)
    if variant is None:
        raise ValueError(f"the int4 decode kernel does not take x {x.dtype} with groups of {group_size}")
    out = int4_decode.int4_decode_matmul(
        x2d, qweight, weight_scale, weight_zero, bias, group_size, variant, folded_input, folding, gate_up_runs, rotary
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _one_row_variant(n: int, k: int, group_size: int, dtype: torch.dtype) -> DecodeVariant | None:
    """The decode kernel's shape for one row of an [n, k] int4 projection with x in dtype, None where it does not
    take it."""
    variant = choose_decode_variant(1, n, k, group_size)
    return variant if _int4_decode_applies(dtype, group_size, variant) else None


def int4_one_row_applies(n: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
    """int4_one_row takes one row of an [n, k] int4 projection with x in dtype."""
    return _one_row_variant(n, k, group_size, dtype) is not None


def int4_folds(n: int, k: int, group_size: int, dtype: torch.dtype) -> bool:
    """int4_one_row takes it, through a kernel shape that can begin a folded norm (folding)."""
    variant = _one_row_variant(n, k, group_size, dtype)
    return variant is not None and int4_decode.folds(variant)


def int4_gate_up_runs(qweight: torch.Tensor, group_size: int, dtype: torch.dtype) -> int:
    """The runs (rows) in which the gate and up rows of gate_up's qweight [N, K / 2] must alternate for
    int4_one_row to apply the SiLU itself (half a program's rows); 0 where its kernel shape cannot
    (int4_decode.folds), N does not split, or its rows are not whole words (the byte GEMV's programs differ)."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    variant = _one_row_variant(n, k, group_size, dtype)
    if variant is None or not int4_decode.folds(variant) or variant.block_n % 2 or n % variant.block_n:
        return 0
    return variant.block_n // 2 if int32_viewable(qweight) or not variant.words else 0


def int4_rotates(qweight: torch.Tensor, group_size: int, dtype: torch.dtype, head_dim: int) -> bool:
    """int4_one_row can rotate qkv_proj's row and store it into the KV caches (its `rotary`): a kernel shape that
    folds (int4_decode.folds) with programs that hold rotary pairs, over rows of whole words."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    variant = _one_row_variant(n, k, group_size, dtype)
    if variant is None or not int4_decode.folds(variant) or not (variant.words and int32_viewable(qweight)):
        return False
    return rotary_fits(variant.block_n, head_dim)


def choose_variant(m: int, n: int, k: int) -> Variant:
    """The program shape for an [m, k] x [k, n] product. Decode (m <= SMALL_M): the int4 sweep's best over
    Llama-3.1-8B's four projections at m = 1 and 8 on an H200 (2026-12-02, docs/gpu-runs.md): tl.dot tiles of 16
    rows even for one token (one-row GEMV programs were 4x slower), K steps of 256, split K 4; int8 takes the same
    (not swept). Larger m: untuned defaults."""
    if m <= SMALL_M:
        return Variant(block_m=16, block_n=64, block_k=256, split_k=max(1, min(4, k // 256)))
    if m <= 64:
        return Variant(block_m=32, block_n=64, block_k=64)
    return Variant(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)


def choose_decode_variant(m: int, n: int, k: int, group_size: int = 128) -> DecodeVariant:
    """The int4 decode kernel's program shape for m <= SMALL_M rows (int4_decode_kernel.py), from GPU sweeps over
    Llama-3.1-8B's four projections (docs/gpu-runs.md). One row: the GPU's table (one_row_table) where it has
    (N, K) (lane GEMVs, 49.6 us for the four on an H200 against bf16's 113.7), else a lane GEMV of default shape
    (default_lane_gemv), or where the groups are not whole lanes' columns the byte GEMV, one warp a program, 32
    columns, K in 16 slices (77 us on the H100). More rows: 16-row tl.dot tiles, two warps, 64 columns and 8
    slices, or 128 columns and 2 slices for the wide gate/up projection."""
    table = one_row_table()
    if m == 1 and (n, k) in table:
        return table[(n, k)]
    # (bf16 stands for x here: _int4_decode_applies checks x's own dtype)
    if m == 1 and int4_decode.supports(torch.bfloat16, group_size, lanes := default_lane_gemv(n, k)):
        return lanes
    if m == 1:
        return DecodeVariant(block_m=1, block_n=32, block_k=128, split_k=16, num_warps=1, num_stages=1, use_dot=False)
    if n >= 16384:
        return DecodeVariant(block_m=16, block_n=128, block_k=128, split_k=2, num_warps=2, num_stages=3)
    return DecodeVariant(block_m=16, block_n=64, block_k=128, split_k=max(1, min(8, k // 512)), num_warps=2)


@functools.cache  # (eager decode asks for each projection's shape at every call)
def default_lane_gemv(n: int, k: int) -> DecodeVariant:
    """A lane GEMV for a shape no sweep covered: 4 rows a program and two warps (steps of 2,048 columns) where K
    holds a step (the H100 sweep's best single shape over Llama-3.1-8B's four projections: 55.4 us against their
    own bests' 54.3), one warp for shorter K, and K split in up to 4 slices while the programs are fewer than two
    an SM."""
    warps = 2 if k >= 2048 else 1
    programs, steps = -(-n // 4), -(-k // (1024 * warps))
    split = 1
    while split < 4 and programs * split < 2 * NUM_SMS and steps >= 2 * split:
        split *= 2
    return lane_gemv(4, warps, split_k=split)


def weight_only_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    bits: int,
) -> torch.Tensor:
    """The Triton path of int8_linear / int4_linear (CUDA's; tests also run it on CPU, through the interpreter)."""
    x2d = _rows(x)
    m, k = x2d.shape
    n = weight.shape[0]
    decode = choose_decode_variant(m, n, k, group_size) if bits == 4 and m <= SMALL_M else None
    tiles = _int4_gemm_tiles(m, bits, group_size)
    if tiles is not None:
        assert zero is not None
        out = int4_gemm.int4_gemm(x2d, weight, scale, zero, bias, group_size, tiles)
    elif m > SMALL_M and LARGE_M_STRATEGY != "tiled":
        out = F.linear(x2d, wo.dequantize(weight, scale, zero, group_size, bits, x.dtype), bias)
    elif decode is not None and _int4_decode_applies(x.dtype, group_size, decode):
        assert zero is not None
        out = int4_decode.int4_decode_matmul(x2d, weight, scale, zero, bias, group_size, decode)
    else:
        out = wo.weight_only_matmul(x2d, weight, scale, zero, bias, group_size, bits, choose_variant(m, n, k))
    return out.reshape(*x.shape[:-1], n)


def _int4_gemm_tiles(m: int, bits: int, group_size: int) -> int4_gemm.GemmTiles | None:
    """int4_gemm's tiles where it takes these rows (SMALL_M < m <= MAX_ROWS, int4, a group its K steps fit in)."""
    if LARGE_M_STRATEGY != "int4_gemm" or bits != 4 or not SMALL_M < m <= int4_gemm.MAX_ROWS:
        return None
    tiles = int4_gemm.tiles_for(m, group_size)
    return tiles if int4_gemm.fits(group_size, tiles) else None


def _int4_decode_applies(dtype: torch.dtype, group_size: int, variant: DecodeVariant) -> bool:
    return INT4_DECODE_KERNEL and int4_decode.supports(dtype, group_size, variant)


INT4_DECODE_KERNEL = True  # False: int4 decode through weight_only_kernel's general kernel


def word_gemv(
    block_n: int, block_k: int, warps: int, x_vector: bool = False, prefetch: bool = True, pdl: bool = True
) -> DecodeVariant:
    """A word-GEMV shape of whole rows (no split K); by default each step's words requested before the previous
    step's arithmetic, launched with PDL where the GPU has it (its first words read while the kernel before it
    ends)."""
    return DecodeVariant(
        block_m=1,
        block_n=block_n,
        block_k=block_k,
        num_warps=warps,
        num_stages=1,
        use_dot=False,
        words=True,
        x_vector=x_vector,
        prefetch=prefetch,
        pdl=pdl,
    )


def lane_gemv(rows: int, warps: int, split_k: int = 1, prefetch: bool = True, pdl: bool = True) -> DecodeVariant:
    """A lane-GEMV shape (int4_lanes.py): `rows` output columns a program, each lane reading four words of each
    a step (1,024 input columns a warp), K cut into split_k slices; prefetch and PDL as in word_gemv."""
    return replace(word_gemv(rows, 1024 * warps, warps, prefetch=prefetch, pdl=pdl), split_k=split_k, lanes=True)


def mma_gemv(tiles: int, warps: int, split_k: int = 1, pdl: bool = True) -> DecodeVariant:
    """A tensor-core GEMV shape (int4_mma.py): `tiles` of 16 rows a warp (1 or 2), K steps of 128 columns cut
    into split_k slices (each step's loads always ahead of the step before it); PDL as in word_gemv."""
    rows = int4_decode.int4_mma.TILE_ROWS * tiles * warps
    variant = word_gemv(rows, int4_decode.int4_mma.STEP, warps, pdl=pdl)
    return replace(variant, split_k=split_k, mma=True)


# One row's program shape by (N, K), ahead of default_lane_gemv: each projection's best in a GPU sweep
# (`QUANT_ARGS=--lanes QUANT_MS=1 bash ci/gpu_session.sh int4-decode-sweep`; bench-quant's w4a16-1-swept runs a
# sweep's table). Llama-3.1-8B's (and Mistral-7B's) shapes from an H200 sweep, 2026-12-06 (docs/gpu-runs.md,
# twenty-ninth session, call 2), us against bf16's; the H100's best in the twenty-fifth session's sweep in brackets
# (the same shapes, but gate_up's 4 rows and one warp there).
ONE_ROW_SHAPES: dict[tuple[int, int], DecodeVariant] = {
    (6144, 4096): lane_gemv(8, 2),  # qkv_proj 6.88 us against bf16's 14.90 (H100 8.16)
    (4096, 4096): lane_gemv(4, 2),  # o_proj 5.91, 12.58 (6.30)
    (28672, 4096): lane_gemv(8, 2),  # gate_up_proj 22.62, 54.91 (24.84)
    (4096, 14336): lane_gemv(4, 2),  # down_proj 14.18, 31.35 (14.96)
}

# An H100's own (its sweep with group-major scales, 2026-12-07, docs/gpu-runs.md, thirty-third session): the
# four at 52.4 us against 55.3 with the H200's shapes, 375.4 tok/s end to end against 363.6 (bench-quant's
# w4a16-1-swept against w4a16-1, the same call).
ONE_ROW_SHAPES_H100: dict[tuple[int, int], DecodeVariant] = {
    (6144, 4096): lane_gemv(8, 2),  # qkv_proj 7.46 us against bf16's 20.05
    (4096, 4096): lane_gemv(4, 2, prefetch=False),  # o_proj 6.15, 15.10
    (28672, 4096): lane_gemv(4, 1, split_k=4, prefetch=False),  # gate_up_proj 24.65, 77.22
    (4096, 14336): lane_gemv(4, 2, prefetch=False),  # down_proj 14.11, 41.97
}


@functools.cache  # (asked at every eager one-row call)
def one_row_table() -> dict[tuple[int, int], DecodeVariant]:
    """The one-row shapes of this process's GPU: ONE_ROW_SHAPES_H100 on an H100, else ONE_ROW_SHAPES."""
    on_h100 = torch.cuda.is_available() and "H100" in torch.cuda.get_device_name()
    return ONE_ROW_SHAPES_H100 if on_h100 else ONE_ROW_SHAPES


# ---- inputs ---------------------------------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, K] with a contiguous last dimension (the kernels' and _scaled_mm's layout)."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 and (x2d.shape[0] <= 1 or x2d.stride(0) == x2d.shape[1]) else x2d.contiguous()


def _check_bias(bias: torch.Tensor | None, n: int, dtype: torch.dtype) -> None:
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype):
        raise ValueError(
            f"bias must be [{n}] (one per output row) in x's dtype {dtype}, got {bias.dtype} {tuple(bias.shape)}"
        )


def _check_fp8(x, weight, weight_scale, bias, input_scale) -> None:
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(
            f"fp8 weight must be a contiguous 2-D float8_e4m3fn tensor (its transpose is _scaled_mm's column-major "
            f"operand), got {weight.dtype} {tuple(weight.shape)} strides {weight.stride()}"
        )
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features but the fp8 weight [{n}, {k}] takes {k}")
    if weight_scale.shape != (n,):
        raise ValueError(f"fp8 weight_scale must be [{n}] (one per output row), got {tuple(weight_scale.shape)}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"fp8 input_scale must hold one value (per tensor), got {tuple(input_scale.shape)}")
    _check_bias(bias, n, x.dtype)


def _check_weight_only(x, weight, scale, zero, bias, group_size: int, bits: int) -> None:
    name = f"int{bits}"
    wanted = torch.uint8 if bits == 4 else torch.int8
    if weight.dtype != wanted or weight.dim() != 2:
        raise ValueError(f"{name} weight must be 2-D {wanted}, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape[0], weight.shape[1] * (2 if bits == 4 else 1)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features but the {name} weight takes {k}")
    if x.dtype not in wo.DTYPES:
        raise ValueError(f"x must be one of {wo.DTYPES}, got {x.dtype}")
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{name} group_size must divide the {k} input features, got {group_size}")
    groups = (n, k // group_size)
    if scale.shape != groups or scale.dtype != x.dtype:
        raise ValueError(
            f"{name} weight_scale must be {list(groups)} in x's dtype {x.dtype}, got {scale.dtype} {tuple(scale.shape)}"
        )
    if zero is not None and (zero.shape != groups or zero.dtype != torch.uint8):
        raise ValueError(f"int4 weight_zero must be uint8 {list(groups)}, got {zero.dtype} {tuple(zero.shape)}")
    if weight.stride(-1) != 1:  # (scales and zero points may be strided either way: the kernels take both)
        raise ValueError(f"{name} weight must have a contiguous last dimension")
    _check_bias(bias, n, x.dtype)
