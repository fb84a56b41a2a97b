"""The FP8 KV cache's values: a cache tensor of dtype float8 e4m3 holds keys (values) divided by the layer's
k_scale (v_scale) and clamped to the format's range; reading multiplies back. A cache in any other dtype holds
the values as they are, and the scales are not used. The scales are per layer float32 scalars fixed at load
(1.0 unless the checkpoint has them: kv_scales.py), so CUDA graphs capture them as constants.

Byte-level moves (zeroing blocks, copying slots) go through uint8 views: several indexing ops have no float8
kernel on CPU."""

from __future__ import annotations

import torch

# The quantized weights' own format constants: larger magnitudes than FP8_MAX would become NaN, so they are clamped.
from ..quant.formats import FP8_DTYPE, FP8_MAX


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of an fp8 tensor (same shape), for indexing ops; any other tensor as it is."""
    return tensor.view(torch.uint8) if is_fp8(tensor) else tensor


def quantize(values: torch.Tensor, scale: float) -> torch.Tensor:
    """values * (1 / scale) in fp32, clamped to +-FP8_MAX, rounded to float8 e4m3 (nearest even). A product by
    the fp32 reciprocal, not a quotient, so the store kernel (whose fp32 division is not IEEE-exact on GPUs)
    rounds the very same numbers."""
    scaled = values.float() if scale == 1.0 else values.float() * (1.0 / scale)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What an fp8 cache's `stored` values stand for, in `dtype`; a cache of another dtype's values unchanged."""
    if not is_fp8(stored):
        return stored
    values = stored.to(torch.float32)
    return (values if scale == 1.0 else values * scale).to(dtype)
