"""Beam search over the engine's sequences, with Hugging Face `generate(num_beams=...)`'s selection rules.

A beam request runs as up to `beam_width` live sequences. Each step, once every live beam has its next-token
log-probs, the `2 * beam_width` best continuations over all beams are ranked by accumulated log-prob:
- a continuation that ends (end id, a stop word or token, or the length limit) and ranks among the top
  `beam_width` becomes a finished hypothesis, scored `sum_logprobs / generated_len ** length_penalty`; the best
  `beam_width` hypotheses are kept;
- the best `beam_width` continuations that do not end become the next live beams. A parent's first child
  continues in its sequence; further children fork it (sharing its full KV blocks, copying the partial last one).
The search stops when no live beam can beat the worst kept hypothesis (the `early_stopping` rule below), when
`early_stopping` is on and `beam_width` hypotheses are done, or when every continuation ends.

`early_stopping` (TensorRT-LLM's integer): 1 stops as soon as `beam_width` hypotheses are done; 0 or unset uses
HF's default heuristic (a live beam's score at its current length); any other value is HF's "never" (a
live beam's best possible score at the maximum length when `length_penalty` > 0)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .sequence import Sequence

NEG_INF = -1.0e9  # HF's masking value: large and finite, so masked scores still order among themselves
# Why a continuation stops: a stop token, a stop word, or "end_id" (the end id, which is no reported stop reason).
StopCause = Optional[int | list[int] | str]


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (end token excluded), per-token log-probs and score."""

    score: float
    token_ids: list[int]
    logprobs: list[float]
    cumulative_logprob: float
    finish_reason: str
    stop_reason: Optional[int | list[int]] = None


@dataclass
class Continuation:
    """One candidate: live beam `parent` extended by `token`."""

    parent: int
    token: int
    logprob: float  # of `token`, processed
    score: float  # parent's accumulated log-prob + logprob
    ends: bool = False
    finish_reason: Optional[str] = None
    stop_reason: StopCause = None


@dataclass
class BeamSearch:
    beam_width: int
    length_penalty: float
    early_stopping: int
    max_new_tokens: int
    hypotheses: list[Hypothesis] = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False

    @classmethod
    def for_params(cls, params, max_new_tokens: int) -> "BeamSearch":
        penalty = 1.0 if params.length_penalty is None else float(params.length_penalty)
        return cls(params.beam_width, penalty, params.early_stopping or 0, max_new_tokens)

    # -- one step ---------------------------------------------------------------------------------------------

    def top_continuations(
        self,
        beams: list[Sequence],
        logprobs: torch.Tensor,
        ends: Callable[[Sequence, int], tuple[Optional[str], StopCause]],
    ) -> list[Continuation]:
        """logprobs: [len(beams), vocab] processed log-probs. The best 2 * beam_width continuations, best first."""
        scores = (
            torch.tensor([b.cumulative_logprob for b in beams], dtype=logprobs.dtype, device=logprobs.device)[:, None]
            + logprobs
        )
        vocab = logprobs.shape[1]
        k = min(2 * self.beam_width, scores.numel())
        top_scores, top_index = torch.topk(scores.reshape(-1), k)
        candidates = []
        for score, index in zip(top_scores.tolist(), top_index.tolist()):
            parent, token = divmod(index, vocab)
            reason, stop = ends(beams[parent], token)
            candidates.append(
                Continuation(parent, token, float(logprobs[parent, token]), score, reason is not None, reason, stop)
            )
        return candidates

    def select(self, beams: list[Sequence], candidates: list[Continuation]) -> list[Continuation]:
        """Record finished hypotheses; return the continuations that become the next live beams."""
        generated_len = len(beams[0].output_token_ids) + 1  # every live beam has the same length
        self._add_hypotheses(beams, candidates[: self.beam_width], generated_len)
        survivors = [c for c in candidates if not c.ends][: self.beam_width]
        if not survivors:
            self.done = True
            return []
        self._update_stop_rule(survivors[0].score, generated_len)
        if not self.improvement_possible or (self.early_stopping == 1 and self._full):
            self.done = True
        return survivors

    @property
    def _full(self) -> bool:
        return len(self.hypotheses) >= self.beam_width

    def _add_hypotheses(self, beams: list[Sequence], ranked: list[Continuation], generated_len: int) -> None:
        if not self.improvement_possible or (self.early_stopping == 1 and self._full):
            return
        for candidate in ranked:
            if not candidate.ends:
                continue
            assert candidate.finish_reason is not None  # set on every continuation that ends
            parent = beams[candidate.parent]
            keep_token = candidate.finish_reason != "stop" or candidate.stop_reason != "end_id"
            tokens = parent.output_token_ids + ([candidate.token] if keep_token else [])
            logprobs = parent.logprobs + ([candidate.logprob] if keep_token else [])
            stop = candidate.stop_reason
            stop_reason = None if isinstance(stop, str) else stop  # the only text is "end_id"
            self.hypotheses.append(
                Hypothesis(
                    candidate.score / generated_len**self.length_penalty,
                    tokens,
                    logprobs,
                    candidate.score,
                    candidate.finish_reason,
                    stop_reason,
                )
            )
        # Stable: among equal scores the earlier hypothesis stays ahead, as HF's merge keeps it.
        self.hypotheses.sort(key=lambda h: -h.score)
        del self.hypotheses[self.beam_width :]

    def _update_stop_rule(self, best_live_score: float, generated_len: int) -> None:
        """HF's heuristic: keep going while the best live beam could still beat the worst kept hypothesis."""
        if not self._full:
            return
        never = self.early_stopping not in (0, 1)
        length = self.max_new_tokens if never and self.length_penalty > 0 else generated_len
        best_possible = best_live_score / length**self.length_penalty
        self.improvement_possible = best_possible > self.hypotheses[-1].score

    def results(self, n: int) -> list[Hypothesis]:
        return self.hypotheses[:n]
