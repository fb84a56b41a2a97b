"""Keeps every rank's forward in step with rank 0's (SPMD), through the pipeline's stages.

Design: rank 0 alone owns requests, the scheduler and the block manager, and samples. Each step it cuts the batch
into micro-batches (one per stage: stages.py) and broadcasts a `StepPlan`: their model inputs on the host, as its
runner built them before uploading (token ids, positions, slot mapping and block tables, the rows that give logits,
the attention kernels' arrays: small integer arrays, cheap to pickle, from which each rank makes its own device
tensors in one copy, step_inputs.HostStep) and the blocks to zero. The other ranks keep no scheduler and no block
manager, so they hold no block state that could leak: their KV caches (of their stage's layers) are addressed by
rank 0's block ids, and aborts, preemption and prefix reuse free blocks in rank 0's block manager only, the one
place blocks live.

Every rank runs each micro-batch through its stage (the collectives of a stage's tensor ranks pair up); a stage
sends its output to the same tensor rank of the next stage without waiting, so it starts the next micro-batch while
the next stage runs this one. The last stage's first tensor rank sends the logits rows (and any context logits) to
rank 0, which samples. With one stage nothing is sent: rank 0 computes the logits itself and the other tensor
ranks drop theirs. `None` as the plan stops the followers."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..attention import AttentionMetadata
from ..model_runner import ModelRunner, StepOutput, computed_hidden
from ..scheduler import ScheduledBatch
from ..step_inputs import HostStep, StepInputs
from .group import ParallelGroup
from .stages import micro_batches, stage_forward

log = logging.getLogger("tritonllm.engine")


@dataclass
class MicroStep:
    host: HostStep  # the micro-batch's inputs on the host: each rank uploads its own
    context_indices: list[list[int]]  # per sequence that asked for context logits, its prompt rows in this step

    @classmethod
    def of(cls, inputs: StepInputs) -> "MicroStep":
        return cls(inputs.host, [indices for _, indices in inputs.context_requests])


# A micro-batch's model inputs on a rank's device: input ids, positions, attention metadata, logits rows.
DeviceInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]


@dataclass
class StepPlan:
    new_blocks: list[int]
    micro: list[MicroStep] = field(default_factory=list)
    # KV copies rank 0 made since its last step (a forked beam's block, accepted draft nodes moved down), in
    # order: ("block", source, target) or ("slots", sources, targets). Every rank makes them before the step.
    kv_copies: list[tuple] = field(default_factory=list)
    # LoRA: the adapters rank 0 put into slots for this step, (uid, adapter, slot) in order, whole (each rank keeps
    # its part); and each of the step's tokens' slot (-1: the base model), None without adapters.
    lora_loads: list[tuple] = field(default_factory=list)
    lora_slots: Optional[list[int]] = None


class StageRunner(ModelRunner):
    """What every rank does with a plan: its stage's forward of each micro-batch, sending on what the next stage
    (or rank 0) needs. Returns, on the rank that computes them for rank 0, each micro-batch's logits."""

    group: ParallelGroup

    @torch.inference_mode()
    def run_plan(
        self, plan: StepPlan, uploaded: Optional[list[DeviceInputs]] = None
    ) -> list[Optional[list[torch.Tensor]]]:
        """`uploaded`: the micro-batches' inputs already on this rank's device (rank 0's); else uploaded here."""
        if uploaded is None:
            uploaded = [step.host.upload(self.device, self.dtype, True, self.kernels, None) for step in plan.micro]
        # The last stage's features of each micro-batch, every token's (final hidden states, then any captured
        # layers' outputs): what Medusa heads and EAGLE drafts read on rank 0.
        self.stage_features: list[torch.Tensor] = []
        if self.group.rank != 0:  # rank 0 made them already, when its engine asked
            for kind, source, target in plan.kv_copies:
                copy = ModelRunner.copy_block if kind == "block" else ModelRunner.copy_slots
                copy(self, source, target)
        self.zero_blocks(plan.new_blocks)
        lora_views = self._plan_lora(plan, [inputs[0].shape[0] for inputs in uploaded])
        layout, sends = self.group.layout, []
        results: list[Optional[list[torch.Tensor]]] = []
        for step, (input_ids, positions, attn, logits_indices), lora in zip(
            plan.micro, uploaded, lora_views, strict=True
        ):
            received = None
            if not layout.is_first_stage:
                shape = (input_ids.shape[0], self.model.config.hidden_size)
                received = self.group.receive(shape, self.dtype, layout.previous_rank)
            out = stage_forward(
                self.model, layout, input_ids, positions, attn, self.kv_caches, received, lora, self._first_layer()
            )
            if not layout.is_last_stage:
                sends.append((self.group.send(out, layout.next_rank), out))
                results.append(None)
                continue
            out, features = self._split(out)
            self.stage_features.append(features)
            logits = [self.model.compute_logits(out[logits_indices]).float()]
            logits += [self.model.compute_logits(out[self._long(rows)]).float() for rows in step.context_indices]
            results.append(logits)
        if layout.is_last_stage and layout.pipeline > 1 and layout.tp_rank == 0:
            # To rank 0, which samples the whole step at once: sent after the last micro-batch, so that no send
            # of ours waits on rank 0 while rank 0's own sends of later micro-batches wait on our receives (with
            # NCCL, whose sends meet their receives in stream order, that would deadlock).
            sends += [(self.group.send(part, 0), part) for logits in results if logits for part in logits]
        for handle, _tensor in sends:
            self.group.wait(handle)
        return results

    def _first_layer(self) -> int:
        """The model's index of this stage's first layer (what LoRA slots are keyed by)."""
        return 0 if self.lora is None else self.group.layout.layers(self.lora.shapes.num_layers).start

    def _plan_lora(self, plan: StepPlan, micro_tokens: list[int]) -> list:
        """Each micro-batch's LoRA view on this rank (None: no adapter among its tokens); rank 0 loaded the
        adapters already, when it planned the step."""
        if plan.lora_slots is None:
            return [None] * len(micro_tokens)
        assert self.lora is not None, "rank 0 sent LoRA slots to a rank without LoRA"
        if self.group.rank != 0:
            for uid, adapter, slot in plan.lora_loads:
                self.lora.slots.load(uid, adapter, slot)
        views, start = [], 0
        for count in micro_tokens:  # micro-batches are consecutive runs of the step's tokens
            views.append(self.lora.slots.batch(plan.lora_slots[start : start + count], self.device))
            start += count
        return views


