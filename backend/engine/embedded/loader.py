"""Reads a Hugging Face model folder (config.json + safetensors) into the embedded engine's own model code.

Weights go straight into parameters allocated in the target dtype on the target device; every failure is a
`ModelLoadError` that names the file or tensor at fault. With `load_format="dummy"` (TensorRT-LLM's
LoadFormat.DUMMY) only config.json is read and every parameter gets seeded random values instead, for benchmarks
that need a model's shape but not its weights."""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from safetensors import safe_open

from ...json_files import read_json_object
from .kv_scales import kv_scale_target, set_kv_scale
from .load_progress import StepProgress, timed_step
from .network.gemma import GemmaForCausalLM
from .network.layers import RMSNorm
from .network.llama import LlamaForCausalLM, WeightSlot
from .network.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from .network.moe import MoeForCausalLM
from .network.phi3 import Phi3ForCausalLM
from .quant.checkpoint import fill_dummy, quantized_slots
from .quant.layout import quantize_layout
from .quant.linear import QuantLinear
from .quant.settings import QuantSettings, resolve

__all__ = [
    "LOAD_FORMATS",
    "ModelLoadError",
    "ModelConfig",
    "SUPPORTED_ARCHITECTURES",
    "load_model",
    "read_model_config",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Checkpoint tensors that carry nothing the model needs (old exports saved RoPE's frequencies).
_HARMLESS_EXTRA = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# The names quantized checkpoints give a module's tensors besides `weight` (compressed-tensors, AWQ, GPTQ, FP8).
_QUANTIZED_SUFFIXES = {
    "weight_packed",
    "weight_scale",
    "weight_zero_point",
    "weight_shape",
    "input_scale",
    "weight_scale_inv",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
}
LOAD_FORMATS = ("auto", "dummy")
log = logging.getLogger("tritonllm.engine")
# Dummy weights: a fixed seed, so that two loads (and two benchmark runs) hold the same values, and a spread small
# enough that bf16 activations stay finite through many layers (the usual initializer_range of these models).
DUMMY_SEED = 0
DUMMY_STD = 0.02
# The network code of each architecture whose layers or checkpoint differ from Llama's (the rest run llama.py):
# the one place that picks it.
_MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    return _MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)


def read_model_config(model_dir: Union[str, Path]) -> ModelConfig:
    model_dir = Path(model_dir)
    config = ModelConfig.from_dict(
        read_json_object(model_dir / "config.json", "config.json", ModelLoadError),
        source=str(model_dir / "config.json"),
    )
    # generation_config.json's end tokens are the ones generation stops on (Llama 3 lists several there).
    generation_file = model_dir / "generation_config.json"
    if generation_file.is_file():
        eos = read_json_object(generation_file, "generation_config.json", ModelLoadError).get("eos_token_id")
        if eos is not None:
            config.eos_token_id = eos
    return config


def load_model(
    model_dir: Union[str, Path],
    dtype: torch.dtype,
    device: Union[str, torch.device],
    load_format: str = "auto",
    quant_config: Optional[dict] = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model of a folder, on `device` in `dtype`. `load_format`: "auto" reads the safetensors weights; "dummy"
    reads config.json alone (weight files need not exist) and fills every parameter with seeded random values.
    `quant_config`: model.yaml's (TensorRT-LLM's keys); with it, or with a quantized checkpoint, the projections
    are quantized (quant/settings.py resolves the two; a dummy load quantizes its random weights)."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    model_dir = Path(model_dir)
    config = read_model_config(model_dir)
    quant = resolve(quant_config, config.quantization_config)
    files = weight_files(model_dir) if load_format == "auto" else []
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(config)(config)
        if quant is not None:
            count = quantize_layout(model, quant)
            log.info("quantization: %d projections %s (%s, from %s)", count, quant.kind, quant.quant_algo, quant.source)
    _allocate_parameters(model, dtype, device)
    if load_format == "dummy":
        _fill_dummy_parameters(model, device)
    else:
        _fill_parameters(model, config, files, device, quant)
    for rope in model.rotary_embeddings():
        rope.reset_frequencies(device)
    packs = device.type == "cpu" and dtype == torch.float32  # cpu_gemm packs fp32 weights only
    with timed_step("weights packed for CPU matmuls") if packs else contextlib.nullcontext():
        model.pack_for_cpu()
    return model.eval(), config


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder: one file, or the shards its index names."""
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    index_path = model_dir / INDEX_FILE
    if not index_path.is_file():
        found = sorted(p.name for p in model_dir.glob("*.bin")) if model_dir.is_dir() else []
        hint = f" (found {', '.join(found)}: only safetensors weights are supported)" if found else ""
        raise ModelLoadError(f"{model_dir}: no weight file, expected {SINGLE_FILE} or {INDEX_FILE}{hint}")
    weight_map = read_json_object(index_path, INDEX_FILE, ModelLoadError).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index_path}: has no 'weight_map'")
    shards = [model_dir / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if not shard.is_file():
            raise ModelLoadError(f"{index_path}: lists weight file {shard.name}, which does not exist")
    return shards


def _allocate_parameters(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace the meta parameters with uninitialised storage; loading then fills every one of them."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            storage = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, torch.nn.Parameter(storage, requires_grad=False))
        if isinstance(module, QuantLinear):
            module.allocate(dtype, device)


def _fill_dummy_parameters(model: LlamaForCausalLM, device: torch.device) -> None:
    """Every parameter set, generated on the device itself (an 8B model fills in well under a second on a GPU):
    RMSNorm scales (q_norm and k_norm too) at their identity (one; zero for Gemma's 1 + weight), biases zeros,
    embeddings and matrices normal(0, DUMMY_STD)."""
    generator = torch.Generator(device=device).manual_seed(DUMMY_SEED)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if isinstance(module, RMSNorm):
                    param.fill_(module.identity_weight)
                elif name == "bias":
                    param.zero_()
                else:
                    param.normal_(0.0, DUMMY_STD, generator=generator)
        fill_dummy(model, generator, DUMMY_STD)


def _fill_parameters(
    model: LlamaForCausalLM,
    config: ModelConfig,
    files: list[Path],
    device,
    quant: Optional[QuantSettings],
    read_into: Callable[[Any, str, Path, WeightSlot], None] | None = None,
    slots: dict[str, WeightSlot] | None = None,
    foreign: Callable[[str], bool] | None = None,
) -> None:
    """Every slot of `model` from the checkpoint files. `read_into(handle, name, path, slot)` copies one tensor
    into its slot: the whole tensor (_load_tensor) or, under tensor parallelism, this rank's slice of it. A
    pipeline stage passes its own `slots` (by checkpoint name) and `foreign`, the tensors other stages hold."""
    read_into = read_into or _load_tensor
    slots = model.checkpoint_slots() if slots is None else slots
    if quant is not None:
        slots = quantized_slots(model, slots, quant)
    handles = [(path, _open(path, device)) for path in files]
    total = sum(len(handle.keys()) for _, handle in handles)
    loaded: set[str] = set()
    kv_scales = 0
    size = sum(path.stat().st_size for path in files) / 2**20
    log.info("loading weights: %d tensors from %d file(s), %.0f MiB, onto %s", total, len(files), size, device)
    with StepProgress("loading weights", total, "tensor") as progress:
        for path, handle in handles:
            for name in handle.keys():
                slot = slots.get(name)
                if slot is not None:
                    read_into(handle, name, path, slot)
                    loaded.add(name)
                elif foreign is not None and foreign(name):
                    pass
                elif kv_scale_target(name) is not None:
                    set_kv_scale(model, name, _read_tensor(handle, name, path), path)
                    kv_scales += 1
                else:
                    _check_extra(name, path, config)
                progress.update(1)
    if kv_scales:
        log.info("read %d FP8 KV cache scale tensor(s) from the checkpoint (used by an FP8 KV cache)", kv_scales)
    missing = [name for name, slot in slots.items() if name not in loaded and getattr(slot, "required", True)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{files[0].parent}: missing tensor {shown}")


def _open(path: Path, device: torch.device):
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except Exception as err:  # safetensors raises its own error types for bad headers and short files
        raise ModelLoadError(f"{path}: not a readable safetensors file ({err})") from None


def _check_extra(name: str, path: Path, config: ModelConfig) -> None:
    if _HARMLESS_EXTRA.search(name):
        return
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return  # a tied model's output projection is its embedding; the saved copy is redundant
    if name.rsplit(".", 1)[-1] in _QUANTIZED_SUFFIXES:
        raise ModelLoadError(
            f"{path}: tensor {name} is quantized, but the embedded engine keeps that module unquantized (only the "
            "decoder layers' attention and dense MLP projections load quantized: not the embedding, lm_head, MoE "
            "routers or experts)"
        )
    raise ModelLoadError(f"{path}: unexpected tensor {name} (not part of a {config.architecture})")


def _read_tensor(handle, name: str, path: Path) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except Exception as err:
        raise ModelLoadError(f"{path}: cannot read tensor {name} ({err})") from None


def _load_tensor(handle, name: str, path: Path, slot: WeightSlot) -> None:
    try:
        shape = tuple(handle.get_slice(name).get_shape())
        if shape != slot.shape and not (_is_scalar(shape) and _is_scalar(slot.shape)):
            raise ModelLoadError(f"{path}: tensor {name} has shape {list(shape)}, expected {list(slot.shape)}")
        tensor = handle.get_tensor(name)
    except ModelLoadError:
        raise
    except Exception as err:
        raise ModelLoadError(f"{path}: cannot read tensor {name} ({err})") from None
    slot.copy_(tensor)


def _is_scalar(shape: tuple[int, ...]) -> bool:
    """A scale stored as [] or [1]: checkpoints write either."""
    return len(shape) <= 1 and all(size == 1 for size in shape)
