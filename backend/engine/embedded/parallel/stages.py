"""One pipeline stage's share of a forward, and a step's batch cut into micro-batches.

A stage runs its consecutive layers (layout.py) on the embedding of the step's tokens (the first stage) or on the
hidden states the stage before sent; it hands on the residual stream (the layer outputs' sum, one tensor) or, on
the last stage, the final norm's output, which gives logits. A single stage is the whole model: the same calls,
in the same order, as LlamaForCausalLM.forward.

Micro-batches let stages overlap: while stage 1 runs the first part of a step's sequences, stage 0 runs the second.
They are consecutive runs of the step's sequences, so their sampling rows, concatenated, are the whole step's in
its order."""

from __future__ import annotations

from typing import Optional

import torch

from ..attention import AttentionMetadata
from ..network.llama import KVCache, LlamaForCausalLM
from ..scheduler import ScheduledBatch
from .layout import ParallelLayout


@torch.inference_mode()
def stage_forward(
    model: LlamaForCausalLM,
    layout: ParallelLayout,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionMetadata,
    kv_caches: list[KVCache],
    received: Optional[torch.Tensor] = None,
    lora=None,
    first_layer: int = 0,
) -> torch.Tensor:
    """The stage's output for the step's tokens: the final-norm hidden states on the last stage (followed by the
    outputs of the model's `capture_layers`, as LlamaForCausalLM.forward returns them), else the residual
    stream after the stage's layers. `received`: the stage before's output (None on the first stage); `lora`: the
    step's multi-LoRA view (tritonllm.lora.layers.LoraBatch), whose layers the stage's are from `first_layer` on."""
    hidden = model.embed(input_ids) if layout.is_first_stage else received
    assert hidden is not None, "a stage after the first runs on the hidden states it received"
    residual = None
    rotations = model.layer_rotations(positions, hidden.dtype)
    captured = []
    for index, (layer, kv_cache, (cos, sin)) in enumerate(zip(model.decoder_layers, kv_caches, rotations)):
        view = None if lora is None else lora.layer(first_layer + index)
        hidden, residual = layer.deferred(hidden, residual, cos, sin, attn, kv_cache, view)
        if first_layer + index in model.capture_layers:  # EAGLE-3 (one stage): as LlamaForCausalLM.forward
            captured.append(residual + hidden)
    if not layout.is_last_stage:
        return hidden if residual is None else residual + hidden
    normed = model.norm(hidden) if residual is None else model.norm(hidden, residual=residual)[0]
    return torch.cat([normed] + captured, dim=-1) if captured else normed


def micro_batches(batch: ScheduledBatch, count: int) -> list[ScheduledBatch]:
    """`batch` as at most `count` consecutive runs of its sequences with about the same number of tokens each."""
    count = max(1, min(count, len(batch.seqs)))
    total = sum(batch.num_new_tokens)
    parts: list[ScheduledBatch] = []
    part, done = ScheduledBatch(), 0
    for index, (seq, num) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        part.add(seq, num)
        done += num
        left_seqs, left_parts = len(batch.seqs) - index - 1, count - len(parts) - 1
        # Close the part once it holds its share of the tokens, keeping a sequence for every part still to come.
        if left_parts and (done * count >= total * (len(parts) + 1) or left_seqs == left_parts):
            parts.append(part)
            part = ScheduledBatch()
    parts.append(part)
    return parts
