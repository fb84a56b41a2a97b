"""The host tier of the adapter cache: adapters by `lora_task_id`, least recently used evicted first.

An adapter pinned by a request in flight (waiting or running) is never evicted; when every cached adapter is pinned
and a new one does not fit, storing it fails (the request that brought it gets the error, nothing else changes).
Every stored adapter gets a fresh `uid`: the key of its device slot and of its prefix-cache blocks, so a task id
reused for other weights after an eviction can never hit the old adapter's blocks."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from .adapter import LoraAdapter

_UIDS = itertools.count(1)


class LoraCacheError(ValueError):
    """The request's adapter cannot be found or stored; the message names the task id."""


@dataclass(eq=False)
class CachedAdapter:
    task_id: int
    adapter: LoraAdapter
    uid: int
    name: Optional[str] = None
    pins: int = 0


class AdapterCache:
    def __init__(self, max_adapters: int, max_bytes: Optional[int] = None):
        self.max_adapters = max_adapters
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, CachedAdapter] = OrderedDict()  # least recently used first
        self.evicted: list[int] = []  # task ids, in eviction order (for logs and tests)

    def __contains__(self, task_id: int) -> bool:
        return task_id in self.entries

    @property
    def num_bytes(self) -> int:
        return sum(entry.adapter.num_bytes for entry in self.entries.values())

    def acquire(self, task_id: int, adapter: Optional[LoraAdapter], name: Optional[str] = None) -> CachedAdapter:
        """The cached adapter of `task_id` (storing `adapter` if it is not cached yet), pinned and marked most
        recently used. A cached id keeps its weights: an id names one adapter, as in TensorRT-LLM."""
        entry = self.entries.get(task_id)
        if entry is None:
            if adapter is None:
                raise LoraCacheError(
                    f"LoRA task {task_id} not found in cache. Please send LoRA weights with "
                    "request (lora_weights and lora_config)"
                )
            entry = self._store(task_id, adapter, name)
        self.entries.move_to_end(task_id)
        entry.pins += 1
        return entry

    def release(self, entry: CachedAdapter) -> None:
        entry.pins = max(0, entry.pins - 1)

    def _store(self, task_id: int, adapter: LoraAdapter, name: Optional[str]) -> CachedAdapter:
        if self.max_bytes is not None and adapter.num_bytes > self.max_bytes:
            raise LoraCacheError(
                f"LoRA task {task_id}: the adapter needs {adapter.num_bytes} bytes, more than the "
                f"whole host LoRA cache ({self.max_bytes} bytes, lora_cache_host_memory_bytes)"
            )
        while not self._fits(adapter):
            victim = next((e for e in self.entries.values() if e.pins == 0), None)
            if victim is None:
                raise LoraCacheError(
                    f"LoRA task {task_id} cannot be stored: the LoRA cache is full (max_cpu_loras="
                    f"{self.max_adapters}) and every cached adapter is in use by a request in flight; raise "
                    "lora_config.max_cpu_loras or retry when requests finish"
                )
            del self.entries[victim.task_id]
            self.evicted.append(victim.task_id)
        entry = CachedAdapter(task_id, adapter, next(_UIDS), name)
        self.entries[task_id] = entry
        return entry

    def _fits(self, adapter: LoraAdapter) -> bool:
        if len(self.entries) >= self.max_adapters:
            return False
        return self.max_bytes is None or self.num_bytes + adapter.num_bytes <= self.max_bytes
