"""One LoRA adapter in the form every reader produces and the engine consumes.

For each adapted (layer, module): `A` of shape [rank, in_features] and `B` of shape [out_features, rank], so that the
module computes `x W^T + (x A^T) B^T`. The scaling (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA) is
folded into `B` when the adapter is read, as TensorRT-LLM's `hf_lora_convert.py` folds it into its "out" weights;
so `B` here is exactly the out-weights of a `lora_weights` row, and tensors go both ways without a scale field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from .modules import LoraFormatError, ModuleShapes

Key = tuple[int, str]  # (layer index, HF module name)


@dataclass
class LoraAdapter:
    weights: dict[Key, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    source: str = ""  # where it came from, for messages

    @property
    def rank(self) -> int:
        """The largest rank over its modules (a module may use a smaller one)."""
        return max((a.shape[0] for a, _ in self.weights.values()), default=0)

    @property
    def modules(self) -> set[str]:
        return {name for _, name in self.weights}

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    def add(self, layer: int, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraFormatError(
                f"{self.source}: layer {layer} {module}: A {list(a.shape)} and B {list(b.shape)} "
                "are not [rank, in] and [out, rank] of one rank"
            )
        if (layer, module) in self.weights:
            raise LoraFormatError(f"{self.source}: layer {layer} {module} is given twice")
        self.weights[(layer, module)] = (a, b)

    def check(
        self, shapes: ModuleShapes, max_rank: Optional[int] = None, targets: Optional[Iterable[str]] = None
    ) -> None:
        """Raise LoraFormatError unless every module fits the model, the rank limit and the allowed targets."""
        if not self.weights:
            raise LoraFormatError(f"{self.source}: the adapter holds no LoRA weights")
        allowed = set(targets) if targets is not None else None
        for (layer, module), (a, b) in sorted(self.weights.items()):
            where = f"{self.source}: layer {layer} {module}"
            if not 0 <= layer < shapes.num_layers:
                raise LoraFormatError(f"{where}: layer index {layer} is outside the model's {shapes.num_layers} layers")
            if allowed is not None and module not in allowed:
                raise LoraFormatError(
                    f"{where}: {module} is not among the enabled LoRA target modules "
                    f"{sorted(allowed)} (lora_config.lora_target_modules)"
                )
            in_features, out_features = shapes.shapes[module]
            if a.shape[1] != in_features or b.shape[0] != out_features:
                raise LoraFormatError(
                    f"{where}: A {list(a.shape)} / B {list(b.shape)} do not match the model's "
                    f"{module} ({in_features} in, {out_features} out)"
                )
            if max_rank is not None and a.shape[0] > max_rank:
                raise LoraFormatError(f"{where}: rank {a.shape[0]} is above max_lora_rank {max_rank}")

    def to(self, dtype: torch.dtype) -> "LoraAdapter":
        return LoraAdapter({k: (a.to(dtype), b.to(dtype)) for k, (a, b) in self.weights.items()}, self.source)
