"""The accuracy bench's arithmetic, free of any engine: perplexity from context logits, ROUGE between texts (the
`rouge-score` package), token agreement between continuations."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


class MissingDependencyError(RuntimeError):
    """A package the accuracy bench needs is not installed; the message says which and how to get it."""


def require_rouge() -> None:
    """Fail before any model loads, rather than after both sides ran, when rouge-score is missing."""
    try:
        import rouge_score.rouge_scorer  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(
            f"the accuracy bench needs rouge-score ({exc}): pip install 'rouge-score==0.1.2' "
            "(or the package's 'bench' extra)"
        ) from None


@dataclass
class NegLogLikelihood:
    """A sum of -log p(token | the tokens before it) over `tokens` scored tokens."""

    total: float = 0.0
    tokens: int = 0

    def add(self, other: "NegLogLikelihood") -> None:
        self.total += other.total
        self.tokens += other.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.total / self.tokens) if self.tokens else float("nan")


def window_nll(context_logits: torch.Tensor, token_ids: list[int]) -> NegLogLikelihood:
    """`context_logits` [len, vocab]: the logits at each position of the window `token_ids`; the logits at position
    i predict token i + 1, so every token after the first is scored. Computed in float64 (a sum over thousands)."""
    if context_logits.shape[0] != len(token_ids):
        raise ValueError(f"{context_logits.shape[0]} rows of context logits for a window of {len(token_ids)} tokens")
    log_probs = torch.log_softmax(context_logits[:-1].double(), dim=-1)
    targets = torch.tensor(token_ids[1:], dtype=torch.long).unsqueeze(1)
    return NegLogLikelihood(-float(log_probs.gather(1, targets).sum()), len(token_ids) - 1)


def rouge_f_means(references: list[str], predictions: list[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F-measures of each prediction against its reference (rouge-score's default tokenizer, no
    stemming). Two equal texts score 1: rouge-score gives 0 to a pair in which it finds no word at all."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(list(ROUGE_TYPES), use_stemmer=False)
    per_type: dict[str, list[float]] = {name: [] for name in ROUGE_TYPES}
    for reference, prediction in zip(references, predictions, strict=True):
        scores = scorer.score(reference, prediction)
        for name in ROUGE_TYPES:
            per_type[name].append(1.0 if reference == prediction else scores[name].fmeasure)
    return {name: statistics.fmean(values) if values else float("nan") for name, values in per_type.items()}


def token_agreement(references: list[list[int]], predictions: list[list[int]]) -> tuple[int, int]:
    """(positions where the prediction has the reference's token, positions compared): each pair is compared up
    to the longer of the two, so a continuation that stops early or runs on disagrees at every extra position."""
    matches = positions = 0
    for reference, prediction in zip(references, predictions, strict=True):
        matches += sum(a == b for a, b in zip(reference, prediction))
        positions += max(len(reference), len(prediction))
    return matches, positions
