"""Phi-3 (Phi-3-mini, Phi-3.5-mini): the Llama decoder with its projections stored fused in the checkpoint.

Its layers compute what LlamaDecoderLayer computes (pre-norm, SiLU-gated MLP, no biases); what differs is the
checkpoint, whose `qkv_proj` (q, k, v rows) and `gate_up_proj` (gate, then up rows) are the fused parameters
LlamaAttention and GatedMLP already hold, and RoPE's longrope type (rope.py)."""

from __future__ import annotations

from torch import nn

from .llama import LlamaDecoderLayer, LlamaForCausalLM, WeightSlot


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_slots(self) -> dict[str, WeightSlot]:
        slots = {
            "model.embed_tokens.weight": _whole(self.embed_tokens.weight),
            "model.norm.weight": _whole(self.norm.weight),
        }
        if self.lm_head is not None:
            slots["lm_head.weight"] = _whole(self.lm_head.weight)
        for i, layer in enumerate(self.decoder_layers):
            slots.update(phi3_layer_slots(f"model.layers.{i}.", layer))
        return slots


def phi3_layer_slots(prefix: str, layer: LlamaDecoderLayer) -> dict[str, WeightSlot]:
    """Each of a Phi-3 layer's checkpoint tensors fills one parameter whole."""
    params = {
        "input_layernorm.weight": layer.input_layernorm.weight,
        "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "self_attn.qkv_proj.weight": layer.self_attn.qkv_proj.weight,
        "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
        "mlp.gate_up_proj.weight": layer.mlp.gate_up_proj.weight,
        "mlp.down_proj.weight": layer.mlp.down_proj.weight,
    }
    return {prefix + name: _whole(param) for name, param in params.items()}


def _whole(param: nn.Parameter) -> WeightSlot:
    return WeightSlot(param, 0, tuple(param.shape))
