"""The one-row int4 GEMV with each thread's sums kept apart until the end (DecodeVariant.lanes).

The word GEMV (int4_words.py) spreads a step's x over the program's threads and regathers it for the weights'
layout, and sums each step across threads: in sm90 SASS about 22 barriers and 1.6 instructions a weight of
layout changes, shuffles and sums on top of the unpacking and the FMAs. An H200 issues about 1.0e12 warp
instructions a second, so at ~4 instructions a weight the GEMV cannot read its bytes at the memory's pace.

Here each lane q of a step owns four whole words of every one of the program's rows (a 16-byte load each) and
reads the 32 x values those words multiply, itself, in four 16-byte loads: nothing crosses threads inside the
K loop. The four words hold input columns 32q .. 32q + 31, inside one scale group (the group size a multiple
of 32), so each row's 32 products sum in one FMA chain, take their group's scale and zero point, and add into
that lane's own accumulator; the lanes are summed once, after the last step. A step is 1,024 columns a warp."""

from __future__ import annotations

import triton
import triton.language as tl

from ..pdl import release_dependents, wait_for_inputs
from .int4_words import _word_values, load_words

COLUMNS_A_LANE = tl.constexpr(32)  # four int32 words of eight nibbles
WORDS_A_WARP = 128  # 32 lanes x 4 words: BLOCK_K is 1,024 x num_warps


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
def _eighths(x8):
    """[LANES, 8] -> its eight columns as [LANES] vectors."""
    evens, odds = tl.split(tl.reshape(x8, (x8.shape[0], 4, 2)))
    e04, e26 = tl.split(tl.reshape(evens, (x8.shape[0], 2, 2)))
    o15, o37 = tl.split(tl.reshape(odds, (x8.shape[0], 2, 2)))
    x0, x4 = tl.split(e04)
    x2, x6 = tl.split(e26)
    x1, x5 = tl.split(o15)
    x3, x7 = tl.split(o37)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _word_chain(chain, word, x, lane_ids, k0, r: tl.constexpr, K, USE_ASM: tl.constexpr, EVEN_K: tl.constexpr):
    """chain + word r of each lane times its eight x values ([ROWS, LANES] fp32); also that word's x sums
    (evens, odds times 16). Nibble i is input column k0 + 32 q + 8 r + i; the odd ones' values are q / 16
    (_word_values), so their x is taken times 16."""
    ks = k0 + COLUMNS_A_LANE * lane_ids[:, None] + 8 * r + tl.arange(0, 8)[None, :]
    if EVEN_K:
        x8 = tl.load(x + ks).to(tl.float32)
    else:
        x8 = tl.load(x + ks, mask=ks < K, other=0.0).to(tl.float32)
    x0, x1, x2, x3, x4, x5, x6, x7 = _eighths(x8)
    x1, x3, x5, x7 = x1 * 16.0, x3 * 16.0, x5 * 16.0, x7 * 16.0
    v0, v1, v2, v3, v4, v5, v6, v7 = _word_values(word, USE_ASM)
    chain = chain + v0 * x0[None, :] + v1 * x1[None, :] + v2 * x2[None, :] + v3 * x3[None, :]
    chain = chain + v4 * x4[None, :] + v5 * x5[None, :] + v6 * x6[None, :] + v7 * x7[None, :]
    return chain, x0 + x2 + x4 + x6, x1 + x3 + x5 + x7


@triton.jit
def _lanes_step(words, x, s_rows, z_rows, k0, K, col_ok, stride_sg, stride_zg, GROUP_SIZE, USE_ASM, EVEN_K):
    """One K step: each lane's [ROWS, LANES] sum over its 32 columns, zero point and scale applied."""
    w0, w1, w2, w3 = _quarters(words)
    lane_ids = tl.arange(0, w0.shape[1])
    chain = tl.zeros(w0.shape, dtype=tl.float32)
    chain, even0, odd0 = _word_chain(chain, w0, x, lane_ids, k0, 0, K, USE_ASM, EVEN_K)
    chain, even1, odd1 = _word_chain(chain, w1, x, lane_ids, k0, 1, K, USE_ASM, EVEN_K)
    chain, even2, odd2 = _word_chain(chain, w2, x, lane_ids, k0, 2, K, USE_ASM, EVEN_K)
    chain, even3, odd3 = _word_chain(chain, w3, x, lane_ids, k0, 3, K, USE_ASM, EVEN_K)
    evens = even0 + even1 + even2 + even3
    odds = odd0 + odd1 + odd2 + odd3  # (times 16)
    x_scaled_sum = 128.0 * (evens + odds)  # sum x' v = 128 sum x' + sum q x (int4_words.words_step)
    x_sum = evens + odds * 0.0625
    groups = (k0 + COLUMNS_A_LANE * lane_ids) // GROUP_SIZE
    group_ok = col_ok[:, None] & (groups < tl.cdiv(K, GROUP_SIZE))[None, :]
    s = tl.load(s_rows[:, None] + groups[None, :] * stride_sg, mask=group_ok, other=0.0).to(tl.float32)
    z = tl.load(z_rows[:, None] + groups[None, :] * stride_zg, mask=group_ok, other=0).to(tl.float32)
    return (chain - x_scaled_sum[None, :] - x_sum[None, :] * z) * s


@triton.jit
def lanes_row(
    w_rows,
    x,
    s_rows,
    z_rows,
    k_start,
    k_end,
    K,
    col_ok,
    stride_sg,
    stride_zg,
    GROUP_SIZE,
    USE_ASM,
    BLOCK_K,
    EVEN_K,
    PREFETCH,
    PDL,
):
    """One row x times the columns' words from k_start to k_end (whole K steps): [BLOCK_N] fp32. PDL and
    PREFETCH as in int4_words.words_row."""
    words = load_words(w_rows, k_start, K, col_ok, k_start < k_end, BLOCK_K, EVEN_K)
    release_dependents(PDL)
    wait_for_inputs(PDL)
    lanes = tl.zeros((words.shape[0], words.shape[1] // 4), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        following = k0 + BLOCK_K
        if PREFETCH:
            upcoming = load_words(w_rows, following, K, col_ok, following < k_end, BLOCK_K, EVEN_K)
        lanes += _lanes_step(words, x, s_rows, z_rows, k0, K, col_ok, stride_sg, stride_zg, GROUP_SIZE, USE_ASM, EVEN_K)
        if not PREFETCH:
            upcoming = load_words(w_rows, following, K, col_ok, following < k_end, BLOCK_K, EVEN_K)
        words = upcoming
    return tl.sum(lanes, axis=1)
