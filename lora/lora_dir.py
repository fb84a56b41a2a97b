"""`lora_dir` / `lora_prefetch_dir`: folders of adapters, named by folder name and mapped to task ids.

A folder is itself an adapter, or holds adapter folders (PEFT, or the converter's `.npy` pair). A numeric folder
name is the task id (TensorRT-LLM's `lora_prefetch_dir/<task_id>/` layout); other names get the lowest free ids,
in name order, after the numeric ones are placed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .convert import is_adapter_folder
from .modules import LoraFormatError


@dataclass(frozen=True)
class NamedAdapter:
    name: str
    task_id: int
    path: str


def adapters_in(folders: Iterable[str | Path]) -> list[NamedAdapter]:
    paths: list[Path] = []
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise LoraFormatError(f"lora_dir {folder} is not a folder")
        found = [folder] if is_adapter_folder(folder) else sorted(p for p in folder.iterdir() if is_adapter_folder(p))
        if not found:
            raise LoraFormatError(
                f"lora_dir {folder} holds no adapter folder (adapter_config.json + "
                "adapter_model.safetensors, or model.lora_weights.npy + model.lora_config.npy)"
            )
        paths += found
    names = [p.name for p in paths]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise LoraFormatError(f"lora_dir: more than one adapter is named {', '.join(twice)}")
    used = {int(p.name) for p in paths if p.name.isdigit()}
    free = (i for i in range(1, 1 << 62) if i not in used)
    numeric = [NamedAdapter(p.name, int(p.name), str(p)) for p in paths if p.name.isdigit()]
    named = [
        NamedAdapter(p.name, next(free), str(p)) for p in sorted(paths, key=lambda p: p.name) if not p.name.isdigit()
    ]
    return sorted(numeric + named, key=lambda a: a.task_id)
