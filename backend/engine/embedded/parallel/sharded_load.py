"""Loads one rank's shard of a Hugging Face checkpoint: the model is built at the rank's shapes (sharding.py) and
each tensor is read through `safe_open(...).get_slice`, so a rank reads only its own rows or columns from disk."""

from __future__ import annotations

from pathlib import Path

import torch

from ...config import ConfigError
from ..loader import _allocate_parameters, _fill_parameters, model_class, read_model_config, weight_files
from ..network.llama import LlamaForCausalLM, WeightSlot
from ..network.model_config import ModelConfig, ModelLoadError
from .group import TensorParallelGroup
from .layers import make_tensor_parallel
from .sharding import ShardPlan, TensorSlice


def load_sharded(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, group: TensorParallelGroup
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """This rank's model (its collectives installed) and the full model's config."""
    model_dir = Path(model_dir)
    config = read_model_config(model_dir)
    if model_class(config) is not LlamaForCausalLM or config.moe is not None:
        raise ConfigError(
            f"tensor_parallel_size > 1: {config.architecture} is not sharded yet (tensor parallelism covers the "
            "Llama-family models: Llama, Mistral, Qwen2, Qwen3, SmolLM2, TinyLlama)"
        )
    if config.quantization_config is not None:
        raise ConfigError("tensor_parallel_size > 1: quantized checkpoints are not sharded yet")
    plan = ShardPlan.of(config, group.rank, group.size)
    with torch.device("meta"):
        model = LlamaForCausalLM(plan.local_config())
    _allocate_parameters(model, dtype, device)
    _fill_parameters(
        model,
        config,
        weight_files(model_dir),
        torch.device("cpu"),
        None,
        read_into=lambda handle, name, path, slot: _copy_slice(handle, name, path, slot, plan.slice_of(name)),
    )
    for rope in model.rotary_embeddings():
        rope.reset_frequencies(device)
    make_tensor_parallel(model, plan, group)
    if device.type == "cpu" and dtype == torch.float32:  # as loader.load_model: cpu_gemm packs fp32 weights only
        model.pack_for_cpu()
    return model.eval(), config


def _copy_slice(handle, name: str, path: Path, slot: WeightSlot, part: TensorSlice | None) -> None:
    try:
        if part is not None and part.zero:
            tensor = torch.zeros(slot.shape)
        else:
            view = handle.get_slice(name)
            if part is None:
                tensor = view[:]
            elif part.dim == 0:
                tensor = view[part.start : part.start + part.length]
            else:
                tensor = view[:, part.start : part.start + part.length]
    except Exception as err:
        raise ModelLoadError(f"{path}: cannot read tensor {name} ({err})") from None
    if tuple(tensor.shape) != slot.shape:
        raise ModelLoadError(
            f"{path}: tensor {name}'s shard has shape {list(tensor.shape)}, expected {list(slot.shape)}"
        )
    slot.copy_(tensor)
