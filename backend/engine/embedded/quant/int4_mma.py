"""The one-row int4 GEMV on tensor cores (DecodeVariant.mma): y = x W^T for one row x, weights as int32 words.

The lane GEMV (int4_lanes.py) multiplies on the CUDA cores: one FMA a weight plus its unpacking, ~3.3 SASS
instructions a weight, about what an H200 can issue while its memory delivers packed weights. Here the weights
are the A operand of `mma.sync.m16n8k16` (16 rows x 16 input columns, fp32 sums) and x the B operand: one
instruction multiplies 256 weights, so a weight costs its unpacking (seven instructions a word of eight) and
little else: 1.8 SASS instructions a weight in all at two tiles a warp (ci/int4_sass.py --mma 2x1).

Triton does not let a program choose which thread holds which weights, so the PTX here does not depend on it:
every tensor is one value a thread ([32 x warps], elementwise operations only), and each thread works out its
role from its own %tid.x. In a warp, lane 4g + t (g < 8, t < 4) holds, for each of its program's row tiles, rows
g and g + 8 of the tile, and input columns 32t .. 32t + 31 of the step: four words a row, read in one 16-byte
load. The mma sums over t (the four lanes of a row) and over a word's eight columns; which of a lane's columns sit
in which of its k slots does not matter as long as x is put in the same slots, and every lane puts the same
x in B (the columns of B differ only in the lanes holding them), so each column of the product is the row's
sum. A K step is 128 columns, one scale group's or part of one: its sums take their group's scale and zero point
once (sum_k x_k (q_k - z) s = s (sum_k x_k (MAGIC + q_k) - (MAGIC + z) sum_k x_k)), sum_k x_k from an mma of
ones against the same B.

On Triton's interpreter (CPU tests), the same roles come from the thread's index and the mma from arithmetic and
a sum over each row's four lanes: the addressing, scales and split K are tested there, the PTX on CUDA.

Measured on an H100 (docs/benchmarks.md, twenty-seventh session): the lane GEMV's sums, 19% slower than it, the
GEMV being bound by bytes in flight there (a warp here moves 1 KB a step): a sweep option, not the default."""

from __future__ import annotations

import triton
import triton.language as tl

from ..gpu_fence import count_slice
from ..pdl import release_dependents, wait_for_inputs

STEP = 128  # input columns a K step: 4 lanes x 4 words x 8 nibbles
TILE_ROWS = 16  # rows an mma multiplies; a warp holds TILES of them
_STEP, _TILE_ROWS = tl.constexpr(STEP), tl.constexpr(TILE_ROWS)  # (the kernel's names for them)
_BF16_MAGIC, _FP16_MAGIC = 0x43004300, 0x64006400  # 128 + q and 1024 + q in each 16-bit half
_BF16_ONES, _FP16_ONES = 0x3F803F80, 0x3C003C00


def _mma(kind: str, d: str, a: str, b: str, c: str) -> str:
    return f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 {d}, {a}, {b}, {c};"


def _unpack(word: str, out: str, magic: int) -> list[str]:
    """PTX: word's nibbles i and i + 4 into the halves of {out}0 .. {out}3 (i = 0 .. 3), as MAGIC + q."""
    lines = [f"lop3.b32 {out}0, {word}, 0x000F000F, {magic:#010x}, 0xEA;"]
    for i in (1, 2, 3):
        lines.append(f"shr.u32 {out}s{i}, {word}, {4 * i};")
        lines.append(f"lop3.b32 {out}{i}, {out}s{i}, 0x000F000F, {magic:#010x}, 0xEA;")
    return lines


