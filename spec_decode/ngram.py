"""N-gram / prompt-lookup proposer: no extra weights. Find an earlier occurrence of the sequence's last k tokens
(k = max_matching_ngram_size down to 1) and propose the tokens that followed it, as a chain."""

from __future__ import annotations

from typing import Optional, Sequence

from .config import NGramConfig
from .proposer import ProposalInput, StatelessProposer, draft_budget
from .tree import DraftTree


def find_continuation(tokens: Sequence[int], max_ngram: int, num_draft: int, use_oldest: bool = True) -> list[int]:
    """Tokens that followed the longest suffix n-gram (length <= max_ngram) seen earlier in `tokens`.
    `use_oldest` picks the first earlier occurrence, else the most recent one."""
    length = len(tokens)
    if num_draft <= 0:
        return []
    for size in range(min(max_ngram, length - 1), 0, -1):
        start = _match_start(tokens, size, use_oldest)
        if start is not None:
            follow = start + size
            return list(tokens[follow : follow + num_draft])
    return []


def _match_start(tokens: Sequence[int], size: int, use_oldest: bool) -> Optional[int]:
    """Start of an earlier occurrence of the last `size` tokens, which must be followed by at least one token."""
    suffix = list(tokens[-size:])
    last_start = len(tokens) - size - 1  # an occurrence must end before the suffix itself does
    starts = range(0, last_start + 1) if use_oldest else range(last_start, -1, -1)
    first = suffix[0]
    for start in starts:
        if tokens[start] == first and list(tokens[start : start + size]) == suffix:
            return start
    return None


class NGramProposer(StatelessProposer):
    def __init__(self, config: NGramConfig):
        self.config = config

    def propose_one(self, item: ProposalInput) -> DraftTree:
        num_draft = draft_budget(self.config.max_draft_len, item)
        drafts = find_continuation(
            item.token_ids, self.config.max_matching_ngram_size, num_draft, self.config.is_use_oldest
        )
        return DraftTree.chain(drafts)
