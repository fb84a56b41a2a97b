"""Phi-3 against Hugging Face transformers, greedy in fp32, token for token: the tiny Phi-3 (fused qkv and gate-up
checkpoint tensors) with a sliding window shorter than its prompts, and the tiny longrope Phi-3 in both of its
regimes, alone, batched, in chunks and over reused prefixes; speculative and guided decoding on it; the Phi-3
settings the engine refuses; and the real models' RoPE and windows as config.json gives them."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tritonllm.checkpoints.shapes import SHAPES, write_model_shape
from tritonllm.checkpoints.tiny import TINY_ORIGINAL_CONTEXT, TINY_SLIDING_WINDOW, build_tiny_model
from tritonllm.engine.embedded.loader import ModelLoadError, load_model, read_model_config
from tritonllm.engine.embedded.network.model_config import ModelConfig
from tritonllm.engine.embedded.network.phi3 import Phi3ForCausalLM
from tritonllm.engine.embedded.network.rope import rope_frequencies
from tritonllm.engine.types import GuidedDecodingParams, SamplingParams

from .test_engine_parity import PROMPTS, assert_all_blocks_free, greedy, hf_greedy, make_engine

MAX_NEW = 24
# Prompts that leave room for 8 tokens or more within the longrope model's pre-training context, and prompts past it
# from their first token on.
SHORT_PROMPTS = ["Hello", "The quick brown fox", "Once upon a time, in a small village", PROMPTS[3]]
LONG_PROMPTS = [PROMPTS[4], PROMPTS[2] + " " + PROMPTS[1], PROMPTS[1] + " " + PROMPTS[3] + " " + PROMPTS[2]]


def with_config(model_dir, target, **changes):
    """A copy of the model folder with config.json changed."""
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def with_rope(model_dir, target, **changes):
    """A copy with the longrope settings changed, in both places the config holds them."""
    config = json.loads((model_dir / "config.json").read_text())
    rope = {key: {**config[key], **changes} for key in ("rope_parameters", "rope_scaling")}
    return with_config(model_dir, target, **rope)


def run_all(engine, tokenizer, prompt_ids, max_tokens):
    handles = [engine.generate_async(ids, greedy(tokenizer, n)) for ids, n in zip(prompt_ids, max_tokens)]
    return [h.result().outputs[0].token_ids for h in handles]


def hf_each(model_dir, prompt_ids, max_tokens, eos_id):
    return [hf_greedy(model_dir, [ids], n, eos_id)[0] for ids, n in zip(prompt_ids, max_tokens)]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """The tiny Phi-3 given a window of TINY_SLIDING_WINDOW tokens (Phi-3-mini-4k's layout: every layer)."""
    base = build_tiny_model(tmp_path_factory.mktemp("phi3"), seed=1, arch="phi3")
    model_dir = with_config(base, tmp_path_factory.mktemp("phi3w") / "m", sliding_window=TINY_SLIDING_WINDOW)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = hf_greedy(model_dir, prompt_ids, MAX_NEW, tokenizer.eos_token_id)
    assert max(len(ids) for ids in prompt_ids) > 2 * TINY_SLIDING_WINDOW
    assert hf_greedy(base, prompt_ids, MAX_NEW, tokenizer.eos_token_id) != expected  # the window matters
    return model_dir, tokenizer, prompt_ids, expected


@pytest.fixture(scope="module")
def longrope(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("phi3_longrope"), seed=2, arch="phi3-longrope")
    return model_dir, AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def long_regime(longrope):
    """Prompts longer than the pre-training context: transformers rotates them all with the long factors."""
    model_dir, tokenizer = longrope
    prompt_ids = [tokenizer.encode(p) for p in LONG_PROMPTS]
    assert min(len(ids) for ids in prompt_ids) > TINY_ORIGINAL_CONTEXT
    max_tokens = [MAX_NEW] * len(prompt_ids)
    return prompt_ids, max_tokens, hf_each(model_dir, prompt_ids, max_tokens, tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def short_regime(longrope):
    """Sequences that stay within the pre-training context: the short factors throughout."""
    model_dir, tokenizer = longrope
    prompt_ids = [tokenizer.encode(p) for p in SHORT_PROMPTS]
    max_tokens = [min(MAX_NEW, TINY_ORIGINAL_CONTEXT - len(ids)) for ids in prompt_ids]
    assert min(max_tokens) >= 8
    return prompt_ids, max_tokens, hf_each(model_dir, prompt_ids, max_tokens, tokenizer.eos_token_id)


# ---- the checkpoint ----


def test_tiny_phi3_checkpoint_holds_fused_projections(longrope):
    model_dir, _ = longrope
    names = set(load_file(str(model_dir / "model.safetensors")))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.1.mlp.gate_up_proj.weight" in names
    assert not any(re.search(r"\.(q|k|v|gate|up)_proj\.", name) for name in names)
    model, config = load_model(model_dir, torch.float32, "cpu")
    assert isinstance(model, Phi3ForCausalLM) and config.model_type == "phi3"


def test_split_projections_in_a_phi3_checkpoint_are_an_error_naming_the_tensor(longrope, tmp_path):
    model_dir, _ = longrope
    broken = shutil.copytree(model_dir, tmp_path / "split")
    weights = load_file(str(broken / "model.safetensors"))
    weights["model.layers.0.self_attn.q_proj.weight"] = weights.pop("model.layers.0.self_attn.qkv_proj.weight")[:64]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="unexpected tensor model.layers.0.self_attn.q_proj.weight"):
        load_model(broken, torch.float32, "cpu")


# ---- Phi-3 with a sliding window ----


@pytest.mark.parametrize("backend", ["VANILLA", "TRITON"])
def test_windowed_phi3_alone_and_batched_match_hf(phi3, backend):
    model_dir, tokenizer, prompt_ids, expected = phi3
    engine = make_engine(model_dir, attn_backend=backend)
    try:
        assert engine.core.attention_windows == (TINY_SLIDING_WINDOW,) * 2
        if backend == "TRITON":  # the interpreter is slow: two prompts, the long one among them
            assert run_all(engine, tokenizer, prompt_ids[3:], [MAX_NEW] * 2) == expected[3:]
            return
        assert engine.generate(prompt_ids[4], greedy(tokenizer, MAX_NEW)).outputs[0].token_ids == expected[4]
        assert run_all(engine, tokenizer, prompt_ids, [MAX_NEW] * len(prompt_ids)) == expected
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_windowed_phi3_chunked_prefill_and_prefix_reuse_match_hf(phi3):
    model_dir, tokenizer, prompt_ids, expected = phi3
    kv = {"tokens_per_block": 8, "max_tokens": 4096, "enable_block_reuse": True}
    engine = make_engine(model_dir, enable_chunked_prefill=True, max_num_tokens=8, kv_cache_config=kv)
    try:
        assert run_all(engine, tokenizer, prompt_ids, [MAX_NEW] * len(prompt_ids)) == expected
        handles = [engine.generate_async(ids, greedy(tokenizer, MAX_NEW)) for ids in prompt_ids]
        second = [h.result() for h in handles]
        assert [o.outputs[0].token_ids for o in second] == expected
        assert sum(o.outputs[0].request_perf_metrics.kv_cache_reused_blocks for o in second) > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_ngram_drafts_keep_hf_greedy_output(phi3):
    model_dir, tokenizer, prompt_ids, expected = phi3
    spec = {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}
    engine = make_engine(model_dir, speculative_config=spec)
    try:
        assert run_all(engine, tokenizer, prompt_ids[1:4], [MAX_NEW] * 3) == expected[1:4]
    finally:
        engine.shutdown()


def test_guided_regex_holds_on_phi3(phi3):
    model_dir, tokenizer, prompt_ids, _ = phi3
    pattern = r"(yes|no), [a-z]{2,5} [0-9]{1,3}!"
    engine = make_engine(model_dir, guided_decoding_backend="xgrammar")
    try:
        params = SamplingParams(max_tokens=60, guided_decoding=GuidedDecodingParams(regex=pattern))
        (out,) = engine.generate(prompt_ids[1], params).outputs
        assert out.finish_reason == "stop"
        assert re.fullmatch(pattern, tokenizer.decode(out.token_ids, skip_special_tokens=False))
    finally:
        engine.shutdown()


# ---- longrope ----


def test_each_factor_set_changes_what_hf_generates(longrope, long_regime, short_regime, tmp_path):
    """Else parity below could not tell the short factors from the long ones: long prompts with the short set in
    place of the long one, and short ones with the long set in place of the short one, generate otherwise."""
    model_dir, tokenizer = longrope
    factors = json.loads((model_dir / "config.json").read_text())["rope_parameters"]
    short_only = with_rope(model_dir, tmp_path / "short_only", long_factor=factors["short_factor"])
    long_only = with_rope(model_dir, tmp_path / "long_only", short_factor=factors["long_factor"])
    for folder, (prompt_ids, max_tokens, expected) in ((short_only, long_regime), (long_only, short_regime)):
        assert hf_each(folder, prompt_ids, max_tokens, tokenizer.eos_token_id) != expected


def test_long_prompts_match_hf_alone_batched_chunked_and_reused(longrope, long_regime):
    model_dir, tokenizer = longrope
    prompt_ids, max_tokens, expected = long_regime
    kv = {"tokens_per_block": 8, "max_tokens": 4096, "enable_block_reuse": True}
    engine = make_engine(model_dir, enable_chunked_prefill=True, max_num_tokens=8, kv_cache_config=kv)
    try:
        assert engine.core.max_seq_len > TINY_ORIGINAL_CONTEXT + 1  # so the engine rotates with the long factors
        assert engine.generate(prompt_ids[0], greedy(tokenizer, MAX_NEW)).outputs[0].token_ids == expected[0]
        assert run_all(engine, tokenizer, prompt_ids, max_tokens) == expected
        again = [engine.generate_async(ids, greedy(tokenizer, n)).result() for ids, n in zip(prompt_ids, max_tokens)]
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.outputs[0].request_perf_metrics.kv_cache_reused_blocks for o in again) > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_long_prompts_match_hf_on_the_triton_kernels(longrope, long_regime):
    model_dir, tokenizer = longrope
    prompt_ids, _, expected = long_regime
    engine = make_engine(model_dir, attn_backend="TRITON")
    try:
        assert run_all(engine, tokenizer, prompt_ids[:2], [8, 8]) == [out[:8] for out in expected[:2]]
    finally:
        engine.shutdown()


