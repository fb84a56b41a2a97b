"""FP8 KV cache scales a checkpoint carries, one float32 scalar per layer for keys and one for values
(attention/fp8_cache.py says how they are used). Exporters name them differently; every name below is read:

- `self_attn.k_scale` / `self_attn.v_scale`: compressed-tensors (llm-compressor) and vLLM's own layout;
- `self_attn.k_proj.k_scale` / `self_attn.v_proj.v_scale`: NVIDIA ModelOpt;
- `self_attn.k_proj.output_scale` / `self_attn.v_proj.output_scale`: older FP8 exports (AutoFP8);
- `self_attn.kv_scale`: an older single scale for both.

A model without them keeps 1.0. A cache in the model's dtype ignores them."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

import torch

from .network.model_config import ModelLoadError

_NAME = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\."
    r"(k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale|k_proj\.output_scale|v_proj\.output_scale)$"
)
# Which of the layer's scales each name sets.
_SETS = {
    "k_scale": ("k_scale",),
    "k_proj.k_scale": ("k_scale",),
    "k_proj.output_scale": ("k_scale",),
    "v_scale": ("v_scale",),
    "v_proj.v_scale": ("v_scale",),
    "v_proj.output_scale": ("v_scale",),
    "kv_scale": ("k_scale", "v_scale"),
}


def kv_scale_target(name: str) -> Optional[tuple[int, tuple[str, ...]]]:
    """(layer index, the LlamaAttention attributes it sets) for a KV cache scale's checkpoint name, else None."""
    match = _NAME.match(name)
    if match is None:
        return None
    return int(match.group(1)), _SETS[match.group(2)]


def set_kv_scale(model, name: str, tensor: torch.Tensor, path: Path) -> None:
    """Store the scale tensor `name` (see kv_scale_target) on its layer's attention; a scale that is not one
    positive finite number, or a layer the model does not have, is a ModelLoadError naming the tensor."""
    target = kv_scale_target(name)
    assert target is not None, name
    index, attributes = target
    if index >= len(model.layers):
        raise ModelLoadError(f"{path}: unexpected tensor {name} (the model has {len(model.layers)} layers)")
    if tensor.numel() != 1:
        raise ModelLoadError(
            f"{path}: tensor {name} has shape {list(tensor.shape)}; KV cache scales must be one value per layer "
            "(per-head or per-channel scales are not supported)"
        )
    value = float(tensor.float().item())
    if not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{path}: tensor {name} is {value}; a KV cache scale must be a positive number")
    for attribute in attributes:
        setattr(model.layers[index].self_attn, attribute, value)
