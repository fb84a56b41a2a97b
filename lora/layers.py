"""Batched multi-LoRA for the embedded engine: the device tier (stacked per-slot A/B weights) and the per-step math.

Storage, per decoder layer and fused projection (qkv, o, gate_up, down) of the embedded model:
  A: [max_loras, sub-modules, max_rank, in_features]   B (per sub-module, transposed): [max_loras, max_rank, out]
Unused ranks and modules an adapter does not adapt stay zero, so every adapter runs the same math.

One step (tokens of several requests, each with its own slot or none): gather the A/B of the S slots the step uses,
cut to the largest rank r among them, then for input x [T, in] and output y [T, out] of a projection:
  xa = x @ A_s^T            [T, S*M*r]   (all sub-modules M at once)
  xa *= token_slot_mask     keeps, for each token, only the columns of its own slot (base-model tokens: none)
  y[:, cols_m] += xa_m @ B_m  [T, S*r] @ [S*r, out_m] for each sub-module m
Two matmuls per projection whatever the mix of adapters, the same code on CPU and GPU. A token's cost grows with S*r
instead of its own r: cheap while S*r is small next to the projection's width."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .adapter import LoraAdapter
from .modules import GROUPS, ModuleShapes


class LoraSharding:
    """Which part of an adapter a rank's slots hold. This one: all of it (one rank). Under tensor parallelism
    (the embedded engine's parallel/lora_shards.py) a rank keeps B's rows of its output columns where the base
    projection is split by output (q/k/v, gate/up), and A's columns of its input where it is split by input (o, down:
    their x @ A^T is then a partial sum, which `reduce` completes over the ranks)."""

    def local_shapes(self, shapes: ModuleShapes) -> ModuleShapes:
        return shapes

    def part(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A [r, in], B [out, r]) of one module's adapter."""
        return a, b

    def reduce(self, group: str, xa: torch.Tensor) -> torch.Tensor:
        """x @ A^T of projection `group`, whole on every rank."""
        return xa


WHOLE = LoraSharding()


@dataclass(frozen=True)
class SubModule:
    name: str
    start: int  # first output column in the fused projection
    size: int


