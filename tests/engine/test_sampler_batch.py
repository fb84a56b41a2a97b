"""The sampler's batched draw: unseeded rows drawn together on the logits' device follow softmax(logits / T) cut
by each row's own top-k / top-p; greedy and seeded rows in the same batch keep their own rules."""

import math

import torch

from tritonllm.engine.embedded.sampler import sample
from tritonllm.engine.embedded.sequence import Sequence
from tritonllm.engine.types import SamplingParams

PROBS = [0.6, 0.3, 0.1]
ROWS = 4000


def _seqs(count: int, **params) -> list[Sequence]:
    seed = params.get("seed")
    return [
        Sequence(
            i,
            i,
            0,
            [1],
            SamplingParams(max_tokens=4, **params),
            generator=None if seed is None else torch.Generator().manual_seed(seed),
        )
        for i in range(count)
    ]


def _frequencies(tokens: list[int]) -> list[float]:
    return [tokens.count(t) / len(tokens) for t in range(len(PROBS))]


def _logits(rows: int) -> torch.Tensor:
    return torch.tensor(PROBS).log().repeat(rows, 1)


def test_unseeded_rows_follow_the_distribution_and_report_its_log_probs():
    torch.manual_seed(0)
    tokens, logprobs = sample(_logits(ROWS), _seqs(ROWS, temperature=1.0))
    for seen, expected in zip(_frequencies(tokens), PROBS):
        assert abs(seen - expected) < 0.03
    assert all(abs(lp - math.log(PROBS[t])) < 1e-5 for t, lp in zip(tokens, logprobs))


def test_temperature_sharpens_before_the_draw():
    torch.manual_seed(1)
    tokens, _ = sample(_logits(ROWS), _seqs(ROWS, temperature=0.5))
    squared = [p * p for p in PROBS]
    for seen, expected in zip(_frequencies(tokens), [p / sum(squared) for p in squared]):
        assert abs(seen - expected) < 0.03


def test_top_k_and_top_p_cut_each_row_by_its_own_setting():
    torch.manual_seed(2)
    seqs = _seqs(ROWS // 2, temperature=1.0, top_k=2) + _seqs(ROWS // 2, temperature=1.0, top_p=0.5)
    tokens, _ = sample(_logits(ROWS), seqs)
    top_k, top_p = tokens[: ROWS // 2], tokens[ROWS // 2 :]
    assert set(top_k) == {0, 1} and abs(_frequencies(top_k)[0] - 2 / 3) < 0.04
    assert set(top_p) == {0}


def test_greedy_and_seeded_rows_keep_their_rules_among_unseeded_ones():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    greedy, seeded = _seqs(1)[0], _seqs(1, temperature=1.0, seed=5)[0]
    alone, _ = sample(logits[2:3].clone(), _seqs(1, temperature=1.0, seed=5))
    batch = [*_seqs(2, temperature=1.0), seeded, greedy, *_seqs(2, temperature=0.7)]
    tokens, _ = sample(logits.clone(), batch)
    assert tokens[3] == int(logits[3].argmax())
    assert tokens[2] == alone[0]  # the seeded row draws from its own generator, whatever else is in the batch
