"""The one-row int4 GEMV with each thread's sums kept apart until the end (DecodeVariant.lanes).

The word GEMV (int4_words.py) spreads a step's x over the program's threads and regathers it for the weights'
layout, and sums each step across threads: in sm90 SASS about 22 barriers and 1.6 instructions a weight of
layout changes, shuffles and sums on top of the unpacking and the FMAs. An H200 issues about 1.0e12 warp
instructions a second, so at ~4 instructions a weight the GEMV cannot read its bytes at the memory's pace.

Here each lane q of a step owns four whole words of every one of the program's rows (a 16-byte load each) and
reads the 32 x values those words multiply, itself, in four 16-byte loads: nothing crosses threads inside the
K loop. The four words hold input columns 32q .. 32q + 31, inside one scale group (the group size a multiple
of 32), so each row's 32 products sum in one FMA chain, take their group's scale and zero point, and add into
that lane's own accumulator; the lanes are summed once, after the last step. A step is 1,024 columns a warp.
Where K is a whole number of steps nothing in the loop is masked: the kernel points rows past N at row N - 1
(never stored), and the words prefetched after a slice's last step are that step's again (cached)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import release_dependents, wait_for_inputs
from .int4_words import _word_values, load_words

COLUMNS_A_LANE = tl.constexpr(32)  # four int32 words of eight nibbles
WORDS_A_WARP = 128  # 32 lanes x 4 words: BLOCK_K is 1,024 x num_warps

# Two bf16 numbers in an int32 -> both as fp32: the low one shifted up, the high one's low half cleared
_BF16_PAIR_ASM = tl.constexpr("shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xFFFF0000;")


@triton.jit
def _quarters(words):
    """[ROWS, LANES * 4] words -> the four [ROWS, LANES] words of each lane, in memory order."""
    rows: tl.constexpr = words.shape[0]
    lanes: tl.constexpr = words.shape[1] // 4
    first, second = tl.split(tl.reshape(words, (rows, lanes, 2, 2)))  # words 0, 2 and 1, 3 of each lane
    w0, w2 = tl.split(first)
    w1, w3 = tl.split(second)
    return w0, w1, w2, w3


@triton.jit
def _fourths(x4):
    """[LANES, 4] -> its four columns as [LANES] vectors."""
    front, back = tl.split(tl.reshape(x4, (x4.shape[0], 2, 2)))  # columns 0, 2 and 1, 3
    c0, c2 = tl.split(front)
    c1, c3 = tl.split(back)
    return c0, c1, c2, c3


@triton.jit
def _word_x(x, lane_ids, k0, r: tl.constexpr, K, PAIRS: tl.constexpr, EVEN_K: tl.constexpr):
    """The eight fp32 x values word r of each lane multiplies: input columns k0 + 32 q + 8 r + i, [LANES] each.
    PAIRS (bf16 x on CUDA): read as four int32 pairs and widened by bit operations (_BF16_PAIR_ASM)."""
    if PAIRS:
        pairs = (k0 + COLUMNS_A_LANE * lane_ids[:, None] + 8 * r) // 2 + tl.arange(0, 4)[None, :]
        words = x.to(tl.pointer_type(tl.int32), bitcast=True) + pairs
        if EVEN_K:
            packed = tl.load(words)
        else:
            packed = tl.load(words, mask=2 * pairs < K, other=0)
        evens, odds = tl.inline_asm_elementwise(
            asm=_BF16_PAIR_ASM,
            constraints="=r,=r,r",
            args=[packed],
            dtype=(tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
        x0, x2, x4, x6 = _fourths(evens)
        x1, x3, x5, x7 = _fourths(odds)
    else:
        ks = k0 + COLUMNS_A_LANE * lane_ids[:, None] + 8 * r + tl.arange(0, 8)[None, :]
        if EVEN_K:
            x8 = tl.load(x + ks).to(tl.float32)
        else:
            x8 = tl.load(x + ks, mask=ks < K, other=0.0).to(tl.float32)
        evens, odds = tl.split(tl.reshape(x8, (x8.shape[0], 4, 2)))
        x0, x2, x4, x6 = _fourths(evens)
        x1, x3, x5, x7 = _fourths(odds)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _word_chain(chain, word, x, lane_ids, k0, r: tl.constexpr, K, USE_ASM, PAIRS, EVEN_K):
    """chain + word r of each lane times its eight x values ([ROWS, LANES] fp32), and those x values' even and
    odd sums. The even nibbles' values are 128 + q, the odd ones' 2048 + q (_word_values with ODD_2048)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _word_x(x, lane_ids, k0, r, K, PAIRS, EVEN_K)
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_values(word, USE_ASM, True)
    chain = chain + v0 * x0[None, :] + v1 * x1[None, :] + v2 * x2[None, :] + v3 * x3[None, :]
    chain = chain + v4 * x4[None, :] + v5 * x5[None, :] + v6 * x6[None, :] + v7 * x7[None, :]
    return chain, x0 + x2 + x4 + x6, x1 + x3 + x5 + x7