class DeviceSlots:
    """`max_loras` slots of stacked weights on the model's device; adapters keyed by their cache uid."""

    def __init__(
        self,
        shapes: ModuleShapes,
        targets: tuple[str, ...],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        sharding: LoraSharding = WHOLE,
    ):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.sharding = sharding
        shapes = sharding.local_shapes(shapes)
        # Called with (uid, adapter, slot) on each load: rank 0 of a parallel run sends its loads to the others.
        self.on_load: Optional[Callable[[int, LoraAdapter, int], None]] = None
        self.groups: dict[str, list[SubModule]] = {}
        for group, members in GROUPS.items():
            starts = _column_starts(members, shapes)
            subs = [SubModule(m, starts[m], shapes.shapes[m][1]) for m in members if m in targets]
            if subs:
                self.groups[group] = subs
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(shapes.num_layers):
            for group, subs in self.groups.items():
                in_features = shapes.shapes[subs[0].name][0]
                self.a[(layer, group)] = torch.zeros(
                    max_loras, len(subs), max_rank, in_features, dtype=dtype, device=device
                )
                for sub in subs:
                    self.b[(layer, sub.name)] = torch.zeros(max_loras, max_rank, sub.size, dtype=dtype, device=device)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # uid -> slot, least recently used first
        self.rank_of: dict[int, int] = {}  # slot -> rank of the adapter in it
        self.num_loads = 0

    def assign(self, adapters: dict[int, LoraAdapter]) -> dict[int, int]:
        """Slots for the adapters one step needs (uid -> adapter), loading the missing ones over the least
        recently used slots that this step does not need."""
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"a step needs {len(adapters)} LoRA adapters but max_loras is {self.max_loras}")
        for uid in adapters:
            if uid in self.slot_of:
                self.slot_of.move_to_end(uid)
        for uid, adapter in adapters.items():
            if uid not in self.slot_of:
                self._load(uid, adapter, self._free_slot(set(adapters)))
        return {uid: self.slot_of[uid] for uid in adapters}

    def _free_slot(self, needed: set[int]) -> int:
        used = set(self.slot_of.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        victim = next(uid for uid in self.slot_of if uid not in needed)
        return self.slot_of.pop(victim)

    @torch.no_grad()
    def _load(self, uid: int, adapter: LoraAdapter, slot: int) -> None:
        self.load(uid, adapter, slot)
        if self.on_load is not None:
            self.on_load(uid, adapter, slot)

    @torch.no_grad()
    def load(self, uid: int, adapter: LoraAdapter, slot: int) -> None:
        """Put `adapter` (this rank's part of it) into `slot`, over whatever the slot held."""
        for uid_held, slot_held in list(self.slot_of.items()):
            if slot_held == slot:
                del self.slot_of[uid_held]
        for tensor in list(self.a.values()) + list(self.b.values()):
            tensor[slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            group = next(g for g, subs in self.groups.items() if any(s.name == module for s in subs))
            index = [s.name for s in self.groups[group]].index(module)
            a, b = self.sharding.part(module, a, b)
            rank = a.shape[0]
            self.a[(layer, group)][slot, index, :rank].copy_(a)
            self.b[(layer, module)][slot, :rank].copy_(b.t())
        self.slot_of[uid] = slot
        self.rank_of[slot] = adapter.rank
        self.num_loads += 1

    def batch(self, token_slots: list[int], device: torch.device) -> Optional["LoraBatch"]:
        """The per-step view for tokens with these slots (-1: base model); None when no token has an adapter."""
        active = sorted({s for s in token_slots if s >= 0})
        if not active:
            return None
        slots = torch.tensor(token_slots, device=device)
        active_t = torch.tensor(active, device=device)
        dtype = next(iter(self.a.values())).dtype
        mask = (slots[:, None] == active_t[None, :]).to(dtype)  # [T, S]
        rank = max(self.rank_of[s] for s in active)
        whole = active == list(range(self.max_loras))
        return LoraBatch(self, None if whole else active_t, rank, mask, list(token_slots))


@dataclass
class LoraBatch:
    slots: DeviceSlots
    active: Optional[torch.Tensor]  # [S] slot ids; None = every slot, in order
    rank: int
    mask: torch.Tensor  # [T, S]
    token_slots: list[int]  # each token's slot, -1 for the base model (what the other ranks rebuild this from)

    def layer(self, index: int) -> "LayerLora":
        return LayerLora(self, index)

    def _take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.active is None else tensor.index_select(0, self.active)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += the LoRA deltas of projection `group` for input x; returns out."""
        subs = self.slots.groups.get(group)
        if not subs:
            return out
        r, tokens = self.rank, x.shape[0]
        a = self._take(self.slots.a[(layer, group)])[:, :, :r]  # [S, M, r, in]
        num_slots = a.shape[0]
        xa = self.slots.sharding.reduce(group, x @ a.reshape(-1, a.shape[-1]).t())  # [T, S*M*r]
        xa = xa.view(tokens, num_slots, len(subs), r) * self.mask[:, :, None, None]
        for index, sub in enumerate(subs):
            b = self._take(self.slots.b[(layer, sub.name)])[:, :r]  # [S, r, out]
            delta = xa[:, :, index, :].reshape(tokens, num_slots * r) @ b.reshape(num_slots * r, sub.size)
            out[:, sub.start : sub.start + sub.size] += delta
        return out


@dataclass
class LayerLora:
    """What one decoder layer's projections see."""

    batch: LoraBatch
    index: int

    def apply(self, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.batch.apply(self.index, group, x, out)


def _column_starts(members: tuple[str, ...], shapes: ModuleShapes) -> dict[str, int]:
    starts, offset = {}, 0
    for name in members:
        starts[name] = offset
        offset += shapes.shapes[name][1]
    return starts
