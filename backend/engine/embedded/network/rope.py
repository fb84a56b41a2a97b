"""RoPE inverse frequencies for each supported scaling type, in fp32 (as Hugging Face computes them).

Each function returns `(inv_freq [head_dim // 2], attention_factor)`; the factor multiplies cos and sin. Always
computed on the CPU (also while a model is built on the meta device), then moved where the model lives."""

from __future__ import annotations

import math

import torch

from .model_config import ModelLoadError, RopeConfig


def rope_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    compute = _BY_TYPE.get(rope.rope_type)
    if compute is None:
        raise ModelLoadError(f"RoPE type {rope.rope_type!r} is not supported; supported types: {', '.join(_BY_TYPE)}")
    return compute(rope, head_dim)


def _wavelength_steps(theta: float, head_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    return theta**exponents


def _base_frequencies(theta: float, head_dim: int) -> torch.Tensor:
    return 1.0 / _wavelength_steps(theta, head_dim)


def _param(rope: RopeConfig, key: str) -> float:
    value = rope.params.get(key)
    if value is None:
        raise ModelLoadError(f"RoPE type {rope.rope_type!r} needs {key!r} in the config's rope settings")
    return value


def _default(rope: RopeConfig, head_dim: int):
    return _base_frequencies(rope.theta, head_dim), 1.0


def _dynamic(rope: RopeConfig, head_dim: int):
    # Dynamic NTK only changes frequencies past max_position_embeddings, which the engine never reaches:
    # below it the frequencies are the default ones.
    _param(rope, "factor")
    return _default(rope, head_dim)


def _linear(rope: RopeConfig, head_dim: int):
    return _base_frequencies(rope.theta, head_dim) / _param(rope, "factor"), 1.0


def _llama3(rope: RopeConfig, head_dim: int):
    inv_freq = _base_frequencies(rope.theta, head_dim)
    factor = _param(rope, "factor")
    low_factor = _param(rope, "low_freq_factor")
    high_factor = _param(rope, "high_freq_factor")
    old_context = _param(rope, "original_max_position_embeddings")
    wavelength = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept; the band between blends the two smoothly.
    scaled = torch.where(wavelength > old_context / low_factor, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelength >= old_context / high_factor) & (wavelength <= old_context / low_factor)
    return torch.where(in_band, blended, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, head_dim: int):
    params = rope.params
    old_context = _param(rope, "original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        raise ModelLoadError("RoPE type 'yarn' needs 'factor' in the config's rope settings")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    low, high = _yarn_correction_range(
        beta_fast, beta_slow, head_dim, rope.theta, old_context, params.get("truncate", True)
    )
    steps = _wavelength_steps(rope.theta, head_dim)
    extrapolated = 1.0 / steps
    interpolated = 1.0 / (factor * steps)
    # Dimensions below `low` keep their frequency, those above `high` are interpolated, a linear ramp between.
    ramp = _linear_ramp(low, high, head_dim // 2)
    return interpolated * ramp + extrapolated * (1 - ramp), float(attention_factor)


def _yarn_correction_range(fast_rotations, slow_rotations, dim, theta, context, truncate):
    def dimension_for(rotations):
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_for(fast_rotations), dimension_for(slow_rotations)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _linear_ramp(low: float, high: float, size: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # avoid dividing by zero
    return ((torch.arange(size, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)


_BY_TYPE = {"default": _default, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn}
