"""Verification (the rule the engine runs too): greedy acceptance is exact along chains and trees; sampled
verification keeps the target distribution (a statistical test on a 6-token vocabulary with a bound computed from
the sample count)."""

import math

import pytest
import torch

from tritonllm.spec_decode.acceptance import accept_or_resample, greedy_accept, rejection_sample
from tritonllm.spec_decode.tree import DraftTree

VOCAB = 6
NUM_SAMPLES = 20_000
FAILURE_PROBABILITY = 1e-6


# ---- greedy ---------------------------------------------------------------------------------------------------


def test_greedy_chain_accepts_the_matching_prefix_and_adds_the_target_token():
    tree = DraftTree.chain([5, 7, 9])
    verdict = greedy_accept(tree, [5, 7, 4, 1])  # target agrees on 5 and 7, then wants 4
    assert verdict.accepted_nodes == [0, 1]
    assert verdict.tokens == [5, 7, 4]


def test_greedy_chain_all_accepted_takes_the_bonus_token():
    verdict = greedy_accept(DraftTree.chain([5, 7]), [5, 7, 3])
    assert verdict.tokens == [5, 7, 3] and verdict.num_accepted == 2


def test_greedy_rejecting_the_first_draft_still_makes_progress():
    verdict = greedy_accept(DraftTree.chain([5, 7]), [6, 7, 3])
    assert verdict.tokens == [6] and verdict.accepted_nodes == []


def test_greedy_tree_follows_the_branch_the_target_chose():
    # root -> 10 (node 0) -> 12 (node 2); root -> 11 (node 1) -> 13 (node 3) -> 14 (node 4)
    tree = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 1, 3])
    # rows: after root 11, after node 0 (unused) 99, after node 1 13, node 2 99, after node 3 14, after node 4 2
    target = [11, 99, 13, 99, 14, 2]
    verdict = greedy_accept(tree, target)
    assert verdict.accepted_nodes == [1, 3, 4]
    assert verdict.tokens == [11, 13, 14, 2]


def test_greedy_wrong_row_count_is_an_error():
    with pytest.raises(ValueError, match="need 3 target tokens"):
        greedy_accept(DraftTree.chain([1, 2]), [1, 2])


# ---- sampling: a Markov target over a tiny vocabulary ---------------------------------------------------------


def _transition_matrix(seed: int, sharpness: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(sharpness * torch.randn(VOCAB, VOCAB, generator=generator), dim=-1)


TARGET = _transition_matrix(1, 1.5)
DRAFT = _transition_matrix(2, 1.5)  # a different distribution, so rejections happen often
START = 0


def _draft_chain(prev: int, k: int, generator: torch.Generator):
    tokens, rows = [], []
    for _ in range(k):
        row = DRAFT[prev]
        prev = int(torch.multinomial(row, 1, generator=generator)[0])
        tokens.append(prev)
        rows.append(row)
    return tokens, torch.stack(rows)


def _target_rows(prev: int, tokens) -> torch.Tensor:
    return torch.stack([TARGET[t] for t in [prev] + list(tokens)])


def _step_sampled_chain(prev, generator):
    tokens, q = _draft_chain(prev, 3, generator)
    return rejection_sample(DraftTree.chain(tokens, q), _target_rows(prev, tokens), generator).tokens


def _step_deterministic_chain(prev, generator):
    tokens = []
    for _ in range(3):  # the draft's argmax chain: no draft probabilities
        prev_token = tokens[-1] if tokens else prev
        tokens.append(int(DRAFT[prev_token].argmax()))
    return rejection_sample(DraftTree.chain(tokens), _target_rows(prev, tokens), generator).tokens


def _step_tree(prev, generator):
    # Two branches from the root (draft's top-2), each continued by the draft's argmax.
    first, second = DRAFT[prev].topk(2).indices.tolist()
    tree = DraftTree([first, second, int(DRAFT[first].argmax()), int(DRAFT[second].argmax())], [-1, -1, 0, 1])
    rows = [TARGET[prev]] + [TARGET[token] for token in tree.tokens]
    return rejection_sample(tree, torch.stack(rows), generator).tokens


def _step_always_accept(prev, generator):  # a broken verifier: the negative control
    tokens, _ = _draft_chain(prev, 3, generator)
    return tokens + [int(torch.multinomial(TARGET[tokens[-1]], 1, generator=generator)[0])]


def _first_two_tokens(step, generator):
    out = []
    while len(out) < 2:
        out += step(out[-1] if out else START, generator)
    return out[0] * VOCAB + out[1]


def _total_variation(step, seed=0) -> float:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB * VOCAB)
    for _ in range(NUM_SAMPLES):
        counts[_first_two_tokens(step, generator)] += 1
    expected = (TARGET[START][:, None] * TARGET).reshape(-1)  # p(a | start) * p(b | a)
    return 0.5 * float((counts / NUM_SAMPLES - expected).abs().sum())


def total_variation_bound(num_samples: int, num_cells: int, failure_probability: float) -> float:
    """Weissman et al. (2003): P(||p_hat - p||_1 >= eps) <= (2^K - 2) exp(-n eps^2 / 2). Solved for eps at the
    given failure probability and halved for total variation. n = 20000, K = 36, 1e-6 give 0.031."""
    l1 = math.sqrt(2.0 / num_samples * (num_cells * math.log(2.0) + math.log(1.0 / failure_probability)))
    return l1 / 2.0


BOUND = total_variation_bound(NUM_SAMPLES, VOCAB * VOCAB, FAILURE_PROBABILITY)


@pytest.mark.parametrize(
    "step",
    [_step_sampled_chain, _step_deterministic_chain, _step_tree],
    ids=["chain-with-draft-probs", "chain-one-hot", "tree-one-hot"],
)
def test_speculative_sampling_keeps_the_target_distribution_of_two_tokens(step):
    assert BOUND < 0.032
    assert _total_variation(step) <= BOUND


def test_the_distribution_test_catches_a_verifier_that_accepts_everything():
    assert _total_variation(_step_always_accept) > BOUND


def test_same_generator_seed_gives_the_same_tokens():
    a = [_first_two_tokens(_step_sampled_chain, torch.Generator().manual_seed(7)) for _ in range(3)]
    b = [_first_two_tokens(_step_sampled_chain, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert a == b


def test_draft_token_the_draft_could_not_produce_is_rejected():
    generator = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.0, 1.0, 0.0]])
    p = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert accept_or_resample(p[0], q[0], 0, generator) == (False, 0)  # rejected; 0 is drawn from norm(p - q)
    assert accept_or_resample(p[0], q[0], 0, generator, threshold=0.0) == (False, 0)
    # The token drawn after the rejection is the draft's, so the walk goes on past its node (whose row the target
    # computed after that very token) and draws the next token from the row after it.
    verdict = rejection_sample(DraftTree.chain([0], q), p, generator)
    assert verdict.tokens == [0, 0] and verdict.accepted_nodes == [0]
