"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers: the tiny models (`--arch gemma2`: a sliding and a
global layer, attention and final logit soft-capping; `--arch gemma3`: 5 sliding layers to 1 global, their own RoPE
base, linear RoPE scaling on the global one, q/k norms), greedy in fp32, token for token, with prompts longer than
the window: alone, in one batch, in chunks, over reused prefixes, on both attention backends (the Triton kernels
in one lean case on CPU, where they run interpreted); with speculative drafts and guided decoding. And config.json
parsing: the layer kinds, both RoPE dialects, what is refused."""

import json
import re
import shutil

import pytest
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import TINY_SLIDING_WINDOW, build_tiny_model
from tritonllm.engine.embedded.loader import load_model
from tritonllm.engine.embedded.network.gemma import GemmaForCausalLM
from tritonllm.engine.embedded.network.model_config import ModelConfig, ModelLoadError
from tritonllm.engine.types import GuidedDecodingParams, InvalidRequestError, SamplingParams

from .test_engine_parity import DEVICE, PROMPTS, assert_all_blocks_free, greedy, make_engine
from .test_engine_parity import hf_greedy as hf_greedy_sdpa

MAX_NEW = 30
# Triton's interpreter runs a whole engine slowly: on CPU the kernels get test_triton_kernels_match_hf's lean case
# (and test_softcap_attention.py's), on CUDA every engine test below as well.
BACKENDS = ["VANILLA", "TRITON"] if DEVICE == "cuda" else ["VANILLA"]
LEAN_NEW = 6  # tokens the lean Triton case generates
ARCHS = ["gemma2", "gemma3"]


def hf_greedy(model_dir, prompt_ids, max_new, eos_id):
    """transformers' greedy output with its eager attention, the one that soft-caps (SDPA, its default on some
    versions and devices, silently skips Gemma 2's attention soft-capping)."""
    return hf_greedy_sdpa(model_dir, prompt_ids, max_new, eos_id, attn_implementation="eager")


@pytest.fixture(scope="module", params=ARCHS)
def gemma(request, tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), seed=1, arch=request.param)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = hf_greedy(model_dir, prompt_ids, MAX_NEW, tokenizer.eos_token_id)
    assert max(len(ids) for ids in prompt_ids) > 2 * TINY_SLIDING_WINDOW
    assert all(len(set(out)) > 3 for out in expected if len(out) > 8)  # the tiny model does not just repeat
    return request.param, model_dir, tokenizer, prompt_ids, expected


def with_config(model_dir, target, **changes):
    """A copy of the model folder with config.json changed."""
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def run_all(engine, tokenizer, prompt_ids, max_tokens=MAX_NEW, **extra):
    handles = [engine.generate_async(ids, greedy(tokenizer, max_tokens, **extra)) for ids in prompt_ids]
    return [h.result().outputs[0].token_ids for h in handles]


# What each tiny model's Gemma parts change in transformers' own output (else parity could not tell them apart).
# The final soft-cap is monotonic, so greedy tokens cannot show it: the context logits test does.
FEATURE_CHANGES = {
    "gemma2": {
        "sliding window": dict(layer_types=["full_attention"] * 2),
        "attention soft-capping": dict(attn_logit_softcapping=None),
        "query_pre_attn_scalar": dict(query_pre_attn_scalar=16),
    },
    "gemma3": {
        "sliding window": dict(layer_types=["full_attention"] * 6),
        "local RoPE base": dict(
            rope_local_base_freq=1_000_000.0,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1_000_000.0),
                sliding_attention=dict(rope_type="default", rope_theta=1_000_000.0),
            ),
        ),
        "global RoPE scaling": dict(
            rope_scaling=None,
            rope_parameters=dict(
                full_attention=dict(rope_type="default", rope_theta=1_000_000.0),
                sliding_attention=dict(rope_type="default", rope_theta=10_000.0),
            ),
        ),
    },
}