def _tile_asm(kind: str, magic: int) -> str:
    """A step of one tile: words j = 0 .. 3 of row g ($4 .. $7) and of row g + 8 ($8 .. $11) against the step's x
    in B form ($12 .. $27, _PAIRS_ASM) -> the sums of rows g ($0) and g + 8 ($2) over the step's 128 columns. Two
    mmas a word, k slots (2t, 2t + 1) holding its nibbles (i, i + 4); words 0, 2 and 1, 3 in two chains of sums
    (an mma waits for the one before it in its chain)."""
    lines = [".reg .b32 a0, a1, a2, a3, as1, as2, as3, b0, b1, b2, b3, bs1, bs2, bs3;", ".reg .f32 z, q0, q1, q2, q3;"]
    lines.append("mov.f32 z, 0f00000000;")
    for j in range(4):
        lines += _unpack(f"${4 + j}", "a", magic) + _unpack(f"${8 + j}", "b", magic)
        sums = "{$0, $1, $2, $3}" if j % 2 == 0 else "{q0, q1, q2, q3}"
        first = "{z, z, z, z}" if j < 2 else sums
        lines.append(_mma(kind, sums, "{a0, b0, a1, b1}", f"{{${12 + 4 * j}, ${13 + 4 * j}}}", first))
        lines.append(_mma(kind, sums, "{a2, b2, a3, b3}", f"{{${14 + 4 * j}, ${15 + 4 * j}}}", sums))
    lines += ["add.f32 $0, $0, q0;", "add.f32 $2, $2, q2;"]
    return "{\n\t" + "\n\t".join(lines) + "\n\t}"


def _ones_asm(kind: str) -> str:
    """sum_k x_k over the step's 128 columns ($0): ones ($4, two 16-bit ones) against the step's B ($5 .. $20)."""
    lines = [".reg .f32 z;", "mov.f32 z, 0f00000000;"]
    for half in range(8):
        c = "{z, z, z, z}" if half == 0 else "{$0, $1, $2, $3}"
        lines.append(_mma(kind, "{$0, $1, $2, $3}", "{$4, $4, $4, $4}", f"{{${5 + 2 * half}, ${6 + 2 * half}}}", c))
    return "{\n\t" + "\n\t".join(lines) + "\n\t}"


# The thread's 32 x values of a step: four 16-byte loads from $16 into $0 .. $15 (two 16-bit values each). Not
# pure, as the weights' loads are not: the compiler keeps the next step's loads before this step's arithmetic
# (and x's after the PDL wait).
_X_ASM = tl.constexpr(
    "ld.global.v4.u32 {$0, $1, $2, $3}, [$16];\n\tld.global.v4.u32 {$4, $5, $6, $7}, [$16 + 16];\n\t"
    "ld.global.v4.u32 {$8, $9, $10, $11}, [$16 + 32];\n\tld.global.v4.u32 {$12, $13, $14, $15}, [$16 + 48];"
)


def _pairs_asm() -> str:
    """x's pairs of columns (0, 1), (2, 3), (4, 5), (6, 7) of each word j ($16 + 4j .. ) -> the pairs (0, 4), (1, 5),
    (2, 6), (3, 7) in $4j .. $4j + 3: the slots the word's nibbles take in A."""
    lines = []
    for j in range(4):
        p01, p23, p45, p67 = (f"${16 + 4 * j + i}" for i in range(4))
        lines.append(f"prmt.b32 ${4 * j}, {p01}, {p45}, 0x5410;")
        lines.append(f"prmt.b32 ${4 * j + 1}, {p01}, {p45}, 0x7632;")
        lines.append(f"prmt.b32 ${4 * j + 2}, {p23}, {p67}, 0x5410;")
        lines.append(f"prmt.b32 ${4 * j + 3}, {p23}, {p67}, 0x7632;")
    return "\n\t".join(lines)


_PAIRS_ASM = tl.constexpr(_pairs_asm())
_WORDS_ASM = tl.constexpr("ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];")
_TID_ASM = tl.constexpr("mov.u32 $0, %tid.x;")
_BF16_TILE = tl.constexpr(_tile_asm("bf16", _BF16_MAGIC))
_FP16_TILE = tl.constexpr(_tile_asm("f16", _FP16_MAGIC))
_BF16_SUM = tl.constexpr(_ones_asm("bf16"))
_FP16_SUM = tl.constexpr(_ones_asm("f16"))
_BF16_ONES_VALUE, _FP16_ONES_VALUE = tl.constexpr(_BF16_ONES), tl.constexpr(_FP16_ONES)
# inline asm constraints: sixteen int32 results from one address; sixteen from sixteen; four fp32 sums from 24
# (a tile's words and x) and from 17 (ones and x) int32 inputs
_X_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 16 + ["l"]))
_PAIRS_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 16 + ["r"] * 16))
_TILE_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 24))
_SUM_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 17))


