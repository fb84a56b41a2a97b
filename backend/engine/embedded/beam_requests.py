"""Beam-search requests inside the engine core: turning one step's log-probs into the next live beams (forking and
pruning sequences, sharing their KV blocks), and what such a request reports. The ranking rules themselves are in
`beam_search.BeamSearch`."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..types import CompletionOutput, RequestOutput
from .beam_search import Continuation, StopCause
from .block_manager import BlockManager
from .request import EngineRequest
from .sampler import beam_logprobs
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus
from .stop_rules import matched_stop

if TYPE_CHECKING:
    from .guided import GuidedDecoder


class BeamRequests:
    """Given the core's scheduler and block manager, how it copies a KV block, numbers a new sequence and
    finishes one, and its max_seq_len."""

    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        copy_block: Callable[[int, int], None],
        new_seq_id: Callable[[], int],
        finish_sequence: Callable[[Sequence, str], None],
        max_seq_len: int,
        guide: Optional[GuidedDecoder] = None,
    ):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.copy_block = copy_block
        self.new_seq_id = new_seq_id
        self.finish_sequence = finish_sequence
        self.max_seq_len = max_seq_len
        self.guide = guide  # masks guided beams' rows; each live beam has its own matcher

    def step(self, request: EngineRequest) -> None:
        """Every live beam of `request` has its next-token logits: rank, record finished hypotheses, move on."""
        beams = list(request.seqs)
        logits = torch.stack([request.beam_logits.pop(beam.seq_id) for beam in beams])
        search = request.beam
        assert search is not None  # a beam request
        if self.guide is not None:
            self.guide.mask(logits, beams)
        candidates = search.top_continuations(beams, beam_logprobs(logits, beams), self.ending)
        # A grammar that allows fewer tokens than the search ranks leaves forbidden (-inf) candidates: never taken.
        candidates = [c for c in candidates if c.score != float("-inf")]
        survivors = search.select(beams, candidates)
        now = time.time_ns()
        for beam in beams:
            beam.metrics.first_token_time_ns = beam.metrics.first_token_time_ns or now
            beam.metrics.last_token_time_ns = now
        if search.done:
            for beam in beams:
                self.finish_sequence(beam, "stop")
            return
        request.seqs = self._next_beams(beams, survivors)

    def ending(self, seq: Sequence, token: int) -> tuple[Optional[str], StopCause]:
        """Whether `seq` extended by `token` ends, and why: ("stop", "end_id" | stop token | stop word),
        ("length", None) or (None, None)."""
        params = seq.params
        if token == params.end_id and not params.ignore_eos:
            return "stop", "end_id"
        if self.guide is not None and self.guide.ends_with(seq, token):
            return "stop", "end_id"  # the grammar's stop token ends the beam as the end token does
        stop = matched_stop(params, token, lambda: seq.all_token_ids() + [token])
        if stop is not None:
            return "stop", stop
        if len(seq.output_token_ids) + 1 >= params.max_tokens or seq.num_tokens + 1 >= self.max_seq_len:
            return "length", None
        return None, None

    def _next_beams(self, beams: list[Sequence], survivors: list[Continuation]) -> list[Sequence]:
        """Turn the surviving continuations into live sequences: a parent's first child continues in it, the
        others fork it (before it takes its new token); parents without children are freed."""
        taken: set[int] = set()
        children = []
        for candidate in survivors:
            parent = beams[candidate.parent]
            if candidate.parent in taken:
                children.append(self._fork(parent))
            else:
                taken.add(candidate.parent)
                children.append(parent)
        for index, parent in enumerate(beams):
            if index not in taken:
                parent.finish("cancelled")  # a pruned beam: not part of the results
                self.scheduler.remove(parent)
                if self.guide is not None:
                    self.guide.release(parent)
        for index, (child, candidate) in enumerate(zip(children, survivors)):
            child.index = index
            if self.guide is not None and child.seq_id in self.guide.matchers:
                self.guide.advance(child, candidate.token)  # allowed by the mask, and not a stop token (ending)
            child.output_token_ids.append(candidate.token)
            child.logprobs.append(candidate.logprob)
            child.cumulative_logprob = candidate.score
        return children

    def _fork(self, parent: Sequence) -> Sequence:
        child = Sequence(
            self.new_seq_id(),
            parent.request_id,
            parent.index,
            parent.prompt_token_ids,
            parent.params,
            output_token_ids=list(parent.output_token_ids),
            logprobs=list(parent.logprobs),
            cumulative_logprob=parent.cumulative_logprob,
            metrics=replace(parent.metrics),
            lora=parent.lora,
        )
        if self.guide is not None:
            self.guide.fork(parent, child)  # the matcher as it stands, before the parent takes its new token
        if parent.status is SequenceStatus.RUNNING and self.block_manager.fork(parent, child, self.copy_block):
            child.status = SequenceStatus.RUNNING
            self.scheduler.running.append(child)
        else:  # no block for its copy (or the parent was preempted): recompute it
            self.scheduler.waiting.appendleft(child)
        return child


def beam_snapshot(request: EngineRequest) -> RequestOutput:
    """The best `n` finished hypotheses once the search is done, else the live beams, each whole (beams change
    their earlier tokens, so a stream sends every beam in full each time)."""
    metrics = replace(request.seqs[0].metrics) if request.seqs else None
    beam = request.beam
    assert beam is not None  # a beam request
    if beam.done:
        outputs = [
            CompletionOutput(
                index=i,
                token_ids=list(h.token_ids),
                logprobs=list(h.logprobs),
                cumulative_logprob=h.cumulative_logprob,
                finish_reason=h.finish_reason,
                stop_reason=h.stop_reason,
                request_perf_metrics=metrics,
            )
            for i, h in enumerate(beam.results(request.params.n))
        ]
    else:
        outputs = [
            CompletionOutput(
                index=seq.index,
                token_ids=list(seq.output_token_ids),
                logprobs=list(seq.logprobs),
                cumulative_logprob=seq.cumulative_logprob,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                request_perf_metrics=replace(seq.metrics),
            )
            for seq in request.seqs[: request.params.n]
        ]
    return RequestOutput(request.request_id, request.prompt_token_ids, outputs, finished=request.finished)
