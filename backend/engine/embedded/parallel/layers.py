"""The collectives of a sharded Llama-family model, added to its modules in place (no second model code).

Row-parallel projections (o_proj, down_proj) sum their partial outputs over the ranks (a forward hook); the
embedding looks up the rank's vocabulary rows and sums the ranks' lookups (ids outside the slice give zeros); the
output head's logits are gathered into the full vocabulary (a tied head shares the embedding's slice)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..network.layers import Embedding, GatedMLP
from ..network.llama import LlamaForCausalLM
from .group import ParallelGroup
from .sharding import ShardPlan


class VocabParallelEmbedding(Embedding):
    """Rows `start : start + weight.shape[0]` of the embedding; `forward` returns the full lookup on every rank."""

    def __init__(self, weight: nn.Parameter, start: int, group: ParallelGroup):
        super().__init__(*weight.shape)
        self.weight = weight
        self.start = start
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(rows.masked_fill(outside[:, None], 0.0))


def make_tensor_parallel(model: LlamaForCausalLM, plan: ShardPlan, group: ParallelGroup) -> None:
    def reduce_output(_module, _inputs, output):
        return group.all_reduce(output)

    for layer in model.decoder_layers:
        assert isinstance(layer.mlp, GatedMLP)  # mixtures of experts are refused under tensor parallelism
        layer.self_attn.o_proj.register_forward_hook(reduce_output)
        layer.mlp.down_proj.register_forward_hook(reduce_output)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, plan.vocab_start, group)
    local_logits = model.compute_logits

    def compute_logits(hidden: torch.Tensor, cast: bool = True) -> torch.Tensor:
        return group.gather_last_dim(local_logits(hidden, cast))

    model.compute_logits = compute_logits  # type: ignore[method-assign]  # this instance's head is split
