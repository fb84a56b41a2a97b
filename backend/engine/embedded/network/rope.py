"""RoPE inverse frequencies for each supported scaling type, in fp32 (as Hugging Face computes them).

Each function returns `(inv_freq [head_dim // 2], attention_factor)`; the factor multiplies cos and sin. Always
computed on the CPU (also while a model is built on the meta device), then moved where the model lives.

`context_len` matters to longrope alone: like transformers' `seq_len`, above original_max_position_embeddings it
picks the long factors, else the short ones (see RotaryEmbedding.set_context_length for how the engine sets it)."""

from __future__ import annotations

import math

import torch

from .model_config import ModelLoadError, RopeConfig


def rope_frequencies(rope: RopeConfig, head_dim: int, context_len: int | None = None) -> tuple[torch.Tensor, float]:
    if rope.rope_type == "longrope":
        return _longrope(rope, head_dim, context_len)
    compute = _BY_TYPE.get(rope.rope_type)
    if compute is None:
        supported = ", ".join([*_BY_TYPE, "longrope"])
        raise ModelLoadError(f"RoPE type {rope.rope_type!r} is not supported; supported types: {supported}")
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


def uses_long_factors(rope: RopeConfig, context_len: int | None) -> bool:
    """longrope: whether a context of `context_len` tokens rotates with the long factors."""
    original = rope.params.get("original_max_position_embeddings")
    return bool(context_len and original and context_len > original)


def _longrope(rope: RopeConfig, head_dim: int, context_len: int | None):
    """Phi-3's LongRoPE: each pair's base frequency divided by its own factor, from the short list up to
    original_max_position_embeddings, the long list past it; cos and sin scaled by sqrt(1 + ln(s) / ln(original))
    for a stretch s = `factor` > 1 (model_config fills it in as max / original positions), unless given."""
    original = _param(rope, "original_max_position_embeddings")
    factor = _param(rope, "factor")
    attention_factor = rope.params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    key = "long_factor" if uses_long_factors(rope, context_len) else "short_factor"
    factors = torch.tensor(rope.params[key], dtype=torch.float32, device="cpu")
    return 1.0 / (factors * _wavelength_steps(rope.theta, head_dim)), float(attention_factor)


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
