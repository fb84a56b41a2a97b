"""The target's LM head as a drafter uses it (EAGLE's draft layer, Medusa heads sharing the base head): whole, or
only the rows of the drafter's vocabulary (our `draft_vocab` checkpoint extension), so each draft step's head
multiplies a fraction of the vocabulary. Drafts are only proposals: the target's own output never depends on
this."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..network.cpu_gemm import pack_weight, packed_linear


class DraftHead:
    """Scores over a draft vocabulary are normalised over it alone: they only rank drafts."""

    def __init__(self, target, vocab: Optional[torch.Tensor]):
        self.target, self.vocab = target, vocab
        self.weight: Optional[torch.Tensor] = None
        self.packed: Optional[torch.Tensor] = None
        if vocab is not None:
            self.weight = target.output_weight.detach().index_select(0, vocab.to(target.output_weight.device))
            self.packed = pack_weight(self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, vocab or draft vocab]."""
        if self.vocab is None:
            return self.target.compute_logits(hidden)
        if self.packed is not None:
            return packed_linear(hidden, self.packed, None).float()
        assert self.weight is not None  # cut from the target's head along with the vocabulary
        return F.linear(hidden, self.weight).float()

    def token_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Target token ids of `logits` columns."""
        return indices if self.vocab is None else self.vocab[indices]
