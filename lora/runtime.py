"""LoRA inside the embedded engine: turns a request's `LoRARequest` into a cached, pinned adapter and gives each
step its device slots. `prepare` runs on the caller's thread (parsing and checking weights there, so a bad adapter
fails its own request at once); `acquire`, `release` and `batch_for` run on the engine thread."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from .adapter import LoraAdapter
from .cache import AdapterCache, CachedAdapter, LoraCacheError
from .convert import load_adapter_folder
from .layers import WHOLE, DeviceSlots, LoraBatch, LoraSharding
from .lora_dir import NamedAdapter, adapters_in
from .modules import LoraFormatError, ModuleShapes
from .settings import LoraSettings
from .trtllm_format import adapter_from_tensors

log = logging.getLogger("tritonllm.lora")


class LoraRequestError(ValueError):
    """A request's adapter is unusable; the message names the id, name or tensor."""


@dataclass
class AdapterRef:
    """A checked LoRARequest: the task id, and the adapter itself when the request brought (or named) one."""

    task_id: int
    adapter: Optional[LoraAdapter] = None
    name: Optional[str] = None


class LoraRuntime:
    def __init__(
        self,
        settings: LoraSettings,
        shapes: ModuleShapes,
        dtype: torch.dtype,
        device: torch.device,
        sharding: LoraSharding = WHOLE,
    ):
        """`shapes`: the whole model's (adapters are checked against them); `sharding`: the part of each adapter
        this rank's slots hold (all of it on one rank)."""
        self.settings, self.shapes, self.dtype, self.device = settings, shapes, dtype, device
        self.cache = AdapterCache(settings.max_cpu_loras, settings.host_cache_bytes)
        self.slots = DeviceSlots(
            shapes, settings.lora_target_modules, settings.max_loras, settings.max_lora_rank, dtype, device, sharding
        )
        self.names: dict[str, NamedAdapter] = {}
        if settings.lora_dir:
            self.preload(settings.lora_dir)

    # -- preloading ---------------------------------------------------------------------------------------------

    def preload(self, folders: tuple[str, ...]) -> list[NamedAdapter]:
        """Adapters of the folders by name (lora_dir.py); each is checked now and cached while there is room."""
        named = adapters_in(folders)
        for item in named:
            if item.name in self.names or any(n.task_id == item.task_id for n in self.names.values()):
                raise LoraFormatError(
                    f"lora_dir: adapter '{item.name}' (task id {item.task_id}) clashes with another preloaded adapter"
                )
            adapter = self._checked(load_adapter_folder(item.path, self.shapes), f"lora_dir adapter '{item.name}'")
            if len(self.cache.entries) < self.cache.max_adapters:
                self.cache.release(self.cache.acquire(item.task_id, adapter, item.name))
            self.names[item.name] = item
            log.info("LoRA adapter '%s' preloaded as lora_task_id %d from %s", item.name, item.task_id, item.path)
        return named

    # -- caller thread ------------------------------------------------------------------------------------------

    def prepare(self, request) -> AdapterRef:
        """Check a LoRARequest; parse its tensors or load its folder when the adapter is not cached."""
        task_id, named = self._task_id(request)
        weights, config = request.lora_weights, request.lora_config
        if (weights is None) != (config is None):
            missing = "lora_config" if config is None else "lora_weights"
            raise LoraRequestError(
                f"lora_task_id {task_id}: {missing} is missing (lora_weights and lora_config go together)"
            )
        if weights is not None:
            if named is not None:
                raise LoraRequestError(
                    f"lora_task_id {task_id} is the preloaded adapter '{named.name}': send it "
                    "without lora_weights / lora_config, or use another id"
                )
            try:
                adapter = adapter_from_tensors(weights, config, self.shapes, source=f"lora_task_id {task_id}")
            except LoraFormatError as exc:
                raise LoraRequestError(str(exc)) from None
            return AdapterRef(task_id, self._checked(adapter, f"lora_task_id {task_id}"))
        path = request.lora_path or (named.path if named else "")
        if path and task_id not in self.cache:
            adapter = self._checked(load_adapter_folder(path, self.shapes), f"lora_task_id {task_id}")
            return AdapterRef(task_id, adapter, named.name if named else request.lora_name)
        return AdapterRef(task_id, None, named.name if named else None)

    def _task_id(self, request) -> tuple[int, Optional[NamedAdapter]]:
        named = self.names.get(request.lora_name) if request.lora_name else None
        task_id = request.lora_int_id
        if task_id is None:
            if named is None:
                if not request.lora_name:
                    raise LoraRequestError("a LoRA request needs lora_task_id or lora_name")
                if not request.lora_path:
                    known = ", ".join(sorted(self.names)) or "none"
                    raise LoraRequestError(f"unknown LoRA adapter name '{request.lora_name}' (preloaded: {known})")
                task_id = self._id_for_new_name(request.lora_name)
            else:
                task_id = named.task_id
        elif named is not None and named.task_id != task_id:
            raise LoraRequestError(f"lora_name '{named.name}' is task id {named.task_id}, not {task_id}")
        if not isinstance(task_id, int) or task_id < 0:
            raise LoraRequestError(f"lora_task_id must be an integer >= 0, got {task_id!r}")
        named = named or next((n for n in self.names.values() if n.task_id == task_id), None)
        return task_id, named

    def _id_for_new_name(self, name: str) -> int:
        """A stable id for an adapter given by name and path only (the LLM API's LoRARequest without an id)."""
        return (hash(name) & 0x7FFFFFFF) | (1 << 40)

    def _checked(self, adapter: LoraAdapter, what: str) -> LoraAdapter:
        try:
            adapter.check(self.shapes, self.settings.max_lora_rank, self.settings.lora_target_modules)
        except LoraFormatError as exc:
            raise LoraRequestError(f"{what}: {exc}") from None
        return adapter.to(self.dtype)

    # -- engine thread ------------------------------------------------------------------------------------------

    def acquire(self, ref: AdapterRef) -> CachedAdapter:
        adapter = ref.adapter
        named = next((n for n in self.names.values() if n.task_id == ref.task_id), None)
        if adapter is None and named is not None and ref.task_id not in self.cache:
            adapter = self._checked(load_adapter_folder(named.path, self.shapes), f"adapter '{named.name}'")
        try:
            return self.cache.acquire(ref.task_id, adapter, ref.name or (named.name if named else None))
        except LoraCacheError as exc:
            raise LoraRequestError(str(exc)) from None

    def release(self, entry: Optional[CachedAdapter]) -> None:
        if entry is not None:
            self.cache.release(entry)

    def batch_for(self, segments: list[tuple[Optional[CachedAdapter], int]]) -> Optional[LoraBatch]:
        """The step's LoRA view: (adapter or None for the base model, number of tokens) per scheduled sequence."""
        needed = {entry.uid: entry.adapter for entry, _ in segments if entry is not None}
        if not needed:
            return None
        slot_of = self.slots.assign(needed)
        token_slots: list[int] = []
        for entry, count in segments:
            token_slots += [-1 if entry is None else slot_of[entry.uid]] * count
        return self.slots.batch(token_slots, self.device)