def test_each_gemma_feature_changes_what_hf_generates(gemma, tmp_path):
    arch, model_dir, tokenizer, prompt_ids, expected = gemma
    for name, changes in FEATURE_CHANGES[arch].items():
        changed = with_config(model_dir, tmp_path / name.replace(" ", "_"), **changes)
        assert hf_greedy(changed, prompt_ids, MAX_NEW, tokenizer.eos_token_id) != expected, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_alone_and_batched_match_hf(gemma, backend):
    arch, model_dir, tokenizer, prompt_ids, expected = gemma
    engine = make_engine(model_dir, attn_backend=backend)
    try:
        assert isinstance(engine.core.model, GemmaForCausalLM)
        sliding = 1 if arch == "gemma2" else 5
        assert engine.core.attention_windows == (TINY_SLIDING_WINDOW,) * sliding + (None,)
        alone = [engine.generate(ids, greedy(tokenizer, MAX_NEW)).outputs[0].token_ids for ids in prompt_ids[2:]]
        assert alone == expected[2:]
        assert run_all(engine, tokenizer, prompt_ids) == expected
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_prefix_reuse_match_hf(gemma, backend):
    """Chunks of 8 tokens cross the window; the second round reuses the prompts' cached blocks."""
    _, model_dir, tokenizer, prompt_ids, expected = gemma
    kv = {"tokens_per_block": 8, "max_tokens": 4096, "enable_block_reuse": True}
    engine = make_engine(
        model_dir, attn_backend=backend, enable_chunked_prefill=True, max_num_tokens=8, kv_cache_config=kv
    )
    try:
        assert run_all(engine, tokenizer, prompt_ids) == expected
        handles = [engine.generate_async(ids, greedy(tokenizer, MAX_NEW)) for ids in prompt_ids]
        second = [h.result() for h in handles]
        assert [o.outputs[0].token_ids for o in second] == expected
        assert sum(o.outputs[0].request_perf_metrics.kv_cache_reused_blocks for o in second) > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_triton_kernels_match_hf(gemma):
    """The longest prompt (over twice the window) in chunks of 16, then a few decode steps, on the Triton kernels:
    Gemma 2's soft-capped scores and both models' sliding layers through the prefill (whole and chunked) and the
    decode kernels."""
    arch, model_dir, tokenizer, prompt_ids, expected = gemma
    engine = make_engine(model_dir, attn_backend="TRITON", enable_chunked_prefill=True, max_num_tokens=16)
    try:
        assert engine.core.model.layers[0].self_attn.softcap == (4.0 if arch == "gemma2" else None)
        output = engine.generate(prompt_ids[-1], greedy(tokenizer, LEAN_NEW)).outputs[0]
        assert output.token_ids == expected[-1][:LEAN_NEW]
    finally:
        engine.shutdown()


def test_context_logits_are_soft_capped_as_in_hf(gemma):
    """return_context_logits gives the capped logits HF gives (Gemma 2 caps at 6 in the tiny model)."""
    import torch
    from transformers import AutoModelForCausalLM

    arch, model_dir, tokenizer, prompt_ids, _ = gemma
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt_ids[2]])).logits[0]
    engine = make_engine(model_dir)
    try:
        output = engine.generate(prompt_ids[2], greedy(tokenizer, 1, return_context_logits=True))
        torch.testing.assert_close(output.context_logits, reference, atol=1e-4, rtol=1e-4)
        if arch == "gemma2":
            assert reference.abs().max() < 6.0
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "spec",
    [
        {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2},
        {"decoding_type": "Lookahead", "max_window_size": 3, "max_ngram_size": 3, "max_verification_set_size": 3},
    ],
    ids=["ngram", "lookahead"],
)
def test_speculative_drafts_keep_hf_greedy_output(gemma, spec):
    _, model_dir, tokenizer, prompt_ids, expected = gemma
    engine = make_engine(model_dir, speculative_config=spec)
    try:
        assert run_all(engine, tokenizer, prompt_ids[1:4]) == expected[1:4]
    finally:
        engine.shutdown()


