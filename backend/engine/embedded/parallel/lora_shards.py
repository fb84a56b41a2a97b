"""LoRA adapters under tensor parallelism: each rank's slots hold its part of every adapter, cut as the base
projections are (sharding.py's rules for the module's checkpoint weight).

- Split by output (q/k/v, gate/up): x is whole on every rank, so A is kept whole and B keeps the rank's output
  rows (a KV head replicated over ranks keeps that head's rows, as the base k/v weights do).
- Split by input (o, down): x is the rank's slice of the input, so A keeps those columns; x @ A^T is then a partial
  sum, made whole by one all-reduce of that small [tokens, slots x rank] product; B is whole and every rank adds
  the same delta to the projection's summed output.
Rank 0 checks adapters against the whole model's shapes, as on one rank, and sends each load to the other ranks
in its step plans (step_sync.py), so every rank fills the same slot with its part of the same adapter."""

from __future__ import annotations

import dataclasses

import torch

from tritonllm.lora.layers import LoraSharding
from tritonllm.lora.modules import ModuleShapes

from .group import ParallelGroup
from .sharding import ShardPlan

_SCOPE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_INPUT_SPLIT = ("o", "down")  # the LoRA groups (lora/modules.py) of the projections split by input


class TensorParallelLora(LoraSharding):
    def __init__(self, plan: ShardPlan, group: ParallelGroup):
        self.plan = plan
        self.group = group

    def _cut(self, module: str):
        return self.plan.slice_of(f"{_SCOPE.get(module, 'mlp')}.{module}.weight")

    def local_shapes(self, shapes: ModuleShapes) -> ModuleShapes:
        local = {}
        for module, (in_features, out_features) in shapes.shapes.items():
            cut = self._cut(module)
            if cut is not None and cut.dim == 0:
                out_features = cut.length
            elif cut is not None:
                in_features = cut.length
            local[module] = (in_features, out_features)
        return dataclasses.replace(shapes, shapes=local)

    def part(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cut = self._cut(module)
        if cut is None:
            return a, b
        if cut.dim == 0:
            return a, b.narrow(0, cut.start, cut.length)
        return a.narrow(1, cut.start, cut.length), b

    def reduce(self, group: str, xa: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(xa) if group in _INPUT_SPLIT else xa