def test_short_context_engine_matches_hf_with_the_short_factors(longrope, short_regime):
    """max_seq_len within the pre-training context (+1: the last token is never fed back): the short set."""
    model_dir, tokenizer = longrope
    prompt_ids, max_tokens, expected = short_regime
    kv = {"tokens_per_block": 8, "max_tokens": 4096, "enable_block_reuse": True}
    engine = make_engine(
        model_dir,
        max_seq_len=TINY_ORIGINAL_CONTEXT + 1,
        enable_chunked_prefill=True,
        max_num_tokens=8,
        kv_cache_config=kv,
    )
    try:
        assert run_all(engine, tokenizer, prompt_ids, max_tokens) == expected
        assert run_all(engine, tokenizer, prompt_ids, max_tokens) == expected  # over the reused prefixes
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_a_long_context_engine_rotates_short_sequences_with_the_long_factors(longrope, short_regime, tmp_path):
    """The documented difference: transformers would use the short factors while a sequence stays within the
    pre-training context; an engine that admits longer sequences uses the long ones throughout, which equals
    transformers with the long factors in place of the short."""
    model_dir, tokenizer = longrope
    prompt_ids, max_tokens, _ = short_regime
    config = json.loads((model_dir / "config.json").read_text())["rope_parameters"]
    long_only = with_rope(model_dir, tmp_path / "long_only", short_factor=config["long_factor"])
    expected = hf_each(long_only, prompt_ids, max_tokens, tokenizer.eos_token_id)
    engine = make_engine(model_dir)
    try:
        assert run_all(engine, tokenizer, prompt_ids, max_tokens) == expected
    finally:
        engine.shutdown()


