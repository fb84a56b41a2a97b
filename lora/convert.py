"""`tritonllm lora convert`: a PEFT folder -> the `.npy` pair a client sends as `lora_weights` / `lora_config`,
and the loader that reads any adapter folder (PEFT, or such a pair) back."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .adapter import LoraAdapter
from .modules import LoraFormatError, ModuleShapes
from .peft_folder import is_peft_folder, read_peft_folder
from .trtllm_format import adapter_from_tensors, adapter_to_tensors

WEIGHTS_NPY = "model.lora_weights.npy"
CONFIG_NPY = "model.lora_config.npy"
DTYPES = {"float16": np.float16, "float32": np.float32}


def convert_peft_folder(peft_dir: str | Path, out_dir: str | Path, dtype: str = "float16") -> tuple[Path, Path]:
    """Write `model.lora_weights.npy` ([1, rows, cols], `dtype`) and `model.lora_config.npy` ([1, rows, 3],
    int32) into `out_dir`, TensorRT-LLM's names and layout; returns their paths."""
    if dtype not in DTYPES:
        raise LoraFormatError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    weights, config = adapter_to_tensors(read_peft_folder(peft_dir), DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / WEIGHTS_NPY, weights)
    np.save(out / CONFIG_NPY, config)
    return out / WEIGHTS_NPY, out / CONFIG_NPY


def is_npy_folder(path: str | Path) -> bool:
    return (Path(path) / WEIGHTS_NPY).is_file() and (Path(path) / CONFIG_NPY).is_file()


def is_adapter_folder(path: str | Path) -> bool:
    return is_peft_folder(path) or is_npy_folder(path)


def load_adapter_folder(path: str | Path, shapes: ModuleShapes) -> LoraAdapter:
    """A PEFT folder, or a folder with the converter's `.npy` pair (TensorRT-LLM's `lora_prefetch_dir` layout)."""
    path = Path(path)
    if is_peft_folder(path):
        return read_peft_folder(path, shapes)
    if is_npy_folder(path):
        return adapter_from_tensors(np.load(path / WEIGHTS_NPY), np.load(path / CONFIG_NPY), shapes, source=str(path))
    raise LoraFormatError(
        f"{path}: not a LoRA adapter folder (expected adapter_config.json + "
        f"adapter_model.safetensors, or {WEIGHTS_NPY} + {CONFIG_NPY})"
    )
