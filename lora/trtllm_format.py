"""TensorRT-LLM's per-request LoRA tensors, read and written.

`lora_config` [rows, 3] INT32: `[module_id, layer_idx, adapter_size]` per row. `lora_weights` [rows, cols]: row i
holds module-layer i's in-weights (A, [adapter_size, in_features], row-major) followed by its out-weights (B,
[out_features, adapter_size], row-major, the LoRA scale already folded in), then zero padding up to the longest row.
Either tensor may carry a leading batch dimension of 1 (`hf_lora_convert.py` writes `[1, rows, ...]`)."""

from __future__ import annotations

import numpy as np
import torch

from .adapter import LoraAdapter
from .modules import BY_HF_NAME, LoraFormatError, ModuleShapes, module_with_id


def adapter_to_tensors(adapter: LoraAdapter, dtype=np.float16) -> tuple[np.ndarray, np.ndarray]:
    """(lora_weights [1, rows, cols] in `dtype`, lora_config [1, rows, 3] int32), rows by layer then module id."""
    keys = sorted(adapter.weights, key=lambda k: (k[0], BY_HF_NAME[k[1]].module_id))
    rows, config = [], []
    for layer, module in keys:
        a, b = adapter.weights[(layer, module)]
        rows.append(torch.cat([a.float().reshape(-1), b.float().reshape(-1)]).numpy())
        config.append([BY_HF_NAME[module].module_id, layer, a.shape[0]])
    width = max(len(row) for row in rows)
    weights = np.zeros((1, len(rows), width), dtype=dtype)
    for index, row in enumerate(rows):
        weights[0, index, : len(row)] = row
    return weights, np.asarray([config], dtype=np.int32)


def adapter_from_tensors(
    weights: np.ndarray, config: np.ndarray, shapes: ModuleShapes, source: str = "lora_weights"
) -> LoraAdapter:
    """The adapter the two tensors describe, for a model of `shapes`; errors name the tensor and row."""
    weights = _drop_batch(np.asarray(weights), 2, "lora_weights")
    config = _drop_batch(np.asarray(config), 2, "lora_config")
    if config.shape[-1] != 3:
        raise LoraFormatError(f"lora_config must have shape [rows, 3], got {list(config.shape)}")
    if weights.shape[0] != config.shape[0]:
        raise LoraFormatError(
            f"lora_weights has {weights.shape[0]} rows but lora_config has {config.shape[0]}: "
            "they must describe the same module-layers"
        )
    adapter = LoraAdapter(source=source)
    longest = 0
    for index, (module_id, layer, rank) in enumerate(config.astype(np.int64).tolist()):
        module = module_with_id(module_id).hf_name
        if rank < 1:
            raise LoraFormatError(f"lora_config row {index}: adapter size {rank} must be >= 1")
        in_features, out_features = shapes.shapes[module]
        needed = rank * (in_features + out_features)
        if needed > weights.shape[1]:
            raise LoraFormatError(
                f"lora_weights row {index} (layer {layer} {module}, rank {rank}) needs {needed} "
                f"values for this model ({in_features} in, {out_features} out) but has "
                f"{weights.shape[1]}: the adapter does not match the model"
            )
        longest = max(longest, needed)
        row = torch.from_numpy(np.ascontiguousarray(weights[index, :needed], dtype=np.float32))
        a = row[: rank * in_features].reshape(rank, in_features)
        b = row[rank * in_features :].reshape(out_features, rank)
        adapter.add(layer, module, a, b)
    if config.shape[0] and weights.shape[1] != longest:
        raise LoraFormatError(
            f"lora_weights rows have {weights.shape[1]} values but the longest row needs "
            f"{longest} for this model: the adapter was converted for another model"
        )
    return adapter


def _drop_batch(array: np.ndarray, ndim: int, name: str) -> np.ndarray:
    if array.ndim == ndim + 1 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != ndim:
        raise LoraFormatError(f"{name} must have shape [rows, ...] (or [1, rows, ...]), got {list(array.shape)}")
    return array
