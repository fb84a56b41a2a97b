"""Lookahead: the pool, the window's attention mask and positions (checked by an oracle that fails on any
incoherent view), and greedy output identical to plain greedy decoding with fewer forwards."""

import pytest
import torch

from tritonllm.spec_decode.config import LookaheadConfig
from tritonllm.spec_decode.lookahead import LookaheadDecoder, NGramPool, lookahead_generate

from .toy_lm import greedy_reference, toy_forward, visible_sequence


def test_pool_keeps_the_most_recent_continuations_per_key():
    pool = NGramPool(ngram_size=3, max_per_key=2)
    pool.add_from([1, 2, 3, 1, 4, 5, 1, 2, 3])
    assert pool.candidates(1) == [(2, 3), (4, 5)]  # (2, 3) re-added last
    pool.add(1, [6, 7])
    assert pool.candidates(1) == [(6, 7), (2, 3)]
    assert pool.candidates(9) == []


def test_candidates_whose_context_matches_the_text_before_the_root_come_first():
    pool = NGramPool(ngram_size=3, max_per_key=8)
    pool.add_from([7, 8, 1, 2, 3, 9, 9, 1, 4, 5, 6, 6, 1, 5, 5])  # key 1 after (7, 8), (9, 9), (6, 6)
    assert pool.candidates(1) == [(5, 5), (4, 5), (2, 3)]  # no context given: most recent first
    assert pool.candidates(1, before=[0, 7, 8]) == [(2, 3), (5, 5), (4, 5)]  # two tokens match
    assert pool.candidates(1, before=[3, 9]) == [(4, 5), (5, 5), (2, 3)]  # one token matches
    # The pool keeps more n-grams per key than the verification set; the best G are verified.
    decoder = LookaheadDecoder(LookaheadConfig(max_window_size=1, max_ngram_size=3, max_verification_set_size=1))
    state = decoder.new_state([7, 8, 1, 2, 3, 9, 9, 1, 4, 5, 6, 6, 1, 5, 5])
    assert len(state.pool.candidates(1)) == 3
    assert decoder.build_step(state, root=1, before=[7, 8]).tree.tokens == [2, 3]
    assert decoder.build_step(state, root=1).tree.tokens == [5, 5]


def test_a_fully_matching_candidate_is_extended_along_the_pool_within_the_budget():
    decoder = LookaheadDecoder(LookaheadConfig(max_window_size=1, max_ngram_size=3, max_verification_set_size=2))
    state = decoder.new_state([1, 2, 3, 4, 5, 6, 7, 8, 9])  # budget: G * (N - 1) = 4 tokens
    # 3 follows (1, 2) as it did in the text: its continuation (4, 5) goes on with 5's own, (6, 7).
    assert decoder.build_step(state, root=3, before=[1, 2]).tree.tokens == [4, 5, 6, 7]
    # Context only partly matching, or not given: the n-gram alone.
    assert decoder.build_step(state, root=3, before=[9, 2]).tree.tokens == [4, 5]
    assert decoder.build_step(state, root=3).tree.tokens == [4, 5]
    assert decoder.build_step(state, root=3, max_draft=3, before=[1, 2]).tree.tokens == [4, 5, 6]


def test_verification_tree_merges_shared_prefixes():
    decoder = LookaheadDecoder(LookaheadConfig(max_window_size=2, max_ngram_size=4, max_verification_set_size=3))
    pool = NGramPool(4, 3)
    for gram in ([5, 6, 7], [5, 6, 8], [9, 1, 2]):
        pool.add(0, gram)
    tree = decoder.verification_tree(pool, root=0)
    assert tree.tokens == [9, 1, 2, 5, 6, 8, 7]
    assert tree.parents == [-1, 0, 1, -1, 3, 4, 4]
    assert len(decoder.verification_tree(pool, root=0, max_draft=4)) == 4


