"""Keeps every rank's forward in step with rank 0's (SPMD).

Design: rank 0 alone owns requests, the scheduler and the block manager, and samples. Each step it broadcasts a
`StepPlan`, the step's model inputs as its runner built them (token ids, positions, attention metadata with slot
mapping and block tables, the blocks to zero, the rows that give logits); followers keep no scheduler and no block
manager, so they hold no block state that could leak: their KV cache is addressed by rank 0's block ids, and
aborts, preemption and prefix reuse free blocks in rank 0's block manager only, the one place blocks live. A
follower runs each plan through the same model calls as rank 0 (so the collectives pair up) and drops the logits.
`None` as the plan stops the followers."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ..attention import AttentionMetadata
from ..model_runner import ModelRunner
from ..scheduler import ScheduledBatch
from ..step_inputs import StepInputs
from .group import TensorParallelGroup

log = logging.getLogger("tritonllm.engine")


@dataclass
class StepPlan:
    new_blocks: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    context_indices: list[list[int]]  # per sequence that asked for context logits, its prompt rows in this step


class LeaderRunner(ModelRunner):
    """Rank 0's runner: the usual one, publishing each step's inputs to the followers as it builds them."""

    group: TensorParallelGroup

    def zero_blocks(self, block_ids: list[int]) -> None:
        self._new_blocks = list(block_ids)  # execute zeroes a step's new blocks just before preparing its inputs
        super().zero_blocks(block_ids)

    def prepare(
        self, batch: ScheduledBatch, masks: bool = True, last_tokens: Optional[torch.Tensor] = None
    ) -> StepInputs:
        inputs = super().prepare(batch, masks, last_tokens)
        plan = StepPlan(
            self._new_blocks,
            inputs.input_ids,
            inputs.positions,
            inputs.attn,
            inputs.logits_indices,
            [indices for _, indices in inputs.context_requests],
        )
        self.group.broadcast_object(plan)
        return inputs

    def stop_followers(self) -> None:
        self.group.broadcast_object(None)


class FollowerRunner(ModelRunner):
    """A follower's runner: the same KV cache and model calls as rank 0's, driven by rank 0's plans."""

    group: TensorParallelGroup

    def follow(self) -> int:
        """Run rank 0's steps until it stops; returns how many ran."""
        steps = 0
        while True:
            plan: Optional[StepPlan] = self.group.broadcast_object()
            if plan is None:
                log.info("tensor parallel: rank %d stops after %d steps", self.group.rank, steps)
                return steps
            self.run_plan(plan)
            steps += 1

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> None:
        self.zero_blocks(plan.new_blocks)
        hidden = self.model(plan.input_ids, plan.positions, plan.attn, self.kv_caches, None)
        self.model.compute_logits(hidden[plan.logits_indices])
        for indices in plan.context_indices:
            self.model.compute_logits(hidden[self._long(indices)])
