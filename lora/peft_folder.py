"""Reads a Hugging Face PEFT LoRA folder: `adapter_config.json` + `adapter_model.safetensors`.

Rank and alpha come from the config (`r`, `lora_alpha`, per-module `rank_pattern` / `alpha_pattern`, `use_rslora`);
the scale `alpha / r` (rsLoRA: `alpha / sqrt(r)`) is folded into B (see adapter.py). Features that change the math
beyond plain LoRA (DoRA, trained biases, `modules_to_save`, fan-in-fan-out layouts) are refused by name. An adapter
of a fused projection (Phi-3's `qkv_proj`, `gate_up_proj`) becomes its parts' adapters, given the model's shapes."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .adapter import LoraAdapter
from .modules import BY_HF_NAME, FUSED_HF_MODULES, LoraFormatError, ModuleShapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# Config keys whose non-default value changes what the adapter computes.
_REFUSED = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "layer_replication": (None, []),
    "lora_bias": (False, None),
    "use_qalora": (False, None),
    "trainable_token_indices": (None, {}, []),
}


def is_peft_folder(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def read_peft_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoraFormatError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LoraFormatError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise LoraFormatError(f"{path}: must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraFormatError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, harmless in _REFUSED.items():
        if config.get(key, harmless[0]) not in harmless:
            raise LoraFormatError(f"{path}: {key}={config[key]!r} is not supported (plain LoRA only)")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise LoraFormatError(f"{path}: '{key}' must be a number > 0, got {config.get(key)!r}")
    return config


def read_peft_folder(folder: str | Path, shapes: ModuleShapes | None = None) -> LoraAdapter:
    """`shapes`: the model's, which splitting a fused projection's adapter needs (refused without them)."""
    folder = Path(folder)
    config = read_peft_config(folder)
    pairs = _read_pairs(folder)
    adapter = LoraAdapter(source=str(folder))
    for (layer, module), (a, b) in sorted(pairs.items()):
        scale = _scale(config, module, layer, a.shape[0])
        a, b = a.float().contiguous(), (b.float() * scale).contiguous()
        for part, part_b in _parts(module, b, shapes, f"{folder / WEIGHTS_FILE}: layer {layer} {module}"):
            adapter.add(layer, part, a, part_b.contiguous())
    if not adapter.weights:
        raise LoraFormatError(f"{folder / WEIGHTS_FILE}: holds no LoRA weights of a decoder layer")
    return adapter


def _read_pairs(folder: Path) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise LoraFormatError(f"{folder}: no {WEIGHTS_FILE} (only safetensors adapters are supported)")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                match = _KEY.search(name)
                if match is None:
                    raise LoraFormatError(
                        f"{path}: tensor {name} is not a LoRA A/B weight of a decoder layer "
                        "projection (embeddings, lm_head and saved modules are not supported)"
                    )
                layer, module, half = int(match.group(1)), match.group(2), match.group(3)
                if module not in BY_HF_NAME and module not in FUSED_HF_MODULES:
                    known = ", ".join([*BY_HF_NAME, *FUSED_HF_MODULES])
                    raise LoraFormatError(f"{path}: tensor {name} targets {module}, not one of {known}")
                halves.setdefault((layer, module), {})[half] = handle.get_tensor(name)
    except LoraFormatError:
        raise
    except Exception as err:  # safetensors raises its own types for bad headers and short files
        raise LoraFormatError(f"{path}: not a readable safetensors file ({err})") from None
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoraFormatError(f"{path}: layer {layer} {module} has lora_{''.join(pair)} but not both A and B")
    return {key: (pair["A"], pair["B"]) for key, pair in halves.items()}


def _parts(module: str, b: torch.Tensor, shapes: ModuleShapes | None, where: str) -> list[tuple[str, torch.Tensor]]:
    """(module, B) for a plain module; for a fused one, each part with its rows of B (A is shared)."""
    parts = FUSED_HF_MODULES.get(module)
    if parts is None:
        return [(module, b)]
    if shapes is None:
        raise LoraFormatError(f"{where}: a fused {module} adapter can only be read against a model's shapes")
    sizes = [shapes.shapes[part][1] for part in parts]
    if b.shape[0] != sum(sizes):
        raise LoraFormatError(f"{where}: B has {b.shape[0]} rows, the model's {module} {sum(sizes)}")
    return list(zip(parts, b.split(sizes)))


def _scale(config: dict[str, Any], module: str, layer: int, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, layer, config["lora_alpha"])
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _pattern_value(patterns: dict[str, Any], module: str, layer: int, default):
    """PEFT's per-module overrides: a key matches a module whose dotted path ends with it (regex allowed)."""
    path = f"model.layers.{layer}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", path):
            return value
    return default
