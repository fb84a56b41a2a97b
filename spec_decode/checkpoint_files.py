"""The small checkpoint folders speculative methods load (Medusa heads, EAGLE draft layers): a config.json and
one weights file, safetensors preferred over a pickled state dict. Every failure is a ModelLoadError naming the
file and what was wrong with it."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tritonllm.engine.embedded.loader import read_json_object
from tritonllm.engine.embedded.models.model_config import ModelLoadError

CONFIG_FILE = "config.json"


def read_config(folder: Path, kind: str, weight_files: tuple[str, str]) -> dict[str, Any]:
    """`folder`/config.json as a dict; `kind` ("a Medusa") and `weight_files` word the error for a missing file."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no {CONFIG_FILE} ({kind} checkpoint folder has {CONFIG_FILE} and "
                             f"{weight_files[0]} or {weight_files[1]})")
    return read_json_object(path, CONFIG_FILE)


def read_weights(folder: Path, safetensors_file: str, pickle_file: str, kind: str) -> dict[str, torch.Tensor]:
    """The state dict of `folder`'s safetensors file, else of its pickle (loaded with weights_only)."""
    if (folder / safetensors_file).is_file():
        try:
            return load_file(str(folder / safetensors_file))
        except Exception as err:  # safetensors raises its own error types
            raise ModelLoadError(f"{folder / safetensors_file}: not a readable safetensors file ({err})") from None
    if (folder / pickle_file).is_file():
        try:  # weights_only: a checkpoint must never run code on load
            state = torch.load(folder / pickle_file, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ModelLoadError(f"{folder / pickle_file}: cannot read {kind} weights ({err})") from None
        if not isinstance(state, dict):
            raise ModelLoadError(f"{folder / pickle_file}: does not hold a state dict")
        return state
    raise ModelLoadError(f"{folder}: no {safetensors_file} or {pickle_file}")