@triton.jit
def magic_value(FP16: tl.constexpr):
    """What a nibble's 16-bit value (MAGIC + q) exceeds the nibble by."""
    if FP16:
        return 1024.0
    return 128.0


@triton.jit
def _thread_ids(THREADS: tl.constexpr, USE_ASM: tl.constexpr):
    """Each value's thread: %tid.x on CUDA (whatever Triton's layout), the index on the interpreter."""
    ids = tl.arange(0, THREADS)
    if USE_ASM:
        ids = tl.inline_asm_elementwise(_TID_ASM, "=r,r", [ids], dtype=tl.int32, is_pure=True, pack=1)
    return ids


@triton.jit
def _words(row_words, USE_ASM: tl.constexpr):
    """The four words at row_words (a 16-byte aligned pointer a thread)."""
    if USE_ASM:
        addr = row_words.to(tl.int64, bitcast=True)
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            _WORDS_ASM, "=r,=r,=r,=r,l", [addr], dtype=(tl.int32,) * 4, is_pure=False, pack=1
        )
    else:
        w0, w1, w2, w3 = tl.load(row_words), tl.load(row_words + 1), tl.load(row_words + 2), tl.load(row_words + 3)
    return w0, w1, w2, w3


@triton.jit
def _rows_words(w, row_a, row_b, stride_w, word0, USE_ASM: tl.constexpr):
    """The step's four words of rows row_a and row_b (int64, kept below N), from word0 (a multiple of four)."""
    a0, a1, a2, a3 = _words(w + row_a * stride_w + word0, USE_ASM)
    b0, b1, b2, b3 = _words(w + row_b * stride_w + word0, USE_ASM)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _x_words(x, col, USE_ASM: tl.constexpr):
    """The thread's 32 x values from input column col (16-byte aligned) as sixteen int32 pairs (CUDA); on the
    interpreter, which reads x in _portable_step, sixteen zeros."""
    if USE_ASM:
        p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = tl.inline_asm_elementwise(
            _X_ASM,
            _X_CONSTRAINTS,
            [(x + col).to(tl.int64, bitcast=True)],
            dtype=(tl.int32,) * 16,
            is_pure=False,
            pack=1,
        )
    else:
        p0 = tl.zeros(col.shape, dtype=tl.int32)
        p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = (
            p0, p0, p0, p0, p0, p0, p0, p0, p0, p0, p0, p0, p0, p0, p0
        )  # fmt: skip
    return p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15


@triton.jit
def _tile_mma(
    a0, a1, a2, a3, b0, b1, b2, b3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, FP16
):
    """One tile's step on tensor cores (_tile_asm): the sums of rows g and g + 8."""
    sa, _, sb, _ = tl.inline_asm_elementwise(
        _FP16_TILE if FP16 else _BF16_TILE,
        _TILE_CONSTRAINTS,
        [a0, a1, a2, a3, b0, b1, b2, b3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15],
        dtype=(tl.float32,) * 4,
        is_pure=True,
        pack=1,
    )
    return sa, sb


@triton.jit
def _mma_step(
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, ones, TILES: tl.constexpr, FP16,
):  # fmt: skip
    """A step on CUDA from the x pairs of _x_words: the sums of the thread's rows (a, b of tile 0; c, d of tile 1)
    and of the step's x."""
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = tl.inline_asm_elementwise(
        _PAIRS_ASM,
        _PAIRS_CONSTRAINTS,
        [p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15],
        dtype=(tl.int32,) * 16,
        is_pure=True,
        pack=1,
    )
    xs, _, _, _ = tl.inline_asm_elementwise(
        _FP16_SUM if FP16 else _BF16_SUM,
        _SUM_CONSTRAINTS,
        [ones, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15],
        dtype=(tl.float32,) * 4,
        is_pure=True,
        pack=1,
    )
    sa, sb = _tile_mma(
        a0, a1, a2, a3, b0, b1, b2, b3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, FP16
    )
    sc, sd = sa, sb
    if TILES == 2:
        sc, sd = _tile_mma(
            c0, c1, c2, c3, d0, d1, d2, d3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, FP16
        )
    return sa, sb, sc, sd, xs


