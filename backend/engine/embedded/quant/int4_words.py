"""The one-row int4 GEMV's K step over int32 words (int4_decode_kernel.py's DecodeVariant.words).

The byte GEMV hands bytes to its PTX four at a time and sums K across threads: in sm90 SASS its K loop spends 8.1
instructions a weight (ci/int4_sass.py), which bounds it near 1.6-1.9 TB/s on an H200. Here each int32 word of
packed weights becomes its eight nibbles' fp32 values in ten instructions, and each thread sums whole words along
K: 3.8-4.5 instructions a weight in the same compiles."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import release_dependents, wait_for_inputs

# Each nibble of a word goes to mantissa bits 12-15 or 16-19 of an fp32 number whose exponent is 128's, so one
# LOP3 makes it 128 + q / 16 or 128 + q. The word itself holds nibbles 3 and 4 there; shifted by 8 either way it
# holds 1, 2 and 5, 6; rotated by 16 (one PRMT), 7 and 0. Nibble i of word c is input column 8c + i; the odd
# nibbles come out divided by 16 (their x is multiplied by 16 instead), or, with 2048's exponent instead of
# 128's (`odd_magic`), as 2048 + q. Lower bits would leave too few of fp32's 24 for the sums (at bits 8-11,
# q / 256 against 128: 2^-9 relative).
_EVEN_MAGIC, _ODD_MAGIC_2048 = 0x43000000, 0x45000000  # 128.0 and 2048.0


def _word_asm(odd_magic: int) -> str:
    even, odd = f"{_EVEN_MAGIC:#010x}", f"{odd_magic:#010x}"
    return f"""{{
    .reg .b32 left, right, turned;
    shl.b32 left, $8, 8;
    shr.u32 right, $8, 8;
    prmt.b32 turned, $8, 0, 0x1032;
    lop3.b32 $0, turned, 0x000F0000, {even}, 0xEA;
    lop3.b32 $1, left, 0x0000F000, {odd}, 0xEA;
    lop3.b32 $2, left, 0x000F0000, {even}, 0xEA;
    lop3.b32 $3, $8, 0x0000F000, {odd}, 0xEA;
    lop3.b32 $4, $8, 0x000F0000, {even}, 0xEA;
    lop3.b32 $5, right, 0x0000F000, {odd}, 0xEA;
    lop3.b32 $6, right, 0x000F0000, {even}, 0xEA;
    lop3.b32 $7, turned, 0x0000F000, {odd}, 0xEA;
    }}"""


_WORD_ASM = tl.constexpr(_word_asm(_EVEN_MAGIC))
_WORD_ASM_2048 = tl.constexpr(_word_asm(_ODD_MAGIC_2048))


@triton.jit
def _word_value(words, i: tl.constexpr, ODD_2048: tl.constexpr = False):
    """Nibble i of each int32 word as fp32 128 + q (where i is odd: q / 16, or 2048 + q under ODD_2048), by
    arithmetic."""
    q = ((words >> (4 * i)) & 0xF).to(tl.float32)
    if i % 2 == 1:
        if ODD_2048:
            return q + 2048.0
        q = q * 0.0625
    return q + 128.0


@triton.jit
def _word_values(words, USE_ASM: tl.constexpr, ODD_2048: tl.constexpr = False):
    """int32 words -> the eight nibbles' fp32 values (_word_value), with eleven PTX instructions on CUDA."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm=_WORD_ASM_2048 if ODD_2048 else _WORD_ASM,
            constraints="=r,=r,=r,=r,=r,=r,=r,=r,r",
            args=[words],
            dtype=(tl.float32,) * 8,
            is_pure=True,
            pack=1,
        )
    return (
        _word_value(words, 0, ODD_2048),
        _word_value(words, 1, ODD_2048),
        _word_value(words, 2, ODD_2048),
        _word_value(words, 3, ODD_2048),
        _word_value(words, 4, ODD_2048),
        _word_value(words, 5, ODD_2048),
        _word_value(words, 6, ODD_2048),
        _word_value(words, 7, ODD_2048),
    )


