"""The speculative methods as the engine drives them: each turns the running decode sequences into this step's
`StepDraft`s (or None), and may look at the verified rows afterwards (lookahead's Jacobi window does).

Built on tritonllm.spec_decode: n-gram, Medusa and the draft model are plain `Proposer`s (their trees are wrapped
as they are); lookahead adds its window tokens to the draft; external draft tokens come with the request. build.py
picks the method for a speculative config."""

from __future__ import annotations

from typing import Optional, Protocol
from typing import Sequence as Seq

import torch

from tritonllm.spec_decode.config import LookaheadConfig
from tritonllm.spec_decode.lookahead import LookaheadDecoder, LookaheadState, NGramPool
from tritonllm.spec_decode.proposer import ProposalInput
from tritonllm.spec_decode.tree import DraftTree

from ..sequence import Sequence
from .step_draft import StepDraft


class SpeculativeMethod(Protocol):
    """What the Speculator drives: ProposerMethod, LookaheadMethod, eagle_proposer.EagleMethod."""

    needs_hidden: bool  # Medusa: drafts from the hidden state that produced the newest token
    needs_all_hidden: bool  # Eagle: sees the hidden state of every computed position (observe_hidden)

    def drafts(self, items: Seq[ProposalInput], seqs: Seq[Sequence]) -> list[Optional[StepDraft]]: ...

    def after_verify(self, seq: Sequence, draft: StepDraft, argmax: list[int], num_committed: int) -> None: ...

    def retain(self, seq_ids: set[int]) -> None: ...

    def observe_hidden(self, seq: Sequence, position: int, hidden: torch.Tensor) -> None: ...

    def release(self, seq_id: int) -> None: ...


class ProposerMethod:
    """A spec_decode `Proposer` (n-gram, Medusa, draft model): its trees become the drafts."""

    needs_hidden = False
    needs_all_hidden = False

    def __init__(self, proposer, needs_hidden: bool = False):
        self.proposer = proposer
        self.needs_hidden = needs_hidden

    def drafts(self, items: Seq[ProposalInput], seqs: Seq[Sequence]) -> list[Optional[StepDraft]]:
        trees = self.proposer.propose(items) if items else []
        return [StepDraft(tree) if len(tree) else None for tree in trees]

    def after_verify(self, seq: Sequence, draft: StepDraft, argmax: list[int], num_committed: int) -> None:
        pass

    def retain(self, seq_ids: set[int]) -> None:
        pass  # called only with needs_all_hidden

    def observe_hidden(self, seq: Sequence, position: int, hidden: torch.Tensor) -> None:
        pass  # called only with needs_all_hidden

    def release(self, seq_id: int) -> None:
        self.proposer.release(seq_id)


class LookaheadMethod:
    """Lookahead decoding per sequence: the pool's candidates for the root are the tree, the Jacobi window rides
    along in the same forward (its rows only feed the window and the pool)."""

    needs_hidden = False
    needs_all_hidden = False

    def __init__(self, config: LookaheadConfig):
        self.config = config
        self.decoders: dict[LookaheadConfig, LookaheadDecoder] = {}  # one per (W, N, G) in use
        self.states: dict[int, tuple[LookaheadDecoder, LookaheadState]] = {}  # seq id -> (its decoder, its state)

    def drafts(self, items: Seq[ProposalInput], seqs: Seq[Sequence]) -> list[Optional[StepDraft]]:
        return [self._draft(item, seq.params.lookahead_config or self.config) for item, seq in zip(items, seqs)]

    def _decoder(self, config: LookaheadConfig) -> LookaheadDecoder:
        if config not in self.decoders:
            self.decoders[config] = LookaheadDecoder(config)
        return self.decoders[config]

    def _draft(self, item: ProposalInput, config: LookaheadConfig) -> Optional[StepDraft]:
        history = list(item.token_ids)
        if item.seq_id in self.states:
            decoder, state = self.states[item.seq_id]
            decoder.observe(state, history)
        else:
            decoder = self._decoder(config)
            state = decoder.new_state(history)
            self.states[item.seq_id] = (decoder, state)
        step = decoder.build_step(
            state, history[-1], item.max_draft_tokens, before=history[-1 - NGramPool.CONTEXT : -1]
        )
        if len(step.tokens) - 1 > (item.max_draft_tokens or 0) + 1:  # the window would pass the KV reservation
            return None
        nodes = len(step.tree)
        return StepDraft(step.tree, step.tokens[1 + nodes :], step.position_offsets, step.mask, context=step)

    def after_verify(self, seq: Sequence, draft: StepDraft, argmax: list[int], num_committed: int) -> None:
        if seq.seq_id in self.states and draft.context is not None:
            decoder, state = self.states[seq.seq_id]
            decoder.advance_window(state, draft.context, argmax, num_committed)

    def retain(self, seq_ids: set[int]) -> None:
        pass  # called only with needs_all_hidden

    def observe_hidden(self, seq: Sequence, position: int, hidden: torch.Tensor) -> None:
        pass  # called only with needs_all_hidden

    def release(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)


def external_draft(seq: Sequence, room: int) -> Optional[StepDraft]:
    """The request's own draft tokens (draft_input_ids) still ahead of its committed output, as a chain.
    Guesses already overtaken by committed tokens count as verified; a mismatch there ends them."""
    params = seq.params
    assert params.draft_tokens is not None  # called for requests with draft tokens
    drafts, outputs = list(params.draft_tokens), seq.output_token_ids
    done = min(len(outputs), len(drafts))
    if outputs[:done] != drafts[:done] or done == len(drafts) or room <= 0:
        return None
    remaining = drafts[done : done + room]
    probs = None
    if params.draft_logits is not None and not params.greedy:
        logits = torch.as_tensor(params.draft_logits, dtype=torch.float32)
        probs = torch.softmax(logits[done : done + len(remaining)], dim=-1)
    return StepDraft(DraftTree.chain(remaining, probs), pre_matched=done, external=True)
