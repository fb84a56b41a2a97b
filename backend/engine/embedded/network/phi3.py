"""Phi-3 (Phi-3-mini, Phi-3.5-mini): the Llama decoder with its projections stored fused in the checkpoint.

Its layers compute what LlamaDecoderLayer computes (pre-norm, SiLU-gated MLP, no biases); what differs is the
checkpoint, whose `qkv_proj` (q, k, v rows) and `gate_up_proj` (gate, then up rows) are the fused parameters
LlamaAttention and GatedMLP already hold, and RoPE's longrope type (rope.py)."""

from __future__ import annotations

from .layers import GatedMLP
from .llama import LlamaDecoderLayer, LlamaForCausalLM, WeightSlot


class Phi3ForCausalLM(LlamaForCausalLM):
    def layer_slots(self, prefix: str, layer: LlamaDecoderLayer) -> dict[str, WeightSlot]:
        """Each of a Phi-3 layer's checkpoint tensors fills one parameter whole."""
        mlp = layer.mlp
        assert isinstance(mlp, GatedMLP)  # Phi-3 has no mixture of experts
        params = {
            "input_layernorm.weight": layer.input_layernorm.weight,
            "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            "self_attn.qkv_proj.weight": layer.self_attn.qkv_proj.weight,
            "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
            "mlp.gate_up_proj.weight": mlp.gate_up_proj.weight,
            "mlp.down_proj.weight": mlp.down_proj.weight,
        }
        return {prefix + name: WeightSlot.whole(param) for name, param in params.items()}
