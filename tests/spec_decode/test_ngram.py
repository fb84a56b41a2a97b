"""Prompt-lookup proposals: longest suffix match first, what followed it, capped by the draft budget."""

from tritonllm.spec_decode.config import NGramConfig
from tritonllm.spec_decode.ngram import NGramProposer, find_continuation
from tritonllm.spec_decode.proposer import ProposalInput


def test_longest_suffix_match_wins():
    tokens = [7, 3, 8, 2, 3, 6, 5, 2, 3]
    # [2, 3] occurred at 3 (followed by 6, 5); [3] alone first occurred at 1 (followed by 8, 2)
    assert find_continuation(tokens, max_ngram=2, num_draft=2) == [6, 5]
    assert find_continuation(tokens, max_ngram=1, num_draft=2) == [8, 2]


def test_oldest_or_newest_occurrence():
    tokens = [5, 1, 5, 2, 5]
    assert find_continuation(tokens, 1, 1, use_oldest=True) == [1]
    assert find_continuation(tokens, 1, 1, use_oldest=False) == [2]


def test_no_match_or_no_budget_gives_nothing():
    assert find_continuation([1, 2, 3, 4], 3, 4) == []
    assert find_continuation([1, 2, 1, 2], 2, 0) == []
    assert find_continuation([1], 2, 3) == []


def test_the_suffix_itself_never_counts_as_a_match():
    assert find_continuation([4, 4], 2, 2) == [4]  # [4] at 0 followed by 4; [4, 4] has no earlier occurrence


def test_continuation_is_cut_at_the_end_of_the_history():
    assert find_continuation([1, 2, 3, 1, 2], 2, 10) == [3, 1, 2]


def test_proposer_returns_chains_capped_by_each_inputs_budget():
    proposer = NGramProposer(NGramConfig(max_draft_len=3, max_matching_ngram_size=2))
    trees = proposer.propose(
        [
            ProposalInput(0, [1, 2, 3, 4, 5, 1, 2]),
            ProposalInput(1, [1, 2, 3, 4, 5, 1, 2], max_draft_tokens=1),
            ProposalInput(2, [9, 8, 7]),
        ]
    )
    assert [t.tokens for t in trees] == [[3, 4, 5], [3], []]
    assert all(t.is_chain for t in trees)
