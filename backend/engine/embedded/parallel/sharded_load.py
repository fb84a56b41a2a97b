"""Loads one rank's part of a Hugging Face checkpoint: its pipeline stage's layers (with the embedding on the first
stage, the final norm and output head on the last), each at the rank's tensor-parallel shapes (sharding.py). Each
tensor is read through `safe_open(...).get_slice`, so a rank reads only its own rows or columns of its own layers."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Protocol

import torch

from ...config import ConfigError
from ..loader import (
    _allocate_parameters,
    _fill_dummy_parameters,
    _fill_parameters,
    model_class,
    read_model_config,
    weight_files,
)
from ..network.layers import Embedding
from ..network.llama import LlamaForCausalLM, WeightSlot
from ..network.model_config import ModelConfig, ModelLoadError
from .layers import make_tensor_parallel
from .layout import ParallelLayout
from .sharding import ShardPlan, TensorSlice

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
_EMBEDDING, _NORM, _HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


class RankGroup(Protocol):
    """What loading reads of a ParallelGroup (the collectives are only installed here, never called)."""

    layout: ParallelLayout
    tp_rank: int
    tp_size: int
    device: torch.device


def load_sharded(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, group: RankGroup, load_format: str = "auto"
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """This rank's model (its collectives installed; its stage's layers only) and the full model's config.
    `load_format` "dummy": config.json alone, the rank's parameters filled as loader.py fills a whole model's (so
    the ranks' weights are not one model's split: for benchmarks)."""
    model_dir = Path(model_dir)
    config = read_model_config(model_dir)
    if model_class(config) is not LlamaForCausalLM or config.moe is not None:
        raise ConfigError(
            f"tensor or pipeline parallelism: {config.architecture} is not split yet (they cover the "
            "Llama-family models: Llama, Mistral, Qwen2, Qwen3, SmolLM2, TinyLlama)"
        )
    if config.quantization_config is not None:
        raise ConfigError("tensor or pipeline parallelism: quantized checkpoints are not split yet")
    plan = ShardPlan.of(config, group.tp_rank, group.tp_size)
    layout, layers = group.layout, group.layout.layers(config.num_layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(stage_config(plan.local_config(), layers))
        if not needs_embedding(layout, config):
            model.embed_tokens = Embedding(0, config.hidden_size)  # the stage never looks a token up
        if not layout.is_last_stage:
            model.lm_head = None  # nor computes logits
    _allocate_parameters(model, dtype, device)
    slots = stage_slots(model, layout, layers, config)
    if load_format == "dummy":
        _fill_dummy_parameters(model, device)
    else:
        _fill_parameters(
            model,
            config,
            weight_files(model_dir),
            torch.device("cpu"),
            None,
            read_into=lambda handle, name, path, slot: _copy_slice(handle, name, path, slot, plan.slice_of(name)),
            slots=slots,
            foreign=lambda name: _held_elsewhere(name, slots, layers),
        )
    for rope in model.rotary_embeddings():
        rope.reset_frequencies(device)
    if group.tp_size > 1:
        make_tensor_parallel(model, plan, group)  # type: ignore[arg-type]  # a ParallelGroup at run time
    if device.type == "cpu" and dtype == torch.float32:  # as loader.load_model: cpu_gemm packs fp32 weights only
        model.pack_for_cpu(head=layout.is_last_stage)
    return model.eval(), config


def stage_config(config: ModelConfig, layers: range) -> ModelConfig:
    """`config` cut to a stage's layers (their count and per-layer settings)."""
    per_layer = {
        name: getattr(config, name)[layers.start : layers.stop]
        for name in ("layer_windows", "layer_types")
        if getattr(config, name)
    }
    return dataclasses.replace(config, num_layers=len(layers), **per_layer)


def needs_embedding(layout: ParallelLayout, config: ModelConfig) -> bool:
    """The first stage looks tokens up; the last stage of a tied model computes its logits with the same matrix."""
    return layout.is_first_stage or (layout.is_last_stage and config.tie_word_embeddings)


def stage_slots(model: LlamaForCausalLM, layout: ParallelLayout, layers: range, config: ModelConfig):
    """The stage's slots by checkpoint name: its layers under their index in the whole model."""
    slots: dict[str, WeightSlot] = {}
    for index, layer in zip(layers, model.decoder_layers):
        slots.update(model.layer_slots(f"model.layers.{index}.", layer))
    if needs_embedding(layout, config):
        slots[_EMBEDDING] = WeightSlot.whole(model.embed_tokens.weight)
    if layout.is_last_stage:
        slots[_NORM] = WeightSlot.whole(model.norm.weight)
        if model.lm_head is not None:
            slots[_HEAD] = WeightSlot.whole(model.lm_head.weight)
    return slots


def _held_elsewhere(name: str, slots: dict[str, WeightSlot], layers: range) -> bool:
    """A tensor (not among `slots`) that another stage loads: another stage's layer, the embedding or the final
    norm; the head off the last stage (a tied head's saved copy is not: the loader skips it everywhere)."""
    layer = _LAYER_NAME.match(name)
    if layer is not None:
        return int(layer.group(1)) not in layers
    return name in (_EMBEDDING, _NORM) or (name == _HEAD and _NORM not in slots)


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
