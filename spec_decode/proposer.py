"""The one proposer interface every speculative method implements.

Each step the engine hands a proposer one `ProposalInput` per running sequence (its token history, ending with
the last committed token, and for model-based methods the target's final-norm hidden state at the last computed
position) and gets back one `DraftTree` per sequence (a chain is a tree whose parents are -1, 0, 1, ...; an empty
tree means "no draft this step"). Verification (`acceptance.py`) is the same whatever proposed the tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from .tree import DraftTree


@dataclass
class ProposalInput:
    seq_id: int
    token_ids: Sequence[int]  # prompt + output so far; the last one is the tree's root
    hidden_state: Optional[torch.Tensor] = None  # [hidden]: the target's state that predicted the last token
    max_draft_tokens: Optional[int] = None  # fewer than the method's maximum, e.g. near max_tokens


class Proposer(Protocol):
    def propose(self, batch: Sequence[ProposalInput]) -> list[DraftTree]:
        """One tree per input, in order."""

    def release(self, seq_id: int) -> None:
        """Forget a finished or preempted sequence's state (pools, windows, draft KV)."""


class StatelessProposer:
    """Base for proposers that keep nothing between steps; `propose` maps `propose_one` over the batch."""

    def propose(self, batch: Sequence[ProposalInput]) -> list[DraftTree]:
        return [self.propose_one(item) for item in batch]

    def propose_one(self, item: ProposalInput) -> DraftTree:
        raise NotImplementedError

    def release(self, seq_id: int) -> None:
        pass


def draft_budget(limit: int, item: ProposalInput) -> int:
    """The draft length allowed for this input: the method's limit, capped by the engine's request."""
    return limit if item.max_draft_tokens is None else max(0, min(limit, item.max_draft_tokens))
