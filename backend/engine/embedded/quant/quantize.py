"""Round-to-nearest quantization of dense weights into the internal formats (formats.py): quantization on load of
an unquantized checkpoint, and of dummy weights. Rows are independent, so a part of a fused projection quantizes
on its own."""

from __future__ import annotations

import torch

from .formats import FP8_DTYPE, FP8_MAX, INT4_LEVELS, INT8_MAX, pack_int4

_TINY = 1e-12  # keeps an all-zero row's scale positive


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (fp8 weight, float32 scale [out]): each row scaled so its largest magnitude is FP8_MAX."""
    dense = weight.to(torch.float32)
    scale = (dense.abs().amax(dim=1) / FP8_MAX).clamp(min=_TINY)
    quantized = (dense / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def quantize_int8(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 weight, scale [out, groups] in scale_dtype), symmetric per (row, group)."""
    grouped = _grouped(weight, group_size)
    scale = (grouped.abs().amax(dim=2) / INT8_MAX).clamp(min=_TINY).to(scale_dtype)
    values = torch.round(grouped / scale.to(torch.float32)[:, :, None]).clamp(-INT8_MAX, INT8_MAX)
    return values.reshape(weight.shape).to(torch.int8), scale


def quantize_int4(
    weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (packed qweight, scale [out, groups], zero [out, groups]): asymmetric min-max, each group's
    range [min, max] (widened to hold 0) spread over the 16 levels around its own zero point. All 16 levels serve the
    group's actual range, where a symmetric grid wastes one level and the half the range a skewed group leaves
    empty: on SmolLM2 (group 64) perplexity rose 52% symmetric (2026-12-02, docs/benchmarks.md)."""
    grouped = _grouped(weight, group_size)
    low = grouped.amin(dim=2).clamp(max=0.0)
    high = grouped.amax(dim=2).clamp(min=0.0)
    top = INT4_LEVELS - 1
    scale = ((high - low) / top).clamp(min=_TINY).to(scale_dtype)
    exact = scale.to(torch.float32)
    zero = torch.round(-low / exact).clamp(0, top)
    values = torch.round(grouped / exact[:, :, None] + zero[:, :, None]).clamp(0, top)
    return pack_int4(values.reshape(weight.shape).to(torch.uint8)), scale, zero.to(torch.uint8)


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {cols} input columns")
    return weight.to(torch.float32).reshape(rows, cols // group_size, group_size)
