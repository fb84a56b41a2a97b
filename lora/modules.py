"""The LoRA target modules of a Llama-family decoder, under their three names: Hugging Face's (PEFT
`target_modules`), TensorRT-LLM's (`lora_target_modules`) and TensorRT-LLM's numeric module id (`lora_config` rows).

TensorRT-LLM names a Llama MLP's activated branch `mlp_h_to_4h` (HF `gate_proj`) and the multiplied branch
`mlp_gate` (HF `up_proj`), as its own checkpoint converter and `hf_lora_convert.py` map them; we follow that map, so
tensors made by either converter mean the same thing here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


class LoraFormatError(ValueError):
    """An adapter (folder, tensors or request) that cannot be used; the message names the file, tensor or id."""


@dataclass(frozen=True)
class LoraModule:
    hf_name: str  # q_proj ...
    trtllm_name: str  # attn_q ...
    module_id: int  # TensorRT-LLM's LoraModuleType id
    group: str  # the fused projection of the embedded model that holds it: qkv, o, gate_up, down


MODULES = (
    LoraModule("q_proj", "attn_q", 1, "qkv"),
    LoraModule("k_proj", "attn_k", 2, "qkv"),
    LoraModule("v_proj", "attn_v", 3, "qkv"),
    LoraModule("o_proj", "attn_dense", 4, "o"),
    LoraModule("gate_proj", "mlp_h_to_4h", 5, "gate_up"),
    LoraModule("down_proj", "mlp_4h_to_h", 6, "down"),
    LoraModule("up_proj", "mlp_gate", 7, "gate_up"),
)
BY_HF_NAME = {m.hf_name: m for m in MODULES}
BY_TRTLLM_NAME = {m.trtllm_name: m for m in MODULES}
BY_ID = {m.module_id: m for m in MODULES}
# TensorRT-LLM module ids that exist but that this package cannot apply (fused qkv, cross attention, MoE).
UNSUPPORTED_IDS = {
    0: "attn_qkv (fused qkv adapters)",
    8: "cross_attn_qkv",
    9: "cross_attn_q",
    10: "cross_attn_k",
    11: "cross_attn_v",
    12: "cross_attn_dense",
    13: "moe_h_to_4h",
    14: "moe_4h_to_h",
    15: "moe_gate",
    16: "moe_router",
}
# Projections some checkpoints store fused (Phi-3's qkv_proj and gate_up_proj), so their PEFT adapters target them
# whole: the parts they stack, in row order. One such adapter is its parts' adapters sharing A, B split by rows.
FUSED_HF_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Sub-modules of each fused projection, in the order of the projection's output columns.
GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def module_named(name: str) -> LoraModule:
    """A module by its Hugging Face or TensorRT-LLM name."""
    module = BY_HF_NAME.get(name) or BY_TRTLLM_NAME.get(name)
    if module is None:
        known = sorted(BY_HF_NAME) + sorted(BY_TRTLLM_NAME)
        raise LoraFormatError(f"unknown LoRA target module {name!r}; known: {', '.join(known)}")
    return module


def module_with_id(module_id: int) -> LoraModule:
    module = BY_ID.get(module_id)
    if module is None:
        why = UNSUPPORTED_IDS.get(module_id, "unknown")
        raise LoraFormatError(
            f"lora_config module id {module_id} is not supported ({why}); supported ids: "
            + ", ".join(f"{m.module_id}={m.trtllm_name}" for m in MODULES)
        )
    return module


def target_modules(names: Iterable[str] | None) -> tuple[str, ...]:
    """HF names of the modules LoRA may target, in a fixed order; None or empty means all of them."""
    if not names:
        return tuple(m.hf_name for m in MODULES)
    wanted = {module_named(name).hf_name for name in names}
    return tuple(m.hf_name for m in MODULES if m.hf_name in wanted)


@dataclass(frozen=True)
class ModuleShapes:
    """(in_features, out_features) of every target module of one model."""

    shapes: dict[str, tuple[int, int]]
    num_layers: int

    @classmethod
    def of_model(cls, hidden: int, intermediate: int, q_size: int, kv_size: int, num_layers: int) -> "ModuleShapes":
        return cls(
            {
                "q_proj": (hidden, q_size),
                "k_proj": (hidden, kv_size),
                "v_proj": (hidden, kv_size),
                "o_proj": (q_size, hidden),
                "gate_proj": (hidden, intermediate),
                "up_proj": (hidden, intermediate),
                "down_proj": (intermediate, hidden),
            },
            num_layers,
        )

    @classmethod
    def of_config(cls, config) -> "ModuleShapes":
        """From the embedded engine's ModelConfig."""
        return cls.of_model(
            config.hidden_size, config.intermediate_size, config.q_size, config.kv_size, config.num_layers
        )
