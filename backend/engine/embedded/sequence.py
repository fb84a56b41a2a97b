"""Per-sample state of a request inside the embedded engine.

One request with `n` samples becomes `n` sequences. A sequence's KV cache catches up with its tokens: each step
computes `num_tokens - num_computed_tokens` tokens (or a budget-limited chunk of them), and a new token is sampled
only once every known token has been computed. Preemption resets `num_computed_tokens` to 0 (recompute)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from ..types import RequestPerfMetrics, SamplingParams

if TYPE_CHECKING:
    from tritonllm.lora.cache import CachedAdapter

    from .speculation.step_draft import StepDraft


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: int
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: Optional[torch.Generator] = None
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chain hashes of the leading blocks that are full of computed tokens (prefix reuse).
    block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | list[int]] = None
    metrics: RequestPerfMetrics = field(default_factory=RequestPerfMetrics)
    # Raw logits kept for the client: one [n, vocab] chunk per prefill step, one [vocab] row per sampled token.
    context_logits: list[torch.Tensor] = field(default_factory=list)
    generation_logits: list[torch.Tensor] = field(default_factory=list)
    # Tokens delivered to the client so far (streaming sends the rest).
    num_delivered_tokens: int = 0
    # The LoRA adapter it runs with, None for the base model.
    lora: Optional[CachedAdapter] = None
    # This step's speculative draft: fed after the last token, never counted as known tokens; the tokens the target
    # accepts are appended to the output like sampled ones.
    draft: Optional[StepDraft] = None
    # Overlap scheduler: tokens sampled on the device whose values the host has not read yet (counted in
    # num_tokens), this sequence's row among the last step's sampled tokens, and whether that token is its last.
    pending_tokens: int = 0
    pending_row: int = -1
    final_pending: bool = False

    def __post_init__(self) -> None:
        self.metrics.arrival_time_ns = self.metrics.arrival_time_ns or time.time_ns()  # a fork keeps its parent's

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host holds (all but the pending ones)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_draft_tokens(self) -> int:
        """Query tokens this step's draft adds after the known tokens."""
        return 0 if self.draft is None else self.draft.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold (prompt plus its full output)."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def adapter_key(self) -> Optional[int]:
        """The LoRA adapter's cache uid (unique per stored adapter), None for the base model."""
        return None if self.lora is None else self.lora.uid

    @property
    def priority(self) -> float:
        return 0.5 if self.params.priority is None else self.params.priority

    @property
    def cache_key(self):
        """What besides the tokens decides a block's contents (the LoRA adapter); part of its hash."""
        return self.adapter_key

    def tokens_between(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def finish(self, reason: str, stop_reason=None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