# ---- the real models' settings ----


@pytest.mark.parametrize("context_len", [None, 4096, 4097, 131071])
def test_phi35_longrope_frequencies_match_hf(tmp_path, context_len):
    folder = write_model_shape("phi-3.5-mini-instruct", tmp_path / "phi35")
    parsed = read_model_config(folder)
    inv_freq, attention_factor = rope_frequencies(parsed.rope, parsed.head_dim, context_len)
    hf_freq, hf_factor = ROPE_INIT_FUNCTIONS["longrope"](AutoConfig.from_pretrained(folder), "cpu", seq_len=context_len)
    assert torch.equal(inv_freq, hf_freq) and attention_factor == pytest.approx(hf_factor, rel=1e-12)
    assert parsed.rope.params["factor"] == 32.0 and attention_factor == pytest.approx(1.1902380714238083)


def test_phi3_mini_4k_slides_on_every_layer_and_phi35_window_is_past_every_position(tmp_path):
    mini = read_model_config(write_model_shape("phi-3-mini-4k-instruct", tmp_path / "mini"))
    assert mini.layer_windows == (2047,) * 32 and mini.rope.rope_type == "default"
    phi35 = read_model_config(write_model_shape("phi-3.5-mini-instruct", tmp_path / "phi35"))
    assert phi35.sliding_window == 262144 > SHAPES["phi-3.5-mini-instruct"]["max_position_embeddings"]


