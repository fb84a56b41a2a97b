"""The byte layout's K step for several rows of x (int4_decode_kernel.py without `words`): each byte's two
nibbles made into 16-bit MAGIC + q values, then multiplied by tl.dot (or on the CUDA cores for a row or two).

A nibble q becomes the bf16 (fp16) number 128 + q (1024 + q) by bit operations alone, OR-ing q into the mantissa
of 128's (1024's) bit pattern: on CUDA an inline-PTX routine turns four bytes into eight such values with eight
instructions; elsewhere (Triton's interpreter, fp32 x) plain arithmetic gives the same values. The low nibbles
(even input columns) and the high ones (odd columns) stay apart, so no interleave is needed."""

from __future__ import annotations

import triton
import triton.language as tl

from .int4_mma import magic_value

# 128 (bf16) and 1024 (fp16): the powers of two whose mantissa steps are 1, so MAGIC + q is exact for q < 16
_BF16_MAGIC, _FP16_MAGIC = tl.constexpr(0x4300), tl.constexpr(0x6400)


def _unpack_asm(magic: int) -> str:
    """PTX for one asm instance: four bytes in $4 -> the low nibbles' values in $0, $1 and the high ones' in $2,
    $3 (two 16-bit values a register, byte order kept). PRMT spreads bytes 0, 1 (then 2, 3) into the two halves
    of a word; LOP3 (a & b) | c masks one nibble into each half and ORs the magic exponent in."""
    return f"""{{
    .reg .b32 t0, t1, u0, u1;
    prmt.b32 t0, $4, 0, 0x4140;
    prmt.b32 t1, $4, 0, 0x4342;
    shr.u32 u0, t0, 4;
    shr.u32 u1, t1, 4;
    lop3.b32 $0, t0, 0x000F000F, {magic:#010x}, 0xEA;
    lop3.b32 $1, t1, 0x000F000F, {magic:#010x}, 0xEA;
    lop3.b32 $2, u0, 0x000F000F, {magic:#010x}, 0xEA;
    lop3.b32 $3, u1, 0x000F000F, {magic:#010x}, 0xEA;
    }}"""


_BF16_ASM, _FP16_ASM = tl.constexpr(_unpack_asm(0x43004300)), tl.constexpr(_unpack_asm(0x64006400))


@triton.jit
def _magic_pairs_asm(packed, FP16: tl.constexpr):
    """uint8 [...] -> (low nibbles, high nibbles) as MAGIC + q in bf16 / fp16, four bytes an asm instance."""
    if FP16:
        lo, hi = tl.inline_asm_elementwise(
            asm=_FP16_ASM,
            constraints="=r,=r,=r,=r,r",
            args=[packed],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        lo, hi = tl.inline_asm_elementwise(
            asm=_BF16_ASM,
            constraints="=r,=r,=r,=r,r",
            args=[packed],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    return lo, hi


@triton.jit
def magic16(values, FP16: tl.constexpr):
    """Values 0..15 -> MAGIC + value in the 16-bit type, by OR-ing them into MAGIC's mantissa (int4_gemm.py
    shares it)."""
    if FP16:  # (one return after the branches: Triton 3.6 types both of them)
        magic = (values.to(tl.int16) | _FP16_MAGIC).to(tl.float16, bitcast=True)
    else:
        magic = (values.to(tl.int16) | _BF16_MAGIC).to(tl.bfloat16, bitcast=True)
    return magic


@triton.jit
def _magic_pairs(packed, USE_ASM: tl.constexpr, FP16: tl.constexpr, UPCAST: tl.constexpr):
    """(MAGIC + low nibble, MAGIC + high nibble) of each byte: fp32 under UPCAST (the interpreter, or fp32 x),
    else the 16-bit type, by asm or by bit operations on int16."""
    if UPCAST:
        lo = (packed & 0xF).to(tl.float32) + magic_value(FP16)
        hi = (packed >> 4).to(tl.float32) + magic_value(FP16)
    elif USE_ASM:
        lo, hi = _magic_pairs_asm(packed, FP16)
    else:
        lo = magic16(packed & 0xF, FP16)
        hi = magic16(packed >> 4, FP16)
    return lo, hi


@triton.jit
def tile_product(packed, x_even, x_odd, USE_ASM, FP16, UPCAST, USE_DOT, BLOCK_M, BLOCK_N, HALF):
    """x[:, even] . (MAGIC + lo)^T + x[:, odd] . (MAGIC + hi)^T for one K step: [BLOCK_M, BLOCK_N] fp32."""
    lo, hi = _magic_pairs(packed, USE_ASM, FP16, UPCAST)
    if not USE_DOT and BLOCK_M == 1:  # one row: a 2-D product, summed along K mostly inside each thread
        row_even = tl.reshape(x_even, (HALF,)).to(tl.float32)
        row_odd = tl.reshape(x_odd, (HALF,)).to(tl.float32)
        prod = lo.to(tl.float32) * row_even[None, :] + hi.to(tl.float32) * row_odd[None, :]
        part = tl.reshape(tl.sum(prod, axis=1), (1, BLOCK_N))
    elif not USE_DOT:  # CUDA cores: products of the rows and the tile, summed along K
        part = tl.sum(x_even.to(tl.float32)[:, None, :] * lo.to(tl.float32)[None, :, :], axis=2)
        part += tl.sum(x_odd.to(tl.float32)[:, None, :] * hi.to(tl.float32)[None, :, :], axis=2)
    elif UPCAST:
        part = tl.dot(x_even.to(tl.float32), tl.trans(lo), input_precision="ieee")
        part += tl.dot(x_odd.to(tl.float32), tl.trans(hi), input_precision="ieee")
    else:
        part = tl.dot(x_even, tl.trans(lo))
        part += tl.dot(x_odd, tl.trans(hi))
    return part
