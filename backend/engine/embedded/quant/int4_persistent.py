"""The one-row lane GEMV as a persistent kernel (DecodeVariant.persistent): a fixed number of programs, each
taking row blocks pid, pid + P, pid + 2P, ... in turn, with every next K step's words (the next block's first
one at a block's end) requested before this step's arithmetic.

Why it may pay: at K = 4,096 a lane-GEMV program of two warps has two K steps. Its words arrive about one DRAM
round trip after it starts and its arithmetic follows; the programs of a wave start together, so within a wave
loads and arithmetic hardly overlap. On the H200, gate_up's 3,584 programs make ~2.3 waves and its 22.6 us is
about its bytes' time plus its instructions' time (~12 + ~10 us), not the larger of the two. A persistent program
keeps a step's loads in flight from one block into the next. (A model to be timed: bench-quant's sweep.)

Each block's sums, epilogue included, are the lane GEMV's (int4_lanes.py, int4_decode_kernel.py) step for step, so
the two give the same bits (but for a folded norm's sums of squares, added into a slot a program, so in another
order): the epilogues take the block's index where the other kernel takes its program's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import release_dependents, wait_for_inputs
from .gate_up_runs import store_activated
from .int4_lanes import _lanes_step, _step_words
from .norm_fold import SLOTS, FoldedInput, FoldingOutput, fold_args, fold_epilogue, folded_scale
from .qkv_rotary import RotaryStore, rotary_args, rotary_constants, rotary_rows, rotate_and_store

FOLD_SLOTS = tl.constexpr(SLOTS)
INTERPRETED_SMS = 1  # SMs counted on the interpreter (CPU tests): a few programs, fewer than the blocks


@triton.jit
def _block_rows(block, N, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, ROTARY: tl.constexpr, HEADS, KV_HEADS, HEAD_DIM):
    """The output columns of row block `block` and the rows read for them (past N: row N - 1, never stored)."""
    if ROTARY:
        cols = rotary_rows(block, BLOCK_N, HEADS, KV_HEADS, HEAD_DIM)
    else:
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    if EVEN_N:
        return cols, cols.to(tl.int64)
    return cols, tl.minimum(cols, N - 1).to(tl.int64)


@triton.jit
def int4_persistent_kernel(
    x,
    w,
    scale,
    zero,
    bias,
    out,
    N,
    K,
    stride_w,
    stride_s,
    stride_sg,
    stride_z,
    stride_zg,
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
    FOLD_IN: tl.constexpr,
    FOLD_OUT: tl.constexpr,
    GATED: tl.constexpr,
    ROTARY: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANTIZE_KV: tl.constexpr,
    USE_ASM: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program p: out[cols of blocks p, p + P, ...] = x W[cols]^T, each block ending as the lane GEMV's would
    (FOLD_IN, FOLD_OUT, GATED, ROTARY and the bias as in int4_decode_kernel.py; w the int32 view)."""
    PAIRS: tl.constexpr = USE_ASM and x.dtype.element_ty == tl.bfloat16
    ROUND_BF16: tl.constexpr = INTERPRETED and out.dtype.element_ty == tl.bfloat16  # the epilogues' (rounding.py)
    program, programs = tl.program_id(0), tl.num_programs(0)
    steps = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - program, programs) * steps  # (the grid has no more programs than blocks)
    _, kept = _block_rows(program, N, BLOCK_N, EVEN_N, ROTARY, HEADS, KV_HEADS, HEAD_DIM)
    words = _step_words(w + kept[:, None] * stride_w, 0, K, K, BLOCK_K, EVEN_K)
    release_dependents(PDL)
    wait_for_inputs(PDL)
    x_scale = 1.0
    if FOLD_IN:
        x_scale = folded_scale(scale_sums, K, scale_eps, FOLD_SLOTS)
    lanes = tl.zeros((words.shape[0], words.shape[1] // 4), dtype=tl.float32)
    block, k0 = program, 0
    for t in range(0, total):
        ends = k0 + BLOCK_K >= K  # this step is its block's last
        next_block, next_k0 = tl.where(ends, block + programs, block), tl.where(ends, 0, k0 + BLOCK_K)
        ahead = t + 1 < total  # (after the last step: that step's words again, cached)
        ahead_block, ahead_k0 = tl.where(ahead, next_block, block), tl.where(ahead, next_k0, k0)
        _, kept_ahead = _block_rows(ahead_block, N, BLOCK_N, EVEN_N, ROTARY, HEADS, KV_HEADS, HEAD_DIM)
        upcoming = _step_words(w + kept_ahead[:, None] * stride_w, ahead_k0, K, K, BLOCK_K, EVEN_K)
        cols, kept = _block_rows(block, N, BLOCK_N, EVEN_N, ROTARY, HEADS, KV_HEADS, HEAD_DIM)
        scales = (scale + kept * stride_s, zero + kept * stride_z, stride_sg, stride_zg)
        lanes += _lanes_step(words, x, scales, k0, K, GROUP_SIZE, USE_ASM, PAIRS, EVEN_K)
        if ends:
            y = tl.sum(lanes, axis=1)
            if FOLD_IN:
                y *= x_scale
            col_ok = cols < N
            if HAS_BIAS:
                y += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)
            if FOLD_OUT:
                residual = tl.load(fold_residual + kept).to(tl.float32)
                fold_epilogue(
                    y, residual, cols, col_ok, out, fold_weight, fold_h, fold_sums, fold_stale, FOLD_SLOTS, ROUND_BF16
                )
            elif GATED:
                store_activated(y, out, block, N // 2, BLOCK_N // 2, ROUND_BF16)
            elif ROTARY:
                caches = (rot_k_cache, rot_v_cache, rot_slots, rot_stride_cs, rot_stride_ch, rot_k_inv, rot_v_inv)
                rotate_and_store(
                    y,
                    cols,
                    block,
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
            else:
                tl.store(out + cols, y.to(out.dtype.element_ty), mask=col_ok)
            lanes = tl.zeros_like(lanes)
        words = upcoming
        block, k0 = next_block, next_k0


def persistent_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    group_size: int,
    variant,
    pdl: bool,
    options: dict,
    folded_input: FoldedInput | None = None,
    folding: FoldingOutput | None = None,
    gated: bool = False,
    rotary: RotaryStore | None = None,
) -> torch.Tensor:
    """One row x [1, K] times the int32 words [N, K / 8] in programs of variant's shape (a DecodeVariant with
    persistent programs an SM), launched with PDL or not and the launch options (int4_decode_kernel._launch);
    the epilogues as int4_decode_kernel.int4_decode_matmul's, which checks them."""
    block_n, block_k = variant.block_n, variant.block_k
    N, K = words.shape[0], x.shape[1]
    out = torch.empty((1, N // 2 if gated else N), dtype=x.dtype, device=x.device)
    if rotary is not None:
        rotary.check(out)
    blocks = triton.cdiv(N, block_n)
    cuda = x.device.type == "cuda"
    programs = min(blocks, variant.persistent * (sm_count(x.device) if cuda else INTERPRETED_SMS))
    int4_persistent_kernel[(programs,)](
        x,
        words,
        scale,
        zero,
        bias if bias is not None else scale,
        out,
        N,
        K,
        words.stride(0),
        scale.stride(0),
        scale.stride(1),
        zero.stride(0),
        zero.stride(1),
        *fold_args(out, folded_input, folding),
        *rotary_args(rotary, out),
        GROUP_SIZE=group_size,
        HAS_BIAS=bias is not None,
        FOLD_IN=folded_input is not None,
        FOLD_OUT=folding is not None,
        GATED=gated,
        **rotary_constants(rotary),
        USE_ASM=variant.use_asm and cuda,  # the interpreter knows no PTX
        EVEN_K=K % block_k == 0,
        EVEN_N=N % block_n == 0,
        PDL=pdl,
        INTERPRETED=not cuda,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=variant.num_warps,
        num_stages=1,
        **options,
    )
    return out


def sm_count(device: torch.device) -> int:
    """The GPU's SMs (tests lower it, so that a launch has fewer programs than blocks)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count
