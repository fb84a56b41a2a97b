"""The accuracy bench's text cutting and arithmetic (tritonllm.bench.texts, .scores), without an engine."""

import math

import pytest
import torch

from tritonllm.bench.scores import NegLogLikelihood, rouge_f_means, token_agreement, window_nll
from tritonllm.bench.texts import PASSAGE_NAMES, cut_prompts, load_passages, windows


def test_the_shipped_passages_are_long_english_texts():
    passages = load_passages()
    assert tuple(passages) == PASSAGE_NAMES
    assert all(len(text.split()) > 400 for text in passages.values())


def test_windows_cover_the_tokens_in_order_and_drop_a_lone_last_token():
    assert windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert windows(list(range(8)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        windows([1, 2], 1)


def test_prompts_take_the_passages_in_turn_spread_over_each():
    passages = [list(range(100)), list(range(1000, 1050))]
    prompts = cut_prompts(passages, 5, 10)
    assert [p[0] for p in prompts] == [0, 1000, 30, 1020, 60]  # passage 0 thrice over 90 starts, passage 1 twice
    assert all(len(p) == 10 for p in prompts)
    with pytest.raises(ValueError, match="shortest passage"):
        cut_prompts(passages, 2, 50)


def test_window_nll_scores_each_token_from_the_logits_before_it():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    nll = window_nll(logits, [0, 2, 0])
    expected = -(torch.log_softmax(logits[0], 0)[2] + torch.log_softmax(logits[1], 0)[0])
    assert nll.tokens == 2 and nll.total == pytest.approx(float(expected))
    total = NegLogLikelihood()
    total.add(nll)
    total.add(window_nll(torch.zeros(2, 4), [1, 3]))  # uniform over 4: perplexity 4 for that token
    assert total.tokens == 3 and total.perplexity == pytest.approx(math.exp((float(expected) + math.log(4)) / 3))
    with pytest.raises(ValueError, match="2 rows of context logits for a window of 3"):
        window_nll(torch.zeros(2, 4), [1, 2, 3])


def test_rouge_is_one_for_equal_texts_and_lower_for_drift():
    same = rouge_f_means(["the cat sat on the mat", "!!"], ["the cat sat on the mat", "!!"])
    assert same == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}  # "!!" has no word: equal texts still score 1
    drift = rouge_f_means(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert drift["rouge1"] == pytest.approx(5 / 6) and drift["rouge2"] == pytest.approx(3 / 5)
    assert rouge_f_means(["a b c"], ["x y z"])["rougeL"] == 0.0


def test_token_agreement_counts_positions_up_to_the_longer_continuation():
    assert token_agreement([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5, 6, 7]]) == (4, 7)
    assert token_agreement([], []) == (0, 0)
