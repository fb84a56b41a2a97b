"""Gemma 2 and Gemma 3 (text) decoders over the paged KV cache: Llama's outer structure (llama.py) with Gemma's
layers. Embeddings scaled by sqrt(hidden) in the model's dtype; RMSNorms that scale by (1 + weight); a GeGLU MLP
(tanh-approximated GELU); four norms a layer (input, post-attention, pre- and post-feedforward); the attention
scale from `query_pre_attn_scalar`; sliding-window and global layers alternating (`layer_types`). Gemma 2 caps
attention logits (`attn_logit_softcapping`); Gemma 3 normalises q and k per head instead and gives its sliding
layers their own RoPE base. Both may cap the output logits (`final_logit_softcapping`)."""

from __future__ import annotations

from typing import Iterable, cast

import torch
from torch import nn

from ..attention import AttentionMetadata
from .layers import GatedMLP, OffsetRMSNorm, RotaryEmbedding
from .llama import KVCache, LlamaAttention, LlamaForCausalLM, WeightSlot, _whole
from .model_config import GemmaSettings, ModelConfig


def gemma_settings(config: ModelConfig) -> GemmaSettings:
    if config.gemma is None:
        raise ValueError(f"{config.architecture} is not a Gemma model")
    return config.gemma


class GemmaAttention(LlamaAttention):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        gemma = gemma_settings(config)
        self.scale = gemma.query_pre_attn_scalar**-0.5
        self.softcap = gemma.attn_logit_softcapping
        if config.qk_norm:  # Gemma 3's per-head norms scale by (1 + weight) too
            self.q_norm = OffsetRMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = OffsetRMSNorm(config.head_dim, config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    """x + post_ff(mlp(pre_ff(h))) where h = x + post_attn(attn(input_norm(x)))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config)
        self.post_attention_layernorm = OffsetRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden, eps)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.mlp_bias, config.hidden_act)
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden, eps)

    def forward(self, hidden, cos, sin, attn: AttentionMetadata, kv_cache: KVCache, lora=None) -> torch.Tensor:
        mlp_out, residual = self.deferred(hidden, None, cos, sin, attn, kv_cache, lora)
        return residual + mlp_out

    def deferred(self, delta, residual, cos, sin, attn: AttentionMetadata, kv_cache: KVCache, lora=None):
        """As LlamaDecoderLayer.deferred: (the normed MLP output, input + the normed attention output)."""
        if residual is None:
            normed, residual = self.input_layernorm(delta), delta
        else:
            normed, residual = self.input_layernorm(delta, residual=residual)
        attended = self.post_attention_layernorm(self.self_attn(normed, cos, sin, attn, kv_cache, lora))
        normed, residual = self.pre_feedforward_layernorm(attended, residual=residual)
        return self.post_feedforward_layernorm(self.mlp(normed, lora)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    norm_class = OffsetRMSNorm

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        gemma = gemma_settings(config)
        # Gemma 3's sliding layers rotate with their own base (rope_local_base_freq); Gemma 2 has one RoPE.
        self.local_rotary_emb = None if gemma.local_rope is None else RotaryEmbedding(gemma.local_rope, config.head_dim)
        self.local_layers = tuple(kind == "sliding_attention" for kind in config.layer_types)
        self.final_softcap = gemma.final_logit_softcapping

    def build_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return GemmaDecoderLayer(config)

    @property
    def gemma_layers(self) -> Iterable[GemmaDecoderLayer]:
        return cast(Iterable[GemmaDecoderLayer], self.layers)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers rounds sqrt(hidden) to the model's dtype before it multiplies.
        return hidden * float(torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype))

    def layer_rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rotations = self.rotary_emb(positions, dtype)
        local = rotations if self.local_rotary_emb is None else self.local_rotary_emb(positions, dtype)
        return [local if sliding else rotations for sliding in self.local_layers]

    def compute_logits(self, hidden: torch.Tensor, cast: bool = True) -> torch.Tensor:
        """LlamaForCausalLM's logits, capped at cap * tanh(logits / cap) (in fp32) where the model caps them (fp32
        whatever `cast` says)."""
        logits = super().compute_logits(hidden)
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def checkpoint_slots(self) -> dict[str, WeightSlot]:
        slots = super().checkpoint_slots()
        for i, layer in enumerate(self.gemma_layers):
            prefix = f"model.layers.{i}."
            slots[prefix + "pre_feedforward_layernorm.weight"] = _whole(layer.pre_feedforward_layernorm.weight)
            slots[prefix + "post_feedforward_layernorm.weight"] = _whole(layer.post_feedforward_layernorm.weight)
        return slots