def phi3_raw(**overrides):
    base = dict(
        architectures=["Phi3ForCausalLM"],
        model_type="phi3",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=4096,
        original_max_position_embeddings=32,
    )
    return {**base, **overrides}


LONGROPE = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),  # Phi-4-mini's layout
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "RoPE type 'linear' is not supported for phi3"),
        ({"rope_scaling": {**LONGROPE, "short_factor": [1.0] * 7}}, "rope_scaling.short_factor"),
        ({"rope_scaling": {**LONGROPE, "long_factor": None}}, "rope_scaling.long_factor"),
        ({"rope_scaling": LONGROPE, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_phi3_settings_are_errors_naming_them(overrides, named):
    with pytest.raises(ModelLoadError, match=re.escape(named)):
        ModelConfig.from_dict(phi3_raw(**overrides))


def test_su_is_read_as_longrope_and_longrope_is_phi3_only():
    parsed = ModelConfig.from_dict(phi3_raw(rope_scaling={**LONGROPE, "type": "su"}))
    assert (parsed.rope.rope_type, parsed.rope.params["factor"]) == ("longrope", 4096 / 32)
    assert (parsed.qkv_bias, parsed.o_bias, parsed.mlp_bias) == (False, False, False)
    llama = {**phi3_raw(rope_scaling=LONGROPE), "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    with pytest.raises(ModelLoadError, match="'longrope' is not supported for llama"):
        ModelConfig.from_dict(llama)


def test_long_prompts_match_hf_in_cuda_graphs(longrope, long_regime, graphs_on_this_device):
    """Decode graphs hold the longrope frequencies fixed at load (graphs_on_this_device: eager replays on CPU)."""
    model_dir, tokenizer = longrope
    prompt_ids, max_tokens, expected = long_regime
    engine = make_engine(model_dir)
    try:
        assert run_all(engine, tokenizer, prompt_ids, max_tokens) == expected
        assert engine.core.runner.graphs.replays > 0
    finally:
        engine.shutdown()
