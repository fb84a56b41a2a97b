"""The host check of a rotary embedding's inputs, shared by the kernels that rotate (network/fused_ops.py's
rotary_inplace, attention/kv_store.py's rotate_and_store_kv): a ValueError that names the input at fault."""

from __future__ import annotations

import torch

from .rounding import DTYPES


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
