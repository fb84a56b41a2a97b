"""A scheduled batch as the model's flat inputs: token ids, positions, KV slots, which rows give logits, and the
attention metadata, built on the host in plain lists and sent to the device in one copy (host_arrays.py).

A sequence with a speculative draft (`seq.draft`) also feeds the draft's tokens after its last known token (the
root): draft token i goes to the KV slot of position root + 1 + i and is rotated for position root + its offset,
and logits come back for the root and every draft token. A sequence whose last token was sampled on the device and
not yet read by the host (overlap scheduler) gets it there, from the last step's tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .attention import AttentionMetadata, add_step_arrays, metadata_from
from .host_arrays import HostArrays
from .scheduler import ScheduledBatch
from .sequence import Sequence


@dataclass
class HostStep:
    """A step's inputs on the host, before their upload: small integer arrays and per-sequence lists, cheap to
    pickle. A parallel run's rank 0 sends these in its plan and every rank uploads its own (parallel/step_sync.py)."""

    arrays: HostArrays
    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    tail_masks: list[Optional[torch.Tensor]]
    has_pending: bool  # some input token is still on the device (the overlap scheduler's last step)
    # every row's token is pending, row i's at row i of the last step's tokens (a steady decode batch)
    pending_in_order: bool = False

    def upload(
        self, device: torch.device, dtype: torch.dtype, masks: bool, kernels, last_tokens: Optional[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input_ids, positions, attention metadata, logits_indices) on `device`, in one copy; pending tokens are
        then copied in from `last_tokens` on the device."""
        arrays = self.arrays.upload(device)
        input_ids = arrays["input_ids"]
        if self.has_pending:
            assert last_tokens is not None  # pending tokens are the last step's, which the overlap step hands over
            if self.pending_in_order:  # read where they are: two launches fewer a decode step
                input_ids = last_tokens[: input_ids.shape[0]]
            else:
                pending = last_tokens.index_select(0, arrays["pending_sources"])
                input_ids.index_copy_(0, arrays["pending_rows"], pending)
        attn = metadata_from(
            arrays,
            self.query_starts,
            self.query_lens,
            self.context_lens,
            self.block_size,
            self.tail_masks,
            device,
            dtype,
            masks,
            kernels,
        )
        return input_ids, arrays["positions"], attn, arrays["logits_indices"]


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_seqs: list[Sequence]
    # Sequences that asked for context logits, with the flat indices of their prompt tokens in this step.
    context_requests: list[tuple[Sequence, list[int]]]
    first_rows: list[int]  # each sampling sequence's first row among the logits rows
    host: HostStep  # what these were uploaded from
    every_row_samples: bool = False  # logits_indices are all the step's rows in order (a plain decode step)

    def logits_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The logits rows of a [T, ...] tensor of the step's rows: the tensor itself where every row samples (a
        gather fewer, ~5 us of a decode step on a GPU), else a gathered copy."""
        return rows if self.every_row_samples else rows[self.logits_indices]


class StepBuilder:
    """Collects one step's per-token lists, sequence by sequence; `build` uploads them."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        # rows whose token is still on the device, and its row among the last step's sampled tokens
        self.pending_rows: list[int] = []
        self.pending_sources: list[int] = []
        self.query_starts: list[int] = []
        self.context_lens: list[int] = []
        self.tail_masks: list[Optional[torch.Tensor]] = []
        self.logits_indices: list[int] = []
        self.first_rows: list[int] = []
        self.sampling_seqs: list[Sequence] = []
        self.context_requests: list[tuple[Sequence, list[int]]] = []

    def add(self, seq: Sequence, num_new: int) -> None:
        if num_new == 1 and seq.draft is None and not seq.params.return_context_logits:
            self._add_one(seq)
        else:
            self._add_many(seq, num_new)

    def _add_one(self, seq: Sequence) -> None:
        """A decode, or the last token of a prompt: the common case, kept short."""
        position = seq.num_computed_tokens
        self.query_starts.append(len(self.input_ids))
        self._add_token(seq, position)
        self.positions.append(position)
        table, bs = seq.block_table, self.block_size
        self.slots.append(table[position // bs] * bs + position % bs)
        self.context_lens.append(position + 1)
        self.tail_masks.append(None)
        if position + 1 == seq.num_tokens:
            self._sample_rows(seq, 1)

    def _add_token(self, seq: Sequence, position: int) -> None:
        prompt_len = len(seq.prompt_token_ids)
        if position < prompt_len:
            self.input_ids.append(seq.prompt_token_ids[position])
        elif position - prompt_len < len(seq.output_token_ids):
            self.input_ids.append(seq.output_token_ids[position - prompt_len])
        else:  # sampled last step, still on the device
            self.pending_rows.append(len(self.input_ids))
            self.pending_sources.append(seq.pending_row)
            self.input_ids.append(0)

    def _add_many(self, seq: Sequence, num_new: int) -> None:
        """Prompt chunks, drafts, context logits."""
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        known_end = end - seq.num_draft_tokens
        first = len(self.input_ids)
        self.query_starts.append(first)
        self.input_ids += seq.tokens_between(start, min(known_end, seq.num_known_tokens))
        if known_end > seq.num_known_tokens:
            self._add_token(seq, known_end - 1)
        self.positions += range(start, known_end)
        if seq.draft is not None:  # after the root (position known_end - 1), in slots known_end .. end - 1
            self.input_ids += seq.draft.tokens
            self.positions += [known_end - 1 + offset for offset in seq.draft.position_offsets[1:]]
        table, bs = seq.block_table, self.block_size
        self.slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        self.context_lens.append(end)
        self.tail_masks.append(None if seq.draft is None else seq.draft.attention_mask())
        prompt_end = min(end, len(seq.prompt_token_ids))
        if seq.params.return_context_logits and start < prompt_end:
            self.context_requests.append((seq, list(range(first, first + prompt_end - start))))
        if known_end == seq.num_tokens:
            self._sample_rows(seq, 1 + seq.num_draft_tokens)

    def _sample_rows(self, seq: Sequence, rows: int) -> None:
        """The sequence's last `rows` flat rows give logits (its root and draft)."""
        self.first_rows.append(len(self.logits_indices))
        end = len(self.input_ids)
        self.logits_indices += range(end - rows, end)
        self.sampling_seqs.append(seq)

    def host_step(self, batch: ScheduledBatch, kernels) -> HostStep:
        """The step's arrays and lists, on the host."""
        host = HostArrays()
        for name in ("input_ids", "positions", "logits_indices", "pending_rows", "pending_sources"):
            host.add(name, getattr(self, name))
        query_lens = list(batch.num_new_tokens)
        add_step_arrays(
            host,
            self.slots,
            [seq.block_table for seq in batch.seqs],
            self.query_starts,
            query_lens,
            self.context_lens,
            self.block_size,
            self.tail_masks,
            kernels,
        )
        return HostStep(
            host,
            self.query_starts,
            query_lens,
            self.context_lens,
            self.block_size,
            self.tail_masks,
            bool(self.pending_rows),
            _in_order(self.pending_rows, len(self.input_ids)) and self.pending_sources == self.pending_rows,
        )

    def build(
        self,
        batch: ScheduledBatch,
        device: torch.device,
        dtype: torch.dtype,
        masks: bool,
        kernels,
        last_tokens: Optional[torch.Tensor],
    ) -> StepInputs:
        """Upload everything in one copy (HostStep.upload)."""
        host = self.host_step(batch, kernels)
        input_ids, positions, attn, logits_indices = host.upload(device, dtype, masks, kernels, last_tokens)
        return StepInputs(
            input_ids,
            positions,
            attn,
            logits_indices,
            self.sampling_seqs,
            self.context_requests,
            self.first_rows,
            host,
            _in_order(self.logits_indices, len(self.input_ids)),
        )


def _in_order(rows: list[int], count: int) -> bool:
    """rows are 0 .. count - 1 in order (the length compared first: a prompt's rows differ at once)."""
    return len(rows) == count and rows == list(range(count))


def step_inputs(
    batch: ScheduledBatch,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    masks: bool,
    kernels=None,
    last_tokens: Optional[torch.Tensor] = None,
) -> StepInputs:
    builder = StepBuilder(block_size)
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        builder.add(seq, num_new)
    return builder.build(batch, device, dtype, masks, kernels, last_tokens)
