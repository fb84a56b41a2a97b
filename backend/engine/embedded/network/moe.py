"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama's attention (Qwen3-MoE with its q/k norms),
and in place of the MLP a sparse block: a softmax router picks top_k experts per token, each a gated SiLU MLP, and
their outputs are summed weighted by the router's probabilities (renormalised over the top k when the family
does). Qwen2-MoE adds a shared expert scaled by a sigmoid gate; Qwen's `mlp_only_layers` keep a dense MLP.

Expert weights are stacked as parameters [E, 2I, H] (gate rows then up rows) and [E, H, I]. The portable path
loops over the experts that got tokens and index_adds their weighted outputs, as transformers does; with fused
kernels on (layers.use_fused_kernels) the experts run as fused_moe's two grouped GEMMs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import GatedMLP, Linear
from .llama import LlamaDecoderLayer, LlamaForCausalLM, WeightSlot, attention_slots, mlp_slots
from .model_config import ModelConfig, MoeConfig


class SparseMoeBlock(nn.Module):
    fused = False  # see layers.use_fused_kernels

    def __init__(self, hidden_size: int, moe: MoeConfig):
        super().__init__()
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.renormalize, self.fp32_router_weights = moe.norm_topk_prob, moe.fp32_router_weights
        size = moe.expert_intermediate_size
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * size, hidden_size))
        self.experts_down = nn.Parameter(torch.empty(moe.num_experts, hidden_size, size))
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden_size, shared, bias=False) if shared else None
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """x: [T, hidden]. `lora` is accepted for the decoder layer's sake: LoRA on experts is refused at load."""
        weights, expert_ids = route(self.gate(x), self.top_k, self.renormalize)
        if not self.fp32_router_weights:
            weights = weights.to(x.dtype)
        if self.fused and x.dim() == 2:
            from . import fused_moe

            out = fused_moe.fused_experts(x, self.experts_gate_up, self.experts_down, weights, expert_ids)
        elif x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = experts_dense(x, self.experts_gate_up, self.experts_down, weights, expert_ids)
        else:
            out = experts_portable(x, self.experts_gate_up, self.experts_down, weights, expert_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (fp32 weights, expert ids), each [T, top_k]: the top-k softmax probabilities (computed in
    fp32), renormalised to sum to 1 if asked."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def experts_portable(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """What fused_moe.fused_experts computes, an expert at a time over the tokens routed to it (the experts in
    ascending order, as transformers adds them). Syncs with the host to learn which experts got tokens."""
    out = torch.zeros_like(x)
    for expert in torch.unique(expert_ids).tolist():
        token, slot = torch.nonzero(expert_ids == expert, as_tuple=True)
        result = _expert(x[token], w_gate_up[expert], w_down[expert]) * weights[token, slot, None]
        out.index_add_(0, token, result.to(out.dtype))
    return out


def experts_dense(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
) -> torch.Tensor:
    """experts_portable without host syncs or routing-dependent shapes (for CUDA graph capture without the fused
    kernels): every expert runs on every token, and a token's weight is zero where it did not pick the expert."""
    out = torch.zeros_like(x)
    for expert in range(w_gate_up.shape[0]):
        weight = (weights * (expert_ids == expert)).sum(dim=-1, keepdim=True)
        out += (_expert(x, w_gate_up[expert], w_down[expert]) * weight).to(out.dtype)
    return out


class MoeForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM with sparse blocks for MLPs on the layers the config names (MoeConfig.sparse_layers)."""

    def build_layer(self, config: ModelConfig, index: int) -> LlamaDecoderLayer:
        moe = config.moe
        if moe is None:
            raise ValueError(f"{config.architecture} has no mixture-of-experts settings")
        mlp = SparseMoeBlock(config.hidden_size, moe) if moe.sparse_layers[index] else None
        return LlamaDecoderLayer(config, mlp)

    def layer_slots(self, prefix: str, layer: LlamaDecoderLayer) -> dict[str, WeightSlot]:
        if not isinstance(layer.mlp, SparseMoeBlock):
            return super().layer_slots(prefix, layer)  # a dense layer (mlp_only_layers)
        return {
            prefix + "input_layernorm.weight": WeightSlot.whole(layer.input_layernorm.weight),
            **attention_slots(prefix, layer),
            **sparse_block_slots(prefix, layer.mlp, self.config.model_type),
        }


# Checkpoint names of an expert's gate, up and down projections, and of the block itself, per family.
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}
_BLOCK_NAMES = {"mixtral": "block_sparse_moe."}


def sparse_block_slots(prefix: str, block: SparseMoeBlock, model_type: str) -> dict[str, WeightSlot]:
    """Per-expert checkpoint tensors (as every published checkpoint holds them) into the stacked parameters."""
    gate_name, up_name, down_name = _EXPERT_NAMES.get(model_type, _EXPERT_NAMES["qwen2_moe"])
    block_prefix = prefix + _BLOCK_NAMES.get(model_type, "mlp.")
    size = block.experts_down.shape[2]
    slots = {block_prefix + "gate.weight": WeightSlot.whole(block.gate.weight)}
    for e in range(block.num_experts):
        expert = f"{block_prefix}experts.{e}."
        slots[expert + f"{gate_name}.weight"] = ExpertSlot(block.experts_gate_up, e, 0, size)
        slots[expert + f"{up_name}.weight"] = ExpertSlot(block.experts_gate_up, e, size, size)
        slots[expert + f"{down_name}.weight"] = ExpertSlot(block.experts_down, e, 0, block.experts_down.shape[1])
    if block.shared_expert is not None and block.shared_expert_gate is not None:
        slots.update(mlp_slots(block_prefix + "shared_expert.", block.shared_expert))
        slots[block_prefix + "shared_expert_gate.weight"] = WeightSlot.whole(block.shared_expert_gate.weight)
    return slots


class ExpertSlot(WeightSlot):
    """Rows `start : start + rows` of expert `expert` in a stacked [E, rows, cols] parameter."""

    def __init__(self, param: nn.Parameter, expert: int, start: int, rows: int):
        super().__init__(param, start, (rows, param.shape[2]))
        self.expert = expert

    def copy_(self, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self.param[self.expert].narrow(0, self.start, self.shape[0]).copy_(tensor)