def test_every_row_of_a_step_sees_one_coherent_sequence():
    config = LookaheadConfig(max_window_size=3, max_ngram_size=4, max_verification_set_size=2)
    decoder = LookaheadDecoder(config, seed=1)
    state = decoder.new_state([3, 4, 5, 3, 4, 6])
    state.levels = [[11, 12, 13], [21, 22, 23], [31, 32, 33]]
    step = decoder.build_step(state, root=3)
    assert step.tree.tokens[:2] == [4, 6] or step.tree.tokens[:2] == [4, 5]
    context = [9, 9, 9]
    positions = [len(context) + o for o in step.position_offsets]
    for row in range(len(step.tokens)):
        visible_sequence(context, step.tokens, positions, step.mask, row)  # asserts coherence
    # level 2, column 1: root, level 0 columns 0..1, then column 1 of levels 1 and 2
    row = step.window_start + 2 * 3 + 1
    assert visible_sequence(context, step.tokens, positions, step.mask, row) == [9, 9, 9, 3, 11, 12, 22, 32]


def test_window_harvests_ngrams_once_full_and_shifts_by_the_committed_tokens():
    config = LookaheadConfig(max_window_size=2, max_ngram_size=3, max_verification_set_size=4)
    decoder = LookaheadDecoder(config, pool_from_history=False)
    state = decoder.new_state([1])
    state.levels = [[10, 11], [20, 21]]
    step = decoder.build_step(state, root=1)
    argmax = [0] * len(step.tokens)
    for row, token in zip(step.top_level_rows(), [30, 31]):
        argmax[row] = token
    decoder.advance_window(state, step, argmax, num_committed=1)
    assert state.pool.candidates(10) == [(20, 30)] and state.pool.candidates(11) == [(21, 31)]
    assert state.levels == [[20, 21], [30, 31]]
    step = decoder.build_step(state, root=1)
    decoder.advance_window(state, step, [0] * len(step.tokens), num_committed=2)
    assert state.levels == [[31, 31], [0, 0]]


@pytest.mark.parametrize("window, ngram, verify", [(4, 3, 4), (5, 4, 3), (1, 2, 1), (7, 5, 7)])
@pytest.mark.parametrize("prompt", [[1, 2, 3], [7], [4, 9, 4, 9, 4, 9, 2, 2, 5, 11, 3, 8]])
def test_greedy_output_is_identical_to_plain_greedy(window, ngram, verify, prompt):
    config = LookaheadConfig(max_window_size=window, max_ngram_size=ngram, max_verification_set_size=verify)
    tokens, forwards = lookahead_generate(toy_forward, prompt, 40, config, seed=3)
    assert tokens == greedy_reference(prompt, 40)
    assert forwards <= 40


def test_lookahead_saves_forwards_on_a_repetitive_continuation():
    config = LookaheadConfig(max_window_size=5, max_ngram_size=4, max_verification_set_size=5)
    tokens, forwards = lookahead_generate(toy_forward, [1, 2, 3], 60, config)
    assert tokens == greedy_reference([1, 2, 3], 60)
    assert forwards < 40  # the toy sequence cycles, so pooled n-grams get accepted


def test_the_jacobi_window_alone_finds_accepted_ngrams():
    config = LookaheadConfig(max_window_size=7, max_ngram_size=5, max_verification_set_size=7)
    tokens, forwards = lookahead_generate(toy_forward, [1, 2, 3], 60, config, pool_from_history=False)
    assert tokens == greedy_reference([1, 2, 3], 60)
    assert forwards < 40


def test_a_wrong_mask_is_caught_by_the_oracle():
    config = LookaheadConfig(max_window_size=3, max_ngram_size=3, max_verification_set_size=2)
    decoder = LookaheadDecoder(config)
    state = decoder.new_state([1, 2, 3])
    state.levels = [[4, 5, 6], [7, 8, 9]]
    step = decoder.build_step(state, root=3)
    toy_forward([1, 2], step.tokens, [2 + o for o in step.position_offsets], step.mask)
    broken = torch.tril(torch.ones_like(step.mask))  # plain causal over the flat list: wrong for a window
    with pytest.raises(AssertionError):
        toy_forward([1, 2], step.tokens, [2 + o for o in step.position_offsets], broken)
