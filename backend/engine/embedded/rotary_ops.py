"""The rotary embedding's rotation of pairs (i, i + D / 2): apply_rotary, the PyTorch reference that the model
layers and the portable attention path use, and what the kernels that rotate share (network/fused_ops.py's
rotary_inplace, attention/kv_store.py's rotate_and_store_kv): the host check of their inputs (a ValueError that
names the input at fault), and on the device a token's cos and sin halves and the rotation in place, in fp32,
rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import DTYPES, round_to


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def check_rotary(name: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x (called `name`) [T, H, D] in one of DTYPES with a contiguous last dimension and D even (pairs i, i + D / 2
    rotate); cos and sin float [T, D] on x's device, their last dimension contiguous."""
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    num_tokens, _, head_dim = x.shape
    if x.dtype not in DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; supported: {', '.join(map(str, DTYPES))}")
    if x.stride(2) != 1:
        raise ValueError(f"{name} needs a contiguous last (head_dim) dimension")
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} is odd: rotary rotates pairs (i, i + head_dim / 2)")
    for table_name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (num_tokens, head_dim) or table.device != x.device or not table.is_floating_point():
            raise ValueError(
                f"{table_name} {tuple(table.shape)} {table.dtype} on {table.device} does not fit {name} "
                f"{tuple(x.shape)} on {x.device} (wanted a float [{num_tokens}, {head_dim}])"
            )
        if table.stride(1) != 1:
            raise ValueError(f"{table_name} needs a contiguous last dimension")


@triton.jit
def load_rotation(cos, sin, token, stride_ct, stride_st, d, d_ok, HALF: tl.constexpr):
    """The token's cos and sin, each as its two halves [1, HALF_P] in fp32: (cos1, cos2, sin1, sin2)."""
    cos_row = cos + token * stride_ct + d
    sin_row = sin + token * stride_st + d
    cos1 = tl.load(cos_row, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    return cos1, cos2, sin1, sin2


@triton.jit
def rotate_pairs(first, ok, cos1, cos2, sin1, sin2, HALF: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Rotates the pairs (first, first + HALF) in place in fp32, rounded once to their dtype (ROUND_BF16: by hand,
    rounding.round_to); returns both halves as stored."""
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    out1, out2 = rotated_halves(x1, x2, cos1, cos2, sin1, sin2, first.dtype.element_ty, ROUND_BF16)
    tl.store(first, out1, mask=ok)
    tl.store(first + HALF, out2, mask=ok)
    return out1, out2


@triton.jit
def rotated_halves(x1, x2, cos1, cos2, sin1, sin2, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """The pairs (x1, x2) (fp32) rotated, each half rounded once to dtype: what every rotating kernel stores. The
    fused multiply-adds are spelled out, so that the compiler cannot contract each kernel's differently (their
    results then differ in the last bit: qkv_rotary.py's epilogue against rotate_and_store_kv on an H100)."""
    out1 = round_to(tl.fma(x1, cos1, -(x2 * sin1)), dtype, ROUND_BF16)
    out2 = round_to(tl.fma(x2, cos2, x1 * sin2), dtype, ROUND_BF16)
    return out1, out2
