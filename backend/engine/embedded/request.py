"""One request inside the engine core: its live sequences (several for a beam search) and what they share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from ..types import SamplingParams
from .beam_search import BeamSearch
from .sequence import Sequence

if TYPE_CHECKING:
    from tritonllm.lora.cache import CachedAdapter


@dataclass(eq=False)
class EngineRequest:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)  # the live beams, for a beam search
    beam: Optional[BeamSearch] = None
    # Beam search: next-token logits of live beams that are computed, until every live beam is.
    beam_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    lora: Optional[CachedAdapter] = None  # the pinned adapter, if any

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the common case, asked for every token
            return seqs[0].is_finished
        return all(seq.is_finished for seq in seqs)
