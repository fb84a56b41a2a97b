"""Owns the model and its paged KV cache; runs a scheduled batch (as flat inputs: step_inputs.py) and returns
next-token logits for the sequences whose every known token is now computed."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from .attention import attach_masks, zero_blocks
from .attention.fp8_cache import as_bytes
from .scheduler import ScheduledBatch
from .sequence import Sequence
from .step_inputs import StepInputs, step_inputs

if TYPE_CHECKING:
    from tritonllm.lora.runtime import LoraRuntime

    from .attention.triton_backend import TritonAttention
    from .cuda_graphs import DecodeGraphs
    from .network.llama import LlamaForCausalLM


@dataclass
class StepOutput:
    # [rows, vocab] in the LM head's dtype: one row per sampling sequence, 1 + draft tokens with a draft. A plain
    # greedy batch is sampled from these as they are; `logits` is their fp32 copy, made once, when first read.
    head_logits: torch.Tensor
    # [rows, hidden]: the final-norm hidden states of the same rows (for EAGLE-3: the target's captured layers)
    hidden: torch.Tensor
    seqs: list[Sequence]  # the sampling sequences
    first_rows: list[int]  # each one's first row
    # Only when the runner's `keep_all_hidden` is set (Eagle): for every scheduled sequence, the position of its
    # first computed token and the final-norm hidden states (EAGLE-3: captured layers) of its computed known tokens
    # (drafts left out).
    all_hidden: Optional[list[tuple[Sequence, int, torch.Tensor]]] = None

    @functools.cached_property
    def logits(self) -> torch.Tensor:
        """head_logits in fp32 (the same tensor when they are fp32): the rows the logit processors change in place."""
        return self.head_logits.float()

    def rows_of(self, index: int) -> slice:
        start = self.first_rows[index]
        return slice(start, start + 1 + self.seqs[index].num_draft_tokens)


def computed_hidden(
    batch: ScheduledBatch, query_starts: list[int], features: torch.Tensor
) -> list[tuple[Sequence, int, torch.Tensor]]:
    """StepOutput.all_hidden: each scheduled sequence, the position of its first computed token, and the features
    of its computed known tokens (drafts left out)."""
    return [
        (seq, seq.num_computed_tokens, features[start : start + num - seq.num_draft_tokens])
        for seq, num, start in zip(batch.seqs, batch.num_new_tokens, query_starts)
    ]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        cache_dtype: Optional[torch.dtype] = None,
    ):
        """`dtype`: the model's (activations, attention masks); `cache_dtype`: the KV cache's, `dtype` by default
        (float8_e4m3fn for an FP8 cache: attention/fp8_cache.py)."""
        self.model = model
        self.dtype = dtype
        self.block_size = block_size
        self.device = device
        self.lora: Optional[LoraRuntime] = None  # set when LoRA is enabled
        self.keep_all_hidden = False  # return every computed position's hidden state (StepOutput.all_hidden)
        self.graphs: Optional[DecodeGraphs] = None  # set when decode steps replay CUDA graphs
        self.kernels: Optional[TritonAttention] = None  # set with attn_backend TRITON; None: portable
        shape = (num_blocks, block_size, num_kv_heads, head_dim)

        # Blocks are zeroed when first handed out (see `zero_blocks`), so the cache can start uninitialised.
        def empty() -> torch.Tensor:
            return torch.empty(shape, dtype=cache_dtype or dtype, device=device)

        self.kv_caches = [(empty(), empty()) for _ in range(num_layers)]

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, new_blocks: list[int], last_tokens: Optional[torch.Tensor] = None
    ) -> StepOutput:
        """Runs the step; returns next-token logits for the sampling sequences (and stores context logits).
        `last_tokens`: the previous step's sampled tokens on the device, where sequences with a pending token
        (overlap scheduler) find their input at their `pending_row`."""
        self.zero_blocks(new_blocks)
        inputs = self.prepare(batch, masks=self.graphs is None, last_tokens=last_tokens)
        lora = self._lora_batch(batch)
        hidden = None
        if self.graphs is not None:  # a graph builds its own masks; an eager forward after all needs the step's
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.attn) if lora is None else None
            if hidden is None and self.kernels is None:
                attach_masks(inputs.attn, self.device, self.dtype)
        if hidden is None:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_caches, lora)
        hidden, features = self._split(hidden)
        logits = self.model.compute_logits(inputs.logits_rows(hidden), cast=False)
        for seq, indices in inputs.context_requests:
            seq.context_logits.append(self.model.compute_logits(hidden[self._long(indices)]).float().cpu())
        all_hidden = computed_hidden(batch, inputs.attn.query_starts, features) if self.keep_all_hidden else None
        return StepOutput(logits, inputs.logits_rows(features), inputs.sampling_seqs, inputs.first_rows, all_hidden)

    def _split(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final-norm hidden states, what drafters read): the same tensor, unless the model also returned the
        outputs of its `capture_layers` after them (EAGLE-3 drafts read those)."""
        width = self.model.config.hidden_size
        if hidden.shape[-1] == width:
            return hidden, hidden
        return hidden[:, :width], hidden[:, width:]

    def _lora_batch(self, batch: ScheduledBatch):
        """The step's multi-LoRA view (each sequence's tokens with its adapter), or None without adapters."""
        if self.lora is None:
            return None
        return self.lora.batch_for([(seq.lora, num) for seq, num in zip(batch.seqs, batch.num_new_tokens)])

    def zero_blocks(self, block_ids: list[int]) -> None:
        zero_blocks([cache for pair in self.kv_caches for cache in pair], block_ids)

    @torch.inference_mode()
    def copy_slots(self, sources: list[int], targets: list[int]) -> None:
        """Copy single token slots in every layer (accepted tree nodes moved down to consecutive positions)."""
        src, dst = self._long(sources), self._long(targets)
        for cache in (c for pair in self.kv_caches for c in pair):
            flat = as_bytes(cache).view(-1, *cache.shape[2:])  # FP8 caches as bytes: no float8 index_copy_ on CPU
            flat.index_copy_(0, dst, flat.index_select(0, src))

    @torch.inference_mode()
    def copy_block(self, source: int, target: int) -> None:
        """Copy one KV block in every layer (a forked beam's partly filled last block)."""
        for k_cache, v_cache in self.kv_caches:
            k_cache[target].copy_(k_cache[source])
            v_cache[target].copy_(v_cache[source])

    def prepare(
        self, batch: ScheduledBatch, masks: bool = True, last_tokens: Optional[torch.Tensor] = None
    ) -> StepInputs:
        """The step's flat inputs (step_inputs.py); `masks` False leaves the portable backend's attention masks
        out. A pending token's input comes from `last_tokens`."""
        return step_inputs(batch, self.block_size, self.device, self.dtype, masks, self.kernels, last_tokens)

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
