"""`lora_config` of model.yaml (TensorRT-LLM's `LoraConfig` keys), parsed once into a typed, validated object.

enable_lora: true
lora_config:
  max_lora_rank: 64          # adapters of a higher rank are refused
  max_loras: 4               # device tier: adapters resident for the running batch (distinct per step)
  max_cpu_loras: 4           # host tier: adapters kept by lora_task_id, least recently used evicted first
  lora_dir: [/path/adapters] # adapter folders, or folders of adapter folders, preloaded by folder name
  lora_target_modules: [attn_q, attn_k, attn_v, attn_dense, mlp_h_to_4h, mlp_4h_to_h, mlp_gate]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from .modules import LoraFormatError, target_modules


class LoraSettingsError(ValueError):
    """A bad `lora_config` value; the message names the key."""


@dataclass(frozen=True)
class LoraSettings:
    max_lora_rank: int = 64
    max_loras: int = 4
    max_cpu_loras: int = 4
    lora_dir: tuple[str, ...] = ()
    lora_target_modules: tuple[str, ...] = field(default_factory=lambda: target_modules(None))  # HF names
    host_cache_bytes: Optional[int] = None  # config.pbtxt lora_cache_host_memory_bytes: a byte cap on the host tier
    lora_ckpt_source: str = "hf"

    @classmethod
    def from_dict(cls, raw: Optional[dict[str, Any]]) -> "LoraSettings":
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)} | {"trtllm_modules_to_hf_modules"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise LoraSettingsError(f"lora_config: unknown key(s) {unknown}; known: {sorted(known)}")
        raw.pop("trtllm_modules_to_hf_modules", None)  # our map is fixed (modules.py); TensorRT-LLM's default
        lora_dir = raw.get("lora_dir") or ()
        raw["lora_dir"] = (lora_dir,) if isinstance(lora_dir, str) else tuple(str(d) for d in lora_dir)
        try:
            raw["lora_target_modules"] = target_modules(raw.get("lora_target_modules"))
        except LoraFormatError as exc:
            raise LoraSettingsError(f"lora_config.lora_target_modules: {exc}") from None
        settings = cls(**raw)
        settings.validate()
        return settings

    def validate(self) -> None:
        for name in ("max_lora_rank", "max_loras", "max_cpu_loras"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LoraSettingsError(f"lora_config.{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise LoraSettingsError(
                f"lora_config.max_cpu_loras={self.max_cpu_loras} must be >= max_loras="
                f"{self.max_loras} (every adapter on the device is also kept on the host)"
            )
        if self.host_cache_bytes is not None and self.host_cache_bytes < 1:
            raise LoraSettingsError(f"lora host cache bytes must be >= 1, got {self.host_cache_bytes}")
        if self.lora_ckpt_source != "hf":
            raise LoraSettingsError(
                f"lora_config.lora_ckpt_source={self.lora_ckpt_source!r}: only 'hf' (PEFT folders) is supported"
            )