class LeaderRunner(StageRunner):
    """Rank 0's runner: plans each step, runs its own stage's share and samples from the logits it gets back."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kv_copies: list[tuple] = []

    def copy_block(self, source: int, target: int) -> None:
        super().copy_block(source, target)
        self._queue_copy(("block", source, target))

    def copy_slots(self, sources: list[int], targets: list[int]) -> None:
        super().copy_slots(sources, targets)
        self._queue_copy(("slots", list(sources), list(targets)))

    def _queue_copy(self, copy: tuple) -> None:
        self._kv_copies.append(copy)

    def _take_copies(self) -> list[tuple]:
        copies, self._kv_copies = self._kv_copies, []
        return copies

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, new_blocks: list[int], last_tokens: Optional[torch.Tensor] = None
    ) -> StepOutput:
        parts = [self.prepare(part) for part in micro_batches(batch, self.group.layout.pipeline)]
        plan = StepPlan(list(new_blocks), [MicroStep.of(inputs) for inputs in parts], self._take_copies())
        self._plan_adapters(batch, plan)
        self.group.broadcast_object(plan)
        uploaded = [(inputs.input_ids, inputs.positions, inputs.attn, inputs.logits_indices) for inputs in parts]
        if self.group.layout.pipeline > 1:
            self.run_plan(plan, uploaded)  # the first stage: its sends are on their way
            received = [self._receive_logits(inputs) for inputs in parts]
            return self._output(parts, received, None)  # features are on the last stage (Medusa, EAGLE refused)
        results = self.run_plan(plan, uploaded)
        (features,), (inputs,) = self.stage_features, parts  # one stage: one micro-batch
        out = self._output(parts, results, features[inputs.logits_indices])
        if self.keep_all_hidden:  # EAGLE
            out.all_hidden = computed_hidden(batch, inputs.attn.query_starts, features)
        return out

    def _plan_adapters(self, batch: ScheduledBatch, plan: StepPlan) -> None:
        """The step's adapter slots (loading adapters into them as on one rank), and the loads, into the plan."""
        if self.lora is None:
            return
        loads: list[tuple] = []
        self.lora.slots.on_load = lambda uid, adapter, slot: loads.append((uid, adapter, slot))
        view = self._lora_batch(batch)
        self.lora.slots.on_load = None
        if view is not None:
            plan.lora_loads, plan.lora_slots = loads, view.token_slots

    def _receive_logits(self, inputs: StepInputs) -> list[torch.Tensor]:
        vocab, source = self.model.config.vocab_size * self.group.tp_size, self.group.layout.logits_rank
        rows = [inputs.logits_indices.shape[0]] + [len(indices) for _, indices in inputs.context_requests]
        return [self.group.receive((count, vocab), torch.float32, source) for count in rows]

    @staticmethod
    def _output(parts: list[StepInputs], results, hidden: Optional[torch.Tensor]) -> StepOutput:
        logits: list[torch.Tensor] = []
        seqs, first_rows = [], []
        for inputs, result in zip(parts, results):
            offset = sum(part.shape[0] for part in logits)
            logits.append(result[0])
            seqs += inputs.sampling_seqs
            first_rows += [offset + row for row in inputs.first_rows]
            for (seq, _), context in zip(inputs.context_requests, result[1:]):
                seq.context_logits.append(context.cpu())
        rows = torch.cat(logits) if len(logits) > 1 else logits[0]
        return StepOutput(rows, rows.new_empty(rows.shape[0], 0) if hidden is None else hidden, seqs, first_rows)

    def stop_followers(self) -> None:
        self.group.broadcast_object(None)


class FollowerRunner(StageRunner):
    """A follower's runner: its stage's KV cache and model calls, driven by rank 0's plans."""

    def follow(self) -> int:
        """Run rank 0's steps until it stops; returns how many ran."""
        steps = 0
        while True:
            plan: Optional[StepPlan] = self.group.broadcast_object()
            if plan is None:
                log.info("parallel: rank %d stops after %d steps", self.group.rank, steps)
                return steps
            self.run_plan(on_device(plan, self.device))
            steps += 1


def on_device(value, device: torch.device):
    """`value` (a plan, its dataclasses and lists) with every tensor on `device`: an unpickled CUDA tensor comes
    back on the GPU index it left, rank 0's, not this rank's."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        moved = {f.name: on_device(getattr(value, f.name), device) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **moved)
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(item, device) for item in value)
    return value
