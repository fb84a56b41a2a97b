"""Round-to-nearest quantization of dense weights into the internal formats (formats.py): quantization on load of
an unquantized checkpoint, and of dummy weights. Rows are independent, so a part of a fused projection quantizes
on its own. The grids (how a group's scale and zero point are chosen, how a value rounds onto them) are public so
that calibrated quantization (checkpoints/gptq.py) rounds onto exactly the same ones."""

from __future__ import annotations

import torch

from .formats import FP8_DTYPE, FP8_MAX, INT4_LEVELS, INT4_SYMMETRIC_ZERO, INT8_MAX, pack_int4

_TINY = 1e-12  # keeps an all-zero row's scale positive
INT4_TOP = INT4_LEVELS - 1


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (fp8 weight, float32 scale [out]): each row scaled so its largest magnitude is FP8_MAX."""
    dense = weight.to(torch.float32)
    scale = fp8_row_scale(dense)
    return round_fp8(dense, scale[:, None]), scale


def fp8_row_scale(dense: torch.Tensor) -> torch.Tensor:
    """float32 [out, in] -> float32 [out]: each row's largest magnitude over FP8_MAX."""
    return (dense.abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)


def round_fp8(dense: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """dense / scale (broadcast), clamped to the finite range and rounded to float8 e4m3 (nearest even)."""
    return (dense / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_int8(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 weight, scale [out, groups] in scale_dtype), symmetric per (row, group)."""
    grouped = _grouped(weight, group_size)
    scale = (grouped.abs().amax(dim=2) / INT8_MAX).clamp(min=_TINY).to(scale_dtype)
    values = torch.round(grouped / scale.to(torch.float32)[:, :, None]).clamp(-INT8_MAX, INT8_MAX)
    return values.reshape(weight.shape).to(torch.int8), scale


def quantize_int4(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (packed qweight, scale [out, groups], zero [out, groups]) on int4_grid's grid (asymmetric
    unless `symmetric`)."""
    grouped = _grouped(weight, group_size)
    scale, zero = int4_grid(grouped, scale_dtype, symmetric)
    values = round_int4(grouped, scale.to(torch.float32)[:, :, None], zero[:, :, None])
    return pack_int4(values.reshape(weight.shape).to(torch.uint8)), scale, zero.to(torch.uint8)


def int4_grid(grouped: torch.Tensor, scale_dtype: torch.dtype, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [out, groups, group_size] -> (scale [out, groups] in scale_dtype, zero float32 [out, groups]).

    Asymmetric (the default of quantization on load): each group's range [min, max] (widened to hold 0) spread
    over the 16 levels around its own zero point. All 16 levels serve the group's actual range, where a symmetric
    grid wastes one level and the half the range a skewed group leaves empty: on SmolLM2 (group 64) perplexity rose
    52% symmetric (2026-12-02, docs/benchmarks.md). Symmetric: the largest magnitude maps to 7 (never clipped),
    zero point 8. The zero point is computed from the scale as stored (scale_dtype), as dequantization uses it."""
    if symmetric:
        scale = (grouped.abs().amax(dim=2) / (INT4_SYMMETRIC_ZERO - 1)).clamp(min=_TINY).to(scale_dtype)
        return scale, torch.full(scale.shape, float(INT4_SYMMETRIC_ZERO), device=grouped.device)
    low = grouped.amin(dim=2).clamp(max=0.0)
    high = grouped.amax(dim=2).clamp(min=0.0)
    scale = ((high - low) / INT4_TOP).clamp(min=_TINY).to(scale_dtype)
    zero = torch.round(-low / scale.to(torch.float32)).clamp(0, INT4_TOP)
    return scale, zero


def round_int4(dense: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The nearest level 0..15 (float32) of dense / scale + zero, scale and zero broadcast against `dense`."""
    return torch.round(dense / scale + zero).clamp(0, INT4_TOP)


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {cols} input columns")
    return weight.to(torch.float32).reshape(rows, cols // group_size, group_size)
