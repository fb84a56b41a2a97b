"""Owns the model and its paged KV cache; turns a scheduled batch into flat tensors and returns next-token logits
for the sequences whose every known token is now computed."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import AttentionMetadata, build_decode_mask
from .block_manager import blocks_for
from .scheduler import ScheduledBatch
from .sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_seqs: list[Sequence]
    # Sequences that asked for context logits, with the flat indices of their prompt tokens in this step.
    context_requests: list[tuple[Sequence, list[int]]]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.lora = None  # tritonllm.lora.runtime.LoraRuntime when LoRA is enabled
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Blocks are zeroed when first handed out (see `zero_blocks`), so the cache can start uninitialised.
        self.kv_caches = [(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                          for _ in range(num_layers)]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, new_blocks: list[int]) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs the step; returns next-token logits for the sampling sequences (and stores context logits)."""
        self.zero_blocks(new_blocks)
        inputs = self.prepare(batch)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches, self._lora_batch(batch))
        logits = self.model.compute_logits(hidden[inputs.logits_indices]).float()
        for seq, indices in inputs.context_requests:
            seq.context_logits.append(self.model.compute_logits(hidden[self._long(indices)]).float().cpu())
        return logits, inputs.sampling_seqs

    def _lora_batch(self, batch: ScheduledBatch):
        """The step's multi-LoRA view (each sequence's tokens with its adapter), or None without adapters."""
        if self.lora is None:
            return None
        return self.lora.batch_for([(seq.lora, num) for seq, num in zip(batch.seqs, batch.num_new_tokens)])

    def zero_blocks(self, block_ids: list[int]) -> None:
        # Attention reads whole blocks (masking the tail), so a block must never hold NaN/Inf garbage.
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_fill_(0, index, 0)
            v_cache.index_fill_(0, index, 0)

    @torch.inference_mode()
    def copy_block(self, source: int, target: int) -> None:
        """Copy one KV block in every layer (a forked beam's partly filled last block)."""
        for k_cache, v_cache in self.kv_caches:
            k_cache[target].copy_(k_cache[source])
            v_cache[target].copy_(v_cache[source])

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        input_ids, positions, slots = [], [], []
        query_starts, context_lens, logits_indices, sampling_seqs, context_requests = [], [], [], [], []
        bs = self.block_size
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            query_starts.append(len(input_ids))
            input_ids += seq.tokens_between(start, end)
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            context_lens.append(end)
            prompt_end = min(end, len(seq.prompt_token_ids))
            if seq.params.return_context_logits and start < prompt_end:
                first = query_starts[-1]
                context_requests.append((seq, list(range(first, first + prompt_end - start))))
            if end == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sampling_seqs.append(seq)
        max_blocks = max(blocks_for(n, bs) for n in context_lens)
        tables = [seq.block_table[:max_blocks] + [0] * (max_blocks - len(seq.block_table[:max_blocks]))
                  for seq in batch.seqs]
        attn = AttentionMetadata(
            slot_mapping=self._long(slots), block_tables=self._long(tables), query_starts=query_starts,
            query_lens=list(batch.num_new_tokens), context_lens=context_lens, block_size=bs)
        if all(n == 1 for n in batch.num_new_tokens):
            attn.decode_mask = build_decode_mask(context_lens, bs, max_blocks, self.device)
        return StepInputs(self._long(input_ids), self._long(positions), attn, self._long(logits_indices),
                          sampling_seqs, context_requests)

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
