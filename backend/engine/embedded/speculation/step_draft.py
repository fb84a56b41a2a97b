"""`StepDraft`: what a speculating sequence feeds after its root in one step (`Sequence.draft`). Apart from the
methods (methods.py) so that the sequence can name its type: it needs nothing of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from tritonllm.spec_decode.lookahead import LookaheadStep
from tritonllm.spec_decode.tree import DraftTree


@dataclass
class StepDraft:
    """What a speculating sequence feeds after its root this step: the draft tree's nodes, then (lookahead only)
    window tokens that are computed but never committed."""

    tree: DraftTree
    window: list[int] = field(default_factory=list)
    offsets: Optional[list[int]] = None  # root first; None: the tree's depths
    mask: Optional[torch.Tensor] = None  # [1 + T, 1 + T] over root, nodes and window; None: the tree's
    context: Optional[LookaheadStep] = None  # the method's own per-step state (lookahead's)
    pre_matched: int = 0  # external drafts: leading draft tokens already equal to committed outputs
    external: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tree) + len(self.window)

    @property
    def tokens(self) -> list[int]:
        return list(self.tree.tokens) + self.window

    @property
    def position_offsets(self) -> list[int]:
        return self.offsets if self.offsets is not None else self.tree.position_offsets()

    def truncated(self, max_tokens: int) -> Optional["StepDraft"]:
        """The draft cut to its first `max_tokens` tree nodes (a step short of token budget), or None where nothing
        would be left or it cannot be cut: lookahead's window and mask belong together, and an external draft is
        verified whole (a later step feeds it again)."""
        if max_tokens < 1 or self.window or self.mask is not None or self.offsets is not None or self.external:
            return None
        return replace(self, tree=self.tree.truncated(max_tokens))

    def attention_mask(self) -> Optional[torch.Tensor]:
        """None where causal attention is right (a chain without a window)."""
        if self.mask is not None:
            return self.mask
        return None if self.tree.is_chain else self.tree.attention_mask()