@triton.jit
def _step_x(x, word_ids, k_ok, k0, K, BLOCK_K, X_VECTOR):
    """The step's x in eight [WORDS] vectors, x_i[c] = x[8c + i] in fp32 (word_ids: the step's words, k_ok: those
    inside K); the odd ones, whose nibble values are q / 16, times 16."""
    WORDS: tl.constexpr = BLOCK_K // 8
    if X_VECTOR:
        ks = tl.multiple_of(k0, BLOCK_K) + tl.arange(0, BLOCK_K)  # k0 is a multiple of BLOCK_K
        x_step = tl.load(x + ks, mask=ks < K, other=0.0).to(tl.float32)
        evens, odds = tl.split(tl.reshape(x_step, (WORDS, 4, 2)))  # columns 0 2 4 6 and 1 3 5 7 of each word
        e04, e26 = tl.split(tl.reshape(evens, (WORDS, 2, 2)))
        o15, o37 = tl.split(tl.reshape(odds, (WORDS, 2, 2)))
        x0, x4 = tl.split(e04)
        x2, x6 = tl.split(e26)
        x1, x5 = tl.split(o15)
        x3, x7 = tl.split(o37)
    else:
        ks = 8 * word_ids
        x0 = tl.load(x + ks, mask=k_ok, other=0.0).to(tl.float32)
        x1 = tl.load(x + ks + 1, mask=k_ok, other=0.0).to(tl.float32)
        x2 = tl.load(x + ks + 2, mask=k_ok, other=0.0).to(tl.float32)
        x3 = tl.load(x + ks + 3, mask=k_ok, other=0.0).to(tl.float32)
        x4 = tl.load(x + ks + 4, mask=k_ok, other=0.0).to(tl.float32)
        x5 = tl.load(x + ks + 5, mask=k_ok, other=0.0).to(tl.float32)
        x6 = tl.load(x + ks + 6, mask=k_ok, other=0.0).to(tl.float32)
        x7 = tl.load(x + ks + 7, mask=k_ok, other=0.0).to(tl.float32)
    return x0, x1 * 16.0, x2, x3 * 16.0, x4, x5 * 16.0, x6, x7 * 16.0