@triton.jit
def _quad_sum(values, THREADS: tl.constexpr):
    """The interpreter's stand-in for the mma's sum over a row's four lanes (threads 4g .. 4g + 3)."""
    sums = tl.sum(tl.reshape(values, (THREADS // 4, 4)), axis=1)
    return tl.reshape(tl.broadcast_to(sums[:, None], (THREADS // 4, 4)), (THREADS,))


@triton.jit
def _nibbles_dot(word, x, col, FP16: tl.constexpr):
    """The interpreter's one word: sum_i (MAGIC + q_i) x_i over its eight nibbles (input columns col + i)."""
    total = tl.zeros(word.shape, dtype=tl.float32)
    for i in tl.static_range(8):
        total += (((word >> (4 * i)) & 0xF).to(tl.float32) + magic_value(FP16)) * tl.load(x + col + i).to(tl.float32)
    return total


@triton.jit
def _x_total(x, col):
    """The interpreter's sum of a lane's 32 x values from col."""
    total = tl.zeros(col.shape, dtype=tl.float32)
    for i in tl.static_range(32):
        total += tl.load(x + col + i).to(tl.float32)
    return total


@triton.jit
def _portable_step(x, col, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, THREADS, TILES, FP16):
    """_mma_step by arithmetic: each lane's products, summed over the row's four lanes."""
    sa = _nibbles_dot(a0, x, col, FP16) + _nibbles_dot(a1, x, col + 8, FP16)
    sa += _nibbles_dot(a2, x, col + 16, FP16) + _nibbles_dot(a3, x, col + 24, FP16)
    sb = _nibbles_dot(b0, x, col, FP16) + _nibbles_dot(b1, x, col + 8, FP16)
    sb += _nibbles_dot(b2, x, col + 16, FP16) + _nibbles_dot(b3, x, col + 24, FP16)
    sc, sd = sa, sb
    if TILES == 2:
        sc = _nibbles_dot(c0, x, col, FP16) + _nibbles_dot(c1, x, col + 8, FP16)
        sc += _nibbles_dot(c2, x, col + 16, FP16) + _nibbles_dot(c3, x, col + 24, FP16)
        sd = _nibbles_dot(d0, x, col, FP16) + _nibbles_dot(d1, x, col + 8, FP16)
        sd += _nibbles_dot(d2, x, col + 16, FP16) + _nibbles_dot(d3, x, col + 24, FP16)
    xs = _x_total(x, col)
    sa, sb, sc, sd = _quad_sum(sa, THREADS), _quad_sum(sb, THREADS), _quad_sum(sc, THREADS), _quad_sum(sd, THREADS)
    return sa, sb, sc, sd, _quad_sum(xs, THREADS)


@triton.jit
def _step_words(w, kept_a, kept_b, kept_c, kept_d, stride_w, k0, t, TILES: tl.constexpr, USE_ASM: tl.constexpr):
    """The thread's words of the step at k0: four of each of rows a, b (tile 0) and c, d (tile 1; tile 0's again
    where TILES is 1, unused)."""
    a0, a1, a2, a3, b0, b1, b2, b3 = _rows_words(w, kept_a, kept_b, stride_w, k0 // 8 + 4 * t, USE_ASM)
    c0, c1, c2, c3, d0, d1, d2, d3 = a0, a1, a2, a3, b0, b1, b2, b3
    if TILES == 2:
        c0, c1, c2, c3, d0, d1, d2, d3 = _rows_words(w, kept_c, kept_d, stride_w, k0 // 8 + 4 * t, USE_ASM)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _group_scale(row, group, scale, zero, stride_s, stride_sg, stride_z, stride_zg, FP16: tl.constexpr):
    """A row's scale and (MAGIC + zero point) for one group, fp32."""
    s = tl.load(scale + row * stride_s + group * stride_sg).to(tl.float32)
    z = tl.load(zero + row * stride_z + group * stride_zg).to(tl.float32) + magic_value(FP16)
    return s, z


@triton.jit
def _accumulate(
    acc_a, acc_b, acc_c, acc_d,
    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
    x, k0, t, kept_a, kept_b, kept_c, kept_d, scale, zero, stride_s, stride_sg, stride_z, stride_zg, ones,
    THREADS: tl.constexpr, TILES: tl.constexpr, GROUP_SIZE: tl.constexpr, USE_ASM: tl.constexpr, FP16: tl.constexpr,
):  # fmt: skip
    """The rows' sums plus the step at k0 (its words and x pairs), each row's scale and zero point applied."""
    group = k0 // GROUP_SIZE
    s_a, z_a = _group_scale(kept_a, group, scale, zero, stride_s, stride_sg, stride_z, stride_zg, FP16)
    s_b, z_b = _group_scale(kept_b, group, scale, zero, stride_s, stride_sg, stride_z, stride_zg, FP16)
    if USE_ASM:
        sa, sb, sc, sd, xs = _mma_step(
            p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
            a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, ones, TILES, FP16,
        )  # fmt: skip
    else:
        sa, sb, sc, sd, xs = _portable_step(
            x, k0 + 32 * t, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, THREADS, TILES, FP16
        )
    acc_a += (sa - z_a * xs) * s_a
    acc_b += (sb - z_b * xs) * s_b
    if TILES == 2:
        s_c, z_c = _group_scale(kept_c, group, scale, zero, stride_s, stride_sg, stride_z, stride_zg, FP16)
        s_d, z_d = _group_scale(kept_d, group, scale, zero, stride_s, stride_sg, stride_z, stride_zg, FP16)
        acc_c += (sc - z_c * xs) * s_c
        acc_d += (sd - z_d * xs) * s_d
    return acc_a, acc_b, acc_c, acc_d


@triton.jit
def _add_out(acc, row, keep, bias, out, workspace, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Writes a row's sum (SPLIT_K 1) or adds it into the fp32 workspace; keep: the thread writes this row."""
    if HAS_BIAS:
        if tl.program_id(1) == 0:
            acc += tl.load(bias + row, mask=keep, other=0.0).to(tl.float32)
    if SPLIT_K == 1:
        tl.store(out + row, acc.to(out.dtype.element_ty), mask=keep)
    else:
        tl.atomic_add(workspace + row, acc, mask=keep, sem="relaxed")


@triton.jit
def _flush_row(row, keep, out, workspace):
    """The last K slice of a tile: the workspace's sum out, and the workspace zero again for the next launch."""
    total = tl.load(workspace + row, mask=keep, other=0.0, cache_modifier=".cg")  # from L2, where atomics add
    tl.store(out + row, total.to(out.dtype.element_ty), mask=keep)
    tl.store(workspace + row, tl.zeros_like(total), mask=keep)


@triton.jit
def int4_mma_kernel(
    x,
    w,
    scale,
    zero,
    bias,
    out,
    workspace,
    counters,
    N,
    K,
    k_per_split,
    stride_w,
    stride_s,
    stride_sg,
    stride_z,
    stride_zg,
    GROUP_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    TILES: tl.constexpr,
    WARPS: tl.constexpr,
    FP16: tl.constexpr,
    USE_ASM: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Program (row block of WARPS x TILES x 16 rows, K slice): out[rows] (+)= x[slice] . W[rows, slice]. w: the
    int32 words [N, K / 8] (stride_w in words, rows 16-byte aligned), K a multiple of STEP, GROUP_SIZE too."""
    THREADS: tl.constexpr = 32 * WARPS
    tid = _thread_ids(THREADS, USE_ASM)
    t = tid % 4
    first = tl.program_id(0) * (WARPS * TILES * _TILE_ROWS) + (tid // 32) * (TILES * _TILE_ROWS) + (tid % 32) // 4
    row_a, row_b, row_c, row_d = first, first + 8, first + 16, first + 24
    kept_a = tl.minimum(row_a, N - 1).to(tl.int64)  # rows past N read row N - 1's weights, never stored
    kept_b = tl.minimum(row_b, N - 1).to(tl.int64)
    kept_c = tl.minimum(row_c, N - 1).to(tl.int64)
    kept_d = tl.minimum(row_d, N - 1).to(tl.int64)
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    ws = _step_words(w, kept_a, kept_b, kept_c, kept_d, stride_w, k_start, t, TILES, USE_ASM)
    a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = ws
    release_dependents(PDL)
    wait_for_inputs(PDL)  # (x is read after this; the weights above are no kernel's output)
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = _x_words(x, k_start + 32 * t, USE_ASM)
    acc_a = tl.zeros((THREADS,), dtype=tl.float32)
    acc_b, acc_c, acc_d = acc_a, acc_a, acc_a
    ones = tl.full((THREADS,), _FP16_ONES_VALUE if FP16 else _BF16_ONES_VALUE, tl.int32)  # two 16-bit ones
    # Two steps an iteration, each step's words and x requested before the step before it is multiplied (one
    # past the slice's end reads its last step again, cached): two steps in flight a warp, and no copies from
    # the loaded registers into the loop's (which a one-step loop needs when its loads come early).
    for k0 in range(k_start, k_end, 2 * _STEP):
        second = tl.minimum(k0 + _STEP, k_end - _STEP)
        ws = _step_words(w, kept_a, kept_b, kept_c, kept_d, stride_w, second, t, TILES, USE_ASM)
        e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3 = ws
        q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15 = _x_words(x, second + 32 * t, USE_ASM)
        acc_a, acc_b, acc_c, acc_d = _accumulate(
            acc_a, acc_b, acc_c, acc_d,
            a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
            p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15,
            x, k0, t, kept_a, kept_b, kept_c, kept_d, scale, zero, stride_s, stride_sg, stride_z, stride_zg, ones,
            THREADS, TILES, GROUP_SIZE, USE_ASM, FP16,
        )  # fmt: skip
        third = tl.minimum(k0 + 2 * _STEP, k_end - _STEP)
        ws = _step_words(w, kept_a, kept_b, kept_c, kept_d, stride_w, third, t, TILES, USE_ASM)
        a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = ws
        p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15 = _x_words(x, third + 32 * t, USE_ASM)
        if k0 + _STEP < k_end:  # (then `second` is k0 + _STEP)
            acc_a, acc_b, acc_c, acc_d = _accumulate(
                acc_a, acc_b, acc_c, acc_d,
                e0, e1, e2, e3, f0, f1, f2, f3, g0, g1, g2, g3, h0, h1, h2, h3,
                q0, q1, q2, q3, q4, q5, q6, q7, q8, q9, q10, q11, q12, q13, q14, q15,
                x, second, t, kept_a, kept_b, kept_c, kept_d, scale, zero, stride_s, stride_sg, stride_z,
                stride_zg, ones, THREADS, TILES, GROUP_SIZE, USE_ASM, FP16,
            )  # fmt: skip
    writer = t == 0  # the four lanes of a row hold the same sums
    _add_out(acc_a, row_a, writer & (row_a < N), bias, out, workspace, HAS_BIAS, SPLIT_K)
    _add_out(acc_b, row_b, writer & (row_b < N), bias, out, workspace, HAS_BIAS, SPLIT_K)
    if TILES == 2:
        _add_out(acc_c, row_c, writer & (row_c < N), bias, out, workspace, HAS_BIAS, SPLIT_K)
        _add_out(acc_d, row_d, writer & (row_d < N), bias, out, workspace, HAS_BIAS, SPLIT_K)
    if SPLIT_K > 1:
        # The tile's last slice to arrive (gpu_fence.count_slice) writes the sums out and leaves workspace and
        # counter zero.
        tile = tl.program_id(0)
        if count_slice(counters, tile, INTERPRETED) == SPLIT_K - 1:
            _flush_row(row_a, writer & (row_a < N), out, workspace)
            _flush_row(row_b, writer & (row_b < N), out, workspace)
            if TILES == 2:
                _flush_row(row_c, writer & (row_c < N), out, workspace)
                _flush_row(row_d, writer & (row_d < N), out, workspace)
            tl.store(counters + tile, 0)
