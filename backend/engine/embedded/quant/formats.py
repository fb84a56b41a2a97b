"""The internal quantized weight formats and their reference dequantizers (pure torch, any device).

Every format is per output row, so fused projections stack quantized rows and their scales like dense rows:
- fp8:  weight float8_e4m3fn [out, in], weight_scale float32 [out]; w = weight * weight_scale[:, None].
- int8: weight int8 [out, in] (symmetric), weight_scale [out, groups] in the model dtype.
- int4: qweight uint8 [out, in // 2] (two values a byte, the low nibble the even input column, values 0..15),
        weight_scale [out, groups] in the model dtype, weight_zero uint8 [out, groups]; w = (q - zero) * scale.
groups = in // group_size (one group: per channel). The kernels (kernels.py) and the portable path read only these."""

from __future__ import annotations

from typing import Optional

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127
INT4_LEVELS = 16
INT4_SYMMETRIC_ZERO = 8


def dequantize_fp8(
    weight: torch.Tensor, weight_scale: torch.Tensor, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """[out, in] fp8 times its per-row scale, in `dtype` (float32 unless given)."""
    dense = weight.to(torch.float32) * weight_scale.to(torch.float32).reshape(-1, 1)
    return dense.to(dtype or torch.float32)


def dequantize_int8(weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] int8 times its per-(row, group) scale, in the scale's dtype."""
    return _apply_groups(weight.to(weight_scale.dtype), weight_scale, group_size)


def dequantize_int4(
    qweight: torch.Tensor, weight_scale: torch.Tensor, weight_zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """(q - zero) * scale per (row, group), in the scale's dtype, from packed [out, in // 2] nibbles."""
    values = unpack_int4(qweight).to(torch.int16)
    zeros = weight_zero.to(torch.int16).repeat_interleave(group_size, dim=1)
    return _apply_groups((values - zeros).to(weight_scale.dtype), weight_scale, group_size)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] of values 0..15 -> uint8 [out, in // 2]: even columns in the low nibble, odd in the high."""
    if values.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got shape {list(values.shape)}")
    values = values.to(torch.uint8)
    return values[:, 0::2] | (values[:, 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """pack_int4 undone: uint8 [out, in // 2] -> uint8 [out, in]."""
    low, high = qweight & 0x0F, qweight >> 4
    return torch.stack((low, high), dim=-1).reshape(qweight.shape[0], -1)


def _apply_groups(values: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = values.shape
    if cols != scale.shape[1] * group_size:
        raise ValueError(
            f"weight of {cols} columns does not match {scale.shape[1]} scale groups of {group_size} columns"
        )
    grouped = values.reshape(rows, scale.shape[1], group_size) * scale.reshape(rows, -1, 1)
    return grouped.reshape(rows, cols)