@triton.jit
def load_words(w_rows, k0, K, col_ok, valid, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The int32 words of the K step at k0 (a multiple of BLOCK_K) for each column: [BLOCK_N, BLOCK_K // 8]; none
    read where `valid` (a scalar) is false. EVEN_K (K a multiple of BLOCK_K): no K mask, so that they load in
    16-byte vectors (a scalar mask keeps them)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    word_ids = tl.multiple_of(k0 // 8, WORDS) + tl.arange(0, WORDS)
    mask = (col_ok & (tl.zeros_like(col_ok) | valid))[:, None]  # (the interpreter refuses a scalar in a mask)
    if not EVEN_K:
        mask = mask & (word_ids < K // 8)[None, :]
    return tl.load(w_rows + word_ids[None, :], mask=mask, other=0)


@triton.jit
def words_step(words, x, scales, k0, K, col_ok, GROUP_SIZE, USE_ASM, BLOCK_K, X_VECTOR):
    """One K step of one row x against its int32 words (load_words): [BLOCK_N] fp32, zero point and scale
    applied (scales: the columns' scale and zero-point pointers and their strides between groups). With v the
    nibble values and x' = x (* 16 where v = 128 + q / 16): sum x' v = 128 sum x' + sum q x.
    A step may span several scale groups (BLOCK_K a multiple of GROUP_SIZE): each group's sums are scaled apart.
    X_VECTOR: the step's x read as one vector and split eight ways (fewer loads, but through shared memory), not
    in eight strided loads."""
    WORDS: tl.constexpr = BLOCK_K // 8
    s_rows, z_rows, stride_sg, stride_zg = scales
    word_ids = tl.multiple_of(k0 // 8, WORDS) + tl.arange(0, WORDS)  # k0 is a multiple of BLOCK_K
    k_ok = word_ids < K // 8
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_values(words, USE_ASM)
    x0, x1, x2, x3, x4, x5, x6, x7 = _step_x(x, word_ids, k_ok, k0, K, BLOCK_K, X_VECTOR)
    prod = v0 * x0[None, :] + v1 * x1[None, :] + v2 * x2[None, :] + v3 * x3[None, :]  # one chain: a multiply,
    prod = prod + v4 * x4[None, :] + v5 * x5[None, :] + v6 * x6[None, :] + v7 * x7[None, :]  # then seven FFMAs
    sixteenths = x1 + x3 + x5 + x7
    others = x0 + x2 + x4 + x6
    if BLOCK_K <= GROUP_SIZE:  # one group: (the compiler visits what follows a return, so no early return)
        part = tl.sum(prod, axis=1)
        x_scaled_sum = 128.0 * tl.sum(sixteenths + others)
        x_sum = tl.sum(sixteenths * 0.0625 + others)
        group = k0 // GROUP_SIZE
        s = tl.load(s_rows + group * stride_sg, mask=col_ok, other=0.0).to(tl.float32)
        z = tl.load(z_rows + group * stride_zg, mask=col_ok, other=0).to(tl.float32)
        step = (part - x_scaled_sum - x_sum * z) * s
    else:
        GROUPS: tl.constexpr = BLOCK_K // GROUP_SIZE
        PER_GROUP: tl.constexpr = WORDS // GROUPS
        part = tl.sum(tl.reshape(prod, (prod.shape[0], GROUPS, PER_GROUP)), axis=2)  # [BLOCK_N, GROUPS]
        x_scaled_sums = 128.0 * tl.sum(tl.reshape(sixteenths + others, (GROUPS, PER_GROUP)), axis=1)
        x_sums = tl.sum(tl.reshape(sixteenths * 0.0625 + others, (GROUPS, PER_GROUP)), axis=1)
        groups = k0 // GROUP_SIZE + tl.arange(0, GROUPS)
        group_ok = col_ok[:, None] & (groups < K // GROUP_SIZE)[None, :]
        s = tl.load(s_rows[:, None] + groups[None, :] * stride_sg, mask=group_ok, other=0.0).to(tl.float32)
        z = tl.load(z_rows[:, None] + groups[None, :] * stride_zg, mask=group_ok, other=0).to(tl.float32)
        step = tl.sum((part - x_scaled_sums[None, :] - x_sums[None, :] * z) * s, axis=1)
    return step


@triton.jit
def words_row(w_rows, x, scales, span, col_ok, GROUP_SIZE, USE_ASM, BLOCK_K, EVEN_K, X_VECTOR, PREFETCH, PDL):
    """One row x times the columns' words over span (k_start, k_end, K: whole K steps): [BLOCK_N] fp32; scales:
    (s_rows, z_rows, stride_sg, stride_zg), the columns' scale and zero-point pointers and group strides. The first
    step's words are requested before waiting for the kernels before this one (PDL: no kernel writes weights),
    so that their DRAM round trip overlaps that wait; PREFETCH: each step's words are requested before the
    previous step's arithmetic, two steps in flight."""
    k_start, k_end, K = span
    words = load_words(w_rows, k_start, K, col_ok, k_start < k_end, BLOCK_K, EVEN_K)  # (always true)
    release_dependents(PDL)
    wait_for_inputs(PDL)
    total = tl.zeros(col_ok.shape, dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        following = k0 + BLOCK_K
        if PREFETCH:  # the next step's words requested before this step's arithmetic
            upcoming = load_words(w_rows, following, K, col_ok, following < k_end, BLOCK_K, EVEN_K)
        step = words_step(words, x, scales, k0, K, col_ok, GROUP_SIZE, USE_ASM, BLOCK_K, X_VECTOR)
        if not PREFETCH:  # after it
            upcoming = load_words(w_rows, following, K, col_ok, following < k_end, BLOCK_K, EVEN_K)
        total += step
        words = upcoming
    return total


def int32_viewable(qweight: torch.Tensor) -> bool:
    """The packed bytes can be read as int32 words: rows of whole words, starting on a word."""
    rows_whole = qweight.shape[-1] % 4 == 0 and qweight.stride(0) % 4 == 0 and qweight.stride(-1) == 1
    return rows_whole and qweight.storage_offset() % 4 == 0
