"""Sampling features and request validation of the embedded engine, on the tiny llama."""

import pytest
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.types import InvalidRequestError, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog, and then"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3, arch="llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(model_dir),
                "dtype": "float32",
                "device": "cpu",
                "max_batch_size": 8,
                "max_seq_len": 256,
                "max_num_tokens": 256,
                "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 2048},
            }
        )
    )
    yield engine, tokenizer, tokenizer.encode(PROMPT)
    stats = engine.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks
    engine.shutdown()


def run(engine, ids, **params):
    params.setdefault("max_tokens", 16)
    return engine.generate(ids, SamplingParams(**params)).outputs


def tokens(engine, ids, **params):
    return run(engine, ids, **params)[0].token_ids


def test_same_seed_same_output_and_seeds_differ(setup):
    engine, _, ids = setup
    sampled = dict(temperature=1.0, max_tokens=24)
    first = tokens(engine, ids, seed=7, **sampled)
    assert tokens(engine, ids, seed=7, **sampled) == first
    assert any(tokens(engine, ids, seed=s, **sampled) != first for s in (8, 9, 10))


def test_n_samples_are_independent_and_reproducible(setup):
    engine, _, ids = setup
    outputs = run(engine, ids, n=3, temperature=1.0, seed=11, max_tokens=20)
    assert [o.index for o in outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outputs}) > 1
    again = run(engine, ids, n=3, temperature=1.0, seed=11, max_tokens=20)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]


def test_top_k_one_is_greedy_and_top_p_tiny_is_greedy(setup):
    engine, _, ids = setup
    greedy = tokens(engine, ids)
    assert tokens(engine, ids, temperature=1.0, top_k=1, seed=1) == greedy
    assert tokens(engine, ids, temperature=1.0, top_p=1e-6, seed=1) == greedy


def test_end_id_stops_before_the_end_token(setup):
    engine, _, ids = setup
    greedy = tokens(engine, ids)
    stop_at = 5
    out = run(engine, ids, end_id=greedy[stop_at])[0]
    assert out.token_ids == greedy[: greedy.index(greedy[stop_at])] and out.finish_reason == "stop"


def test_stop_words_include_the_word_and_stop(setup):
    engine, _, ids = setup
    greedy = tokens(engine, ids)
    word = greedy[3:5]
    out = run(engine, ids, stop_words=[word])[0]
    assert out.token_ids[-2:] == word and out.finish_reason == "stop" and out.stop_reason == word
    assert len(out.token_ids) <= 5


def test_bad_words_are_never_produced(setup):
    engine, _, ids = setup
    greedy = tokens(engine, ids)
    single = greedy[2]
    assert single not in tokens(engine, ids, bad_words=[[single]])
    pair = greedy[1:3]  # ban greedy[2] only right after greedy[1]
    out = tokens(engine, ids, bad_words=[pair])
    assert all(out[i : i + 2] != pair for i in range(len(out) - 1))


def test_embedding_bias_forces_a_token(setup):
    engine, tokenizer, ids = setup
    bias = [0.0] * len(tokenizer)
    bias[42] = 1e4
    assert tokens(engine, ids, embedding_bias=bias, max_tokens=4) == [42] * 4


def test_min_tokens_bans_the_end_token(setup):
    engine, _, ids = setup
    greedy = tokens(engine, ids)
    out = run(engine, ids, end_id=greedy[0], min_tokens=6, max_tokens=10)[0]
    assert len(out.token_ids) >= 6 and greedy[0] not in out.token_ids[:6]


def test_penalties_change_the_output(setup):
    engine, _, ids = setup
    greedy = tokens(engine, ids, max_tokens=48)
    assert len(set(greedy)) < len(greedy)  # the penalties only bite once a token repeats
    for penalty in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
        assert tokens(engine, ids, max_tokens=48, **{penalty: 5.0}) != greedy, penalty
        overwhelming = tokens(engine, ids, max_tokens=48, **{penalty: 1e4})
        assert len(set(overwhelming)) == len(overwhelming), penalty


def test_log_probs_are_consistent(setup):
    engine, _, ids = setup
    out = run(engine, ids, logprobs=True)[0]
    assert len(out.logprobs) == len(out.token_ids)
    assert all(lp <= 0 for lp in out.logprobs)
    assert out.cumulative_logprob == pytest.approx(sum(out.logprobs), abs=1e-4)


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(max_tokens=0), "max_tokens must be an integer > 0"),
        (dict(max_tokens=-3), "max_tokens must be an integer > 0"),
        (dict(top_p=0.0, temperature=1.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5, temperature=1.0), "top_p must be in (0, 1]"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(max_tokens=250), "exceeds max_seq_len 256"),
    ],
)
def test_bad_sampling_values_are_clear_errors(setup, params, message):
    engine, _, ids = setup
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.generate_async(ids, SamplingParams(**params))


def test_prompt_longer_than_max_seq_len_is_an_error(setup):
    engine, _, _ = setup
    with pytest.raises(InvalidRequestError, match="exceeds max_seq_len 256"):
        engine.generate_async([5] * 300, SamplingParams(max_tokens=4))


def test_token_outside_vocabulary_and_empty_prompt_are_errors(setup):
    engine, _, _ = setup
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.generate_async([5, 10**6], SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        engine.generate_async([], SamplingParams(max_tokens=4))


def test_unsupported_settings_fail_at_start(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", seed=0)
    with pytest.raises(ConfigError, match="speculative_config.decoding_type"):
        EngineConfig.from_dict({"model": str(model_dir), "speculative_config": {"x": 1}})
    with pytest.raises(InvalidRequestError, match="speculative_model_dir: .*an EAGLE-3 draft has one layer"):
        EmbeddedEngine(
            EngineConfig.from_dict(
                {
                    "model": str(model_dir),
                    "speculative_config": {"decoding_type": "Eagle3", "speculative_model_dir": str(model_dir)},
                }
            )
        )
    with pytest.raises(InvalidRequestError, match="unknown_key"):
        EmbeddedEngine(EngineConfig.from_dict({"model": str(model_dir), "unknown_key": 3}))


def test_a_draft_trees_greedy_rows_are_chosen_at_once_as_row_by_row():
    import torch

    from tritonllm.engine.embedded.sampler import plain_greedy_choices, sample
    from tritonllm.engine.embedded.sequence import Sequence

    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))

    def seq(**params):
        return Sequence(0, 0, 0, [1, 2, 3], SamplingParams(max_tokens=8, **params))

    plain = seq()
    expected = [sample(logits[row : row + 1].clone(), [plain]) for row in range(5)]
    assert plain_greedy_choices(plain, logits) == [(tokens[0], logprobs[0]) for tokens, logprobs in expected]
    # Rows a processor changes (or will, as tokens are committed along the tree) are left to `sample`.
    for params in ({"repetition_penalty": 1.2}, {"bad_words": [[4]]}, {"min_tokens": 2}, {"temperature": 0.7}):
        assert plain_greedy_choices(seq(**params), logits) is None