def test_a_gemma_draft_model_keeps_hf_greedy_output(gemma):
    """Draft/target with the model as its own draft: every draft token is accepted, and the output is HF's."""
    _, model_dir, tokenizer, prompt_ids, expected = gemma
    spec = {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": str(model_dir)}
    engine = make_engine(model_dir, speculative_config=spec)
    try:
        outputs = [engine.generate(ids, greedy(tokenizer, MAX_NEW)) for ids in prompt_ids[2:4]]
        assert [o.outputs[0].token_ids for o in outputs] == expected[2:4]
    finally:
        engine.shutdown()


def test_eagle_is_refused_by_name(gemma, tmp_path):
    arch, model_dir, *_ = gemma
    spec = {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": str(tmp_path)}
    with pytest.raises(InvalidRequestError, match="decoding_type=Eagle is not supported for Gemma"):
        make_engine(model_dir, speculative_config=spec)


def test_guided_output_is_in_the_language(gemma):
    """A regular expression (no free whitespace, which a random model fills a JSON document with)."""
    _, model_dir, tokenizer, prompt_ids, _ = gemma
    pattern = r"(yes|no), [a-z]{2,5} [0-9]{1,3}!"
    engine = make_engine(model_dir, guided_decoding_backend="xgrammar")
    try:
        guide = GuidedDecodingParams(regex=pattern)
        output = engine.generate(prompt_ids[1], SamplingParams(max_tokens=100, guided_decoding=guide)).outputs[0]
        assert output.finish_reason == "stop"
        assert re.fullmatch(pattern, tokenizer.decode(output.token_ids, skip_special_tokens=True))
    finally:
        engine.shutdown()


# ---- config.json ----


def gemma_config(arch, **changes) -> ModelConfig:
    from tritonllm.checkpoints.tiny import tiny_config

    raw = {**tiny_config(arch, 1000), **changes}
    return ModelConfig.from_dict({k: v for k, v in raw.items() if v is not ...})


def test_the_layer_kinds_default_as_in_transformers():
    gemma2 = gemma_config("gemma2", layer_types=..., num_hidden_layers=4)
    assert gemma2.layer_types == ("sliding_attention", "full_attention") * 2
    assert gemma2.layer_windows == (TINY_SLIDING_WINDOW, None) * 2
    gemma3 = gemma_config("gemma3", layer_types=..., num_hidden_layers=8, sliding_window_pattern=...)
    assert gemma3.layer_windows == (TINY_SLIDING_WINDOW,) * 5 + (None,) + (TINY_SLIDING_WINDOW,) * 2
    pattern_2 = gemma_config("gemma3", layer_types=..., sliding_window_pattern=2)
    assert pattern_2.layer_types == ("sliding_attention", "full_attention") * 3


def test_gemma3_rope_dialects_agree():
    """transformers 5.x's rope_parameters by layer type and 4.x's rope_theta / rope_scaling /
    rope_local_base_freq give the same two RoPEs."""
    v5 = gemma_config("gemma3", rope_theta=..., rope_scaling=..., rope_local_base_freq=...)
    v4 = gemma_config("gemma3", rope_parameters=...)
    for config in (v5, v4):
        assert config.gemma is not None and config.gemma.local_rope is not None
        assert (config.rope.rope_type, config.rope.theta, config.rope.params) == ("linear", 1e6, {"factor": 2.0})
        assert (config.gemma.local_rope.rope_type, config.gemma.local_rope.theta) == ("default", 1e4)
    defaults = gemma_config("gemma3", rope_parameters=..., rope_theta=..., rope_scaling=..., rope_local_base_freq=...)
    assert defaults.gemma is not None and defaults.gemma.local_rope is not None
    assert (defaults.rope.theta, defaults.gemma.local_rope.theta) == (1e6, 1e4)


def test_gemma_settings_and_transformers_defaults():
    gemma2 = gemma_config("gemma2", attn_logit_softcapping=..., final_logit_softcapping=..., query_pre_attn_scalar=...)
    assert gemma2.gemma is not None
    assert (gemma2.gemma.attn_logit_softcapping, gemma2.gemma.final_logit_softcapping) == (50.0, 30.0)
    assert gemma2.gemma.query_pre_attn_scalar == 256 and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert not gemma2.qk_norm
    # Gemma ties its head to the embedding unless the config says otherwise (gemma-2-2b's leaves the key out).
    assert gemma_config("gemma2", tie_word_embeddings=...).tie_word_embeddings
    assert gemma_config("gemma3", tie_word_embeddings=...).tie_word_embeddings
    # transformers' Gemma 3 attention never caps its scores, whatever the config says.
    gemma3 = gemma_config("gemma3", attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    assert gemma3.gemma is not None and gemma3.qk_norm
    assert (gemma3.gemma.attn_logit_softcapping, gemma3.gemma.final_logit_softcapping) == (None, 30.0)
    assert gemma_config("gemma3", head_dim=...).head_dim == 256


@pytest.mark.parametrize(
    "arch, changes, message",
    [
        ("gemma2", dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
        ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention is not supported"),
        ("gemma3", dict(text_config={"hidden_size": 64}), "text_config"),
        ("gemma2", dict(final_logit_softcapping=-1.0), "final_logit_softcapping must be a positive number"),
        ("gemma3", dict(layer_types=["sliding_attention"] * 5), "layer_types must list 6 entries"),
        ("gemma3", dict(layer_types=..., sliding_window_pattern=0), "sliding_window_pattern must be a positive"),
        ("gemma2", dict(architectures=["Gemma3ForConditionalGeneration"]), "unsupported architecture"),
    ],
)
def test_what_is_not_supported_is_a_load_error_naming_it(arch, changes, message):
    with pytest.raises(ModelLoadError, match=message):
        gemma_config(arch, **changes)


def test_dummy_weights_leave_gemma_norms_at_identity(tmp_path):
    import torch

    from tritonllm.engine.embedded.network.layers import OffsetRMSNorm

    folder = build_tiny_model(tmp_path, arch="gemma3")
    (folder / "model.safetensors").unlink()
    model, _ = load_model(folder, torch.float32, "cpu", load_format="dummy")
    norms = [m for m in model.modules() if isinstance(m, OffsetRMSNorm)]
    assert len(norms) == 6 * 6 + 1  # four a layer, q_norm and k_norm, and the final one
    assert all(torch.all(norm.weight == 0) for norm in norms)