@triton.jit
def _lanes_step(words, x, scales, k0, K, GROUP_SIZE, USE_ASM, PAIRS, EVEN_K):
    """One K step: each lane's [ROWS, LANES] sum over its 32 columns, zero point and scale applied (scales:
    int4_words.words_step's). With v the nibbles' values, sum v x = 128 sum x_even + 2048 sum x_odd + sum q x.
    (Each word's x is read just before its products: all 32 values read first would hold ~90 more registers.)"""
    w0, w1, w2, w3 = _quarters(words)
    lane_ids = tl.arange(0, w0.shape[1])
    chain = tl.zeros(w0.shape, dtype=tl.float32)
    chain, even0, odd0 = _word_chain(chain, w0, x, lane_ids, k0, 0, K, USE_ASM, PAIRS, EVEN_K)
    chain, even1, odd1 = _word_chain(chain, w1, x, lane_ids, k0, 1, K, USE_ASM, PAIRS, EVEN_K)
    chain, even2, odd2 = _word_chain(chain, w2, x, lane_ids, k0, 2, K, USE_ASM, PAIRS, EVEN_K)
    chain, even3, odd3 = _word_chain(chain, w3, x, lane_ids, k0, 3, K, USE_ASM, PAIRS, EVEN_K)
    evens = (even0 + even1) + (even2 + even3)
    odds = (odd0 + odd1) + (odd2 + odd3)
    s_rows, z_rows, stride_sg, stride_zg = scales
    groups = (k0 + COLUMNS_A_LANE * lane_ids) // GROUP_SIZE
    s_ptrs = s_rows[:, None] + groups[None, :] * stride_sg
    z_ptrs = z_rows[:, None] + groups[None, :] * stride_zg
    if EVEN_K:  # rows past N point at row N - 1: nothing to mask
        s = tl.load(s_ptrs).to(tl.float32)
        z = tl.load(z_ptrs).to(tl.float32)
    else:
        group_ok = (groups < tl.cdiv(K, GROUP_SIZE))[None, :]
        s = tl.load(s_ptrs, mask=group_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptrs, mask=group_ok, other=0).to(tl.float32)
    magic = (128.0 * evens + 2048.0 * odds)[None, :]
    return (chain - magic - z * (evens + odds)[None, :]) * s


@triton.jit
def _step_words(w_rows, k0, k_end, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The words of the step at k0, [ROWS, BLOCK_K // 8]. Under EVEN_K unmasked: a step at or past k_end (the
    prefetch after a slice's last step) reads the last step again, which is still cached."""
    if EVEN_K:
        k0 = tl.minimum(k0, k_end - BLOCK_K)
        word_ids = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        return tl.load(w_rows + word_ids[None, :])
    rows_ok = tl.full((w_rows.shape[0],), 1, tl.int1)
    return load_words(w_rows, k0, K, rows_ok, k0 < k_end, BLOCK_K, EVEN_K)


@triton.jit
def lanes_row(w_rows, x, scales, span, GROUP_SIZE, USE_ASM, BLOCK_K, EVEN_K, PREFETCH, PDL, early, EARLY: tl.constexpr):
    """One row x times the rows' words over span (k_start, k_end, K: whole K steps), [ROWS] fp32; w_rows and
    scales (int4_words.words_row's) point at rows that exist (the kernel's rows past N at row N - 1). PDL and
    PREFETCH as in int4_words.words_row. EARLY: also returns what the pointers `early` [ROWS] hold in fp32, read
    as soon as the kernels before have finished (a folded norm's residual: its round trip then overlaps the K
    loop)."""
    PAIRS: tl.constexpr = USE_ASM and x.dtype.element_ty == tl.bfloat16
    k_start, k_end, K = span
    words = _step_words(w_rows, k_start, k_end, K, BLOCK_K, EVEN_K)
    release_dependents(PDL)
    wait_for_inputs(PDL)
    early_values = tl.zeros((words.shape[0],), dtype=tl.float32)
    if EARLY:
        early_values = tl.load(early).to(tl.float32)
    lanes = tl.zeros((words.shape[0], words.shape[1] // 4), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:
            upcoming = _step_words(w_rows, k0 + BLOCK_K, k_end, K, BLOCK_K, EVEN_K)
        lanes += _lanes_step(words, x, scales, k0, K, GROUP_SIZE, USE_ASM, PAIRS, EVEN_K)
        if not PREFETCH:
            upcoming = _step_words(w_rows, k0 + BLOCK_K, k_end, K, BLOCK_K, EVEN_K)
        words = upcoming
    return tl.sum(lanes, axis=1), early_values
