"""Speculative decoding inside the embedded engine: drafts before the schedule, verification after the forward.

Drafts are kept on the side (`Sequence.draft`), not appended as provisional tokens: the sequence's known tokens
stay the committed ones, so prefix hashing, stop rules and preemption never see a draft. The scheduler adds the
draft's tokens to the step's query (budget and KV blocks count them; a draft that does not fit is cut or dropped), the
runner feeds them after the root (the last committed token) and returns logits at the root and every draft token.

Verification is tritonllm.spec_decode.acceptance's rule (`walk`): each row is turned into a token exactly as a
plain decode step would (the sampler with the sequence's processors and generator, after committing the tokens
before it), and the walk continues while that token is a child in the tree. So greedy output equals plain greedy
decoding and sampled output keeps the target distribution (a deterministic draft is accepted with probability
p(d), the rejection token is drawn from p without d). Drafts with probabilities (external `draft_logits`) use
rejection sampling (`accept_or_resample`). Tokens are committed one by one through the engine's finish rules (end
id, stop words, max_tokens). Afterwards the KV of rejected positions is dropped: num_computed_tokens falls back to
the committed tokens, accepted tree nodes are copied down to consecutive slots, tail blocks are freed."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional

import torch

from tritonllm.spec_decode.acceptance import accept_or_resample, draft_child, walk
from tritonllm.spec_decode.proposer import ProposalInput

from ..model_runner import StepOutput
from ..sampler import plain_greedy_choices, sample, sampling_probs
from ..sequence import Sequence, SequenceStatus
from .build import TargetParts, build_method
from .methods import StepDraft, external_draft

if TYPE_CHECKING:
    from ..guided import GuidedDecoder

log = logging.getLogger("tritonllm.engine")

Commit = Callable[[Sequence, int, float], None]


class Speculator:
    """`target`: the engine's parts speculation uses (TargetParts), never the engine core itself."""

    def __init__(self, target: TargetParts, spec_config=None) -> None:
        self.target = target
        self.config = spec_config
        self.method = build_method(spec_config, target)
        self.hidden: dict[int, torch.Tensor] = {}  # Medusa: the state that predicted each sequence's last token
        self.external_done: set[int] = set()  # sequences whose request's draft tokens are verified
        # Eagle: the method sees the target's hidden state of every computed position (prompts included).
        self.all_hidden = getattr(self.method, "needs_all_hidden", False)
        target.runner.keep_all_hidden = self.all_hidden
        self.guide: Optional[GuidedDecoder] = None  # the engine's guided decoder, if it has one

    def check_lookahead(self, wanted) -> None:
        """A request's own lookahead (W, N, G) needs the engine's lookahead and must fit within it."""
        from tritonllm.spec_decode.config import LookaheadConfig

        from ...types import InvalidRequestError

        if not isinstance(self.config, LookaheadConfig):
            raise InvalidRequestError(
                "a per-request lookahead config (lookahead_window_size / lookahead_ngram_size /"
                " lookahead_verification_set_size) needs the model instance's lookahead "
                "decoding (decoding_mode: lookahead, or speculative_config decoding_type "
                "Lookahead)"
            )
        for key, short in (
            ("max_window_size", "window size"),
            ("max_ngram_size", "n-gram size"),
            ("max_verification_set_size", "verification set size"),
        ):
            if getattr(wanted, key) > getattr(self.config, key):
                raise InvalidRequestError(
                    f"lookahead {short} {getattr(wanted, key)} exceeds the model instance's {getattr(self.config, key)}"
                )

    # -- before the schedule ----------------------------------------------------------------------------------

    def propose(self, running: list[Sequence]) -> None:
        """Set `draft` on the running decode sequences that speculate this step."""
        items, seqs = [], []
        if self.all_hidden:
            assert self.method is not None  # all_hidden comes from the method
            self.method.retain({seq.seq_id for seq in running})  # preempted sequences start over
        for seq in running:
            seq.draft = None
            room = self._room(seq)
            if room <= 0:
                continue
            if seq.params.draft_tokens and seq.seq_id not in self.external_done:
                seq.draft = external_draft(seq, room)
                if seq.draft is None:
                    self._close_external(seq)
            elif self.method is not None and (not self.method.needs_hidden or seq.seq_id in self.hidden):
                items.append(ProposalInput(seq.seq_id, seq.all_token_ids(), self.hidden.get(seq.seq_id), room))
                seqs.append(seq)
        if items:
            assert self.method is not None  # items are collected for the method only
            for seq, draft in zip(seqs, self.method.drafts(items, seqs)):
                seq.draft = draft

    def _room(self, seq: Sequence) -> int:
        """Draft tokens that could still be committed: 0 for sequences not decoding (prefill, waiting, beams) and for
        requests that asked not to speculate."""
        if (
            seq.status is not SequenceStatus.RUNNING
            or seq.num_uncomputed_tokens != 1
            or seq.params.beam_width > 1
            or not seq.params.speculate
        ):
            return 0
        return seq.params.max_tokens - len(seq.output_token_ids) - 1

    def _close_external(self, seq: Sequence) -> None:
        """The request's drafts are used up (or were overtaken by different tokens): count them once."""
        drafts, outputs = seq.params.draft_tokens, seq.output_token_ids
        assert drafts is not None  # only requests with draft tokens get external drafts
        matched = next((i for i, (d, o) in enumerate(zip(drafts, outputs)) if d != o), min(len(drafts), len(outputs)))
        seq.metrics.total_draft_tokens += len(drafts)
        seq.metrics.total_accepted_draft_tokens += matched
        self.external_done.add(seq.seq_id)

    # -- after the forward ------------------------------------------------------------------------------------

    def observe(self, out: StepOutput) -> None:
        """Eagle: hand the method the hidden states of the positions this step computed."""
        for seq, position, hidden in out.all_hidden or ():
            assert self.method is not None  # the runner keeps all hidden states for the method only
            self.method.observe_hidden(seq, position, hidden)

    def remember_hidden(self, out: StepOutput, index: int, offset: int = 0) -> None:
        """Medusa drafts from the hidden state that produced the sequence's newest token (row `offset` of its
        rows: the last accepted node's)."""
        if self.method is not None and self.method.needs_hidden and not out.seqs[index].is_finished:
            self.hidden[out.seqs[index].seq_id] = out.hidden[out.first_rows[index] + offset]

    def verify(self, out: StepOutput, index: int, commit: Commit) -> None:
        seq, draft = out.seqs[index], out.seqs[index].draft
        assert draft is not None  # the engine verifies the sequences that fed a draft
        rows = out.rows_of(index)
        logits, root_position = out.logits[rows], seq.num_tokens - 1
        keep_raw = draft.window or seq.params.return_generation_logits
        raw = logits.clone() if keep_raw else None  # the sampler processes rows in place
        accepted = self._walk(seq, draft, logits, raw, commit)
        self._count(seq, draft, len(accepted))
        seq.draft = None
        if seq.is_finished:
            return
        if self.all_hidden and accepted:  # the accepted nodes' rows are computed positions now
            assert self.method is not None  # all_hidden comes from the method
            accepted_rows = [out.first_rows[index] + 1 + node for node in accepted]
            self.method.observe_hidden(seq, root_position + 1, out.hidden[accepted_rows])
        if not draft.external and self.method is not None:
            argmax: list[int] = []  # the window's guesses
            if draft.window:
                assert raw is not None  # kept for the window
                argmax = raw.argmax(dim=-1).tolist()
            self.method.after_verify(seq, draft, argmax, len(accepted) + 1)
        self._roll_back(seq, root_position, accepted)
        self.remember_hidden(out, index, accepted[-1] + 1 if accepted else 0)

    def _walk(
        self, seq: Sequence, draft: StepDraft, logits: torch.Tensor, raw: Optional[torch.Tensor], commit: Commit
    ) -> list[int]:
        """Commit tokens row by row while they follow the tree (acceptance.walk); returns the accepted node
        indices. A guided sequence's row is masked by its grammar, advanced by the tokens committed before it, so a
        draft token the grammar rejects is never chosen: the walk ends there."""
        tree = draft.tree
        guide = self.guide if self.guide is not None and seq.seq_id in self.guide.matchers else None
        choices = None if guide is not None else plain_greedy_choices(seq, logits)

        def choose(node: int) -> int:
            row = node + 1
            if seq.params.return_generation_logits:
                assert raw is not None  # kept for the generation logits
                seq.generation_logits.append(raw[row].cpu())
            if choices:
                token, logprob = choices[row]
            else:
                if guide is not None:
                    guide.mask(logits[row : row + 1], [seq])
                token, logprob = self._choose(seq, tree, node, logits[row : row + 1])
            commit(seq, token, logprob)
            return token

        return walk(tree, choose, lambda: seq.is_finished).accepted_nodes

    def _choose(self, seq: Sequence, tree, node: int, row: torch.Tensor) -> tuple[int, float]:
        """The token after `node`: the request's sampler on the row, or rejection sampling against the next draft's
        probabilities (acceptance.draft_child) for a sampled chain that has them."""
        child = draft_child(tree, node)
        if child is None or seq.params.greedy:
            tokens, logprobs = sample(row, [seq])
            return tokens[0], logprobs[0]
        probs, row_logprobs = sampling_probs(row[0], seq)
        _, token = accept_or_resample(
            probs, tree.draft_probs[child], tree.tokens[child], seq.generator, seq.params.draft_acceptance_threshold
        )
        return token, float(row_logprobs[token])

    def _count(self, seq: Sequence, draft: StepDraft, num_accepted: int) -> None:
        seq.metrics.total_draft_tokens += draft.pre_matched + len(draft.tree)
        seq.metrics.total_accepted_draft_tokens += draft.pre_matched + num_accepted
        if draft.external and not seq.is_finished:
            self.external_done.add(seq.seq_id)

    def _roll_back(self, seq: Sequence, root_position: int, accepted: list[int]) -> None:
        """Keep the KV of the root and the accepted nodes, at consecutive positions; drop the rest."""
        moves = [
            (root_position + 1 + node, root_position + 1 + depth)
            for depth, node in enumerate(accepted)
            if node != depth
        ]
        if moves:
            slot = self.target.block_manager.slot_of
            self.target.runner.copy_slots([slot(seq, src) for src, _ in moves], [slot(seq, dst) for _, dst in moves])
        seq.num_computed_tokens = root_position + 1 + len(accepted)
        self.target.block_manager.trim(seq, seq.num_tokens)

    def release(self, seq: Sequence) -> None:
        """Forget a finished or aborted sequence."""
        seq.draft = None
        self.hidden.pop(seq.seq_id, None)
        self.external_done.discard(seq.seq_id)
        if self.method is not None:
            self.method.release(seq.seq_id)
