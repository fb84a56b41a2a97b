"""Quantized matmuls over the internal formats (formats.py).

This is the portable path only: dequantize, then F.linear, on any device. The Triton kernels and the FP8
`torch._scaled_mm` path of the qkern branch replace this file with the same functions and signatures."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .formats import FP8_DTYPE, FP8_MAX, dequantize_fp8, dequantize_int4, dequantize_int8


def fp8_supported(device: torch.device) -> bool:
    """FP8 matmuls need compute capability >= 8.9 and torch._scaled_mm."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    input_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """y = (x_q * x_scale) @ (w * w_scale)^T in x's dtype; x quantized per token (dynamic) or with `input_scale`."""
    x_q, x_scale = _quantize_activations(x, input_scale)
    dense = dequantize_fp8(weight, weight_scale)
    out = F.linear(x_q.to(torch.float32) * x_scale, dense)
    return (out if bias is None else out + bias.to(torch.float32)).to(x.dtype)


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor], group_size: int
) -> torch.Tensor:
    return F.linear(x, dequantize_int8(weight, weight_scale, group_size).to(x.dtype), bias)


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero: torch.Tensor,
    bias: Optional[torch.Tensor],
    group_size: int,
) -> torch.Tensor:
    dense = dequantize_int4(qweight, weight_scale, weight_zero, group_size)
    return F.linear(x, dense.to(x.dtype), bias)


def _quantize_activations(x: torch.Tensor, input_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """x as fp8 with its scale: one static scalar, or one scale per token (row)."""
    dense = x.to(torch.float32)
    if input_scale is not None:
        scale = input_scale.to(torch.float32).reshape(1, 1)
    else:
        scale = (dense.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (dense / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
