"""Sliding-window attention against Hugging Face transformers: the tiny Mistral (a window of TINY_SLIDING_WINDOW
tokens) with prompts and outputs longer than its window, greedy in fp32, token for token. Alone, together in one
batch, in chunks, over reused prefixes, with speculative drafts, on both attention backends; and TensorRT-LLM's
per-layer `max_attention_window_size` of the tensorrt_llm model on a model that has no window of its own."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import TINY_SLIDING_WINDOW, build_tiny_model
from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.embedded.attention.windows import layer_windows
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.types import InvalidRequestError

from .test_engine_parity import DEVICE, PROMPTS, assert_all_blocks_free, greedy, hf_greedy, make_engine

MAX_NEW = 30
BACKENDS = ["VANILLA", "TRITON"]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("mistral"), seed=1, arch="mistral")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = hf_greedy(model_dir, prompt_ids, MAX_NEW, tokenizer.eos_token_id)
    assert all(len(ids) + len(out) > TINY_SLIDING_WINDOW for ids, out in zip(prompt_ids, expected))
    assert max(len(ids) for ids in prompt_ids) > 2 * TINY_SLIDING_WINDOW
    return model_dir, tokenizer, prompt_ids, expected


def with_config(model_dir, target, **changes):
    """A copy of the model folder with config.json changed."""
    shutil.copytree(model_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def run_all(engine, tokenizer, prompt_ids, max_tokens=MAX_NEW):
    handles = [engine.generate_async(ids, greedy(tokenizer, max_tokens)) for ids in prompt_ids]
    return [h.result().outputs[0].token_ids for h in handles]


def test_the_window_changes_what_hf_generates(mistral, tmp_path):
    """Else parity below could not tell sliding from full attention."""
    model_dir, tokenizer, prompt_ids, expected = mistral
    full = with_config(model_dir, tmp_path / "full", sliding_window=None)
    assert hf_greedy(full, prompt_ids, MAX_NEW, tokenizer.eos_token_id) != expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_alone_and_batched_match_hf(mistral, backend):
    model_dir, tokenizer, prompt_ids, expected = mistral
    engine = make_engine(model_dir, attn_backend=backend)
    try:
        assert engine.core.attention_windows == (TINY_SLIDING_WINDOW,) * 2
        assert engine.core.max_seq_len > TINY_SLIDING_WINDOW  # no longer capped at the window
        alone = [engine.generate(ids, greedy(tokenizer, MAX_NEW)).outputs[0].token_ids for ids in prompt_ids[1:3]]
        assert alone == expected[1:3]
        assert run_all(engine, tokenizer, prompt_ids) == expected
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_prefix_reuse_match_hf(mistral, backend):
    """Chunks of 8 tokens cross the window; the second round reuses the prompts' cached blocks."""
    model_dir, tokenizer, prompt_ids, expected = mistral
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_lookahead_drafts_keep_hf_greedy_output(mistral, backend):
    """Lookahead's draft trees and Jacobi window: each node measures its window from its own position."""
    model_dir, tokenizer, prompt_ids, expected = mistral
    spec = {"decoding_type": "Lookahead", "max_window_size": 3, "max_ngram_size": 3, "max_verification_set_size": 3}
    engine = make_engine(model_dir, attn_backend=backend, speculative_config=spec)
    try:
        assert run_all(engine, tokenizer, prompt_ids[1:4]) == expected[1:4]
    finally:
        engine.shutdown()


# The interpreter is slow on padded graph steps: the kernels' graphs take fewer prompts.
@pytest.mark.parametrize(
    "backend, speculative, prompts", [("VANILLA", False, 4), ("VANILLA", True, 4), ("TRITON", True, 2)]
)
def test_cuda_graphs_match_hf(mistral, graphs_on_this_device, backend, speculative, prompts):
    """Graphs hold each layer's window as a constant and measure it from their static positions (padding rows at
    0); speculative steps run in graphs of several rows a sequence."""
    model_dir, tokenizer, prompt_ids, expected = mistral
    spec = {"decoding_type": "Lookahead", "max_window_size": 2, "max_ngram_size": 3, "max_verification_set_size": 2}
    engine = make_engine(model_dir, attn_backend=backend, speculative_config=spec if speculative else None)
    try:
        assert run_all(engine, tokenizer, prompt_ids[1 : 1 + prompts]) == expected[1 : 1 + prompts]
        assert engine.core.runner.graphs.replays > 0
    finally:
        engine.shutdown()


def test_drafts_deeper_than_the_window_are_refused(mistral):
    model_dir, *_ = mistral
    spec = {"decoding_type": "NGram", "max_draft_len": TINY_SLIDING_WINDOW, "max_matching_ngram_size": 3}
    with pytest.raises(InvalidRequestError, match="attention window"):
        make_engine(model_dir, speculative_config=spec)


def test_per_layer_max_attention_window_size_matches_hf(mistral, tmp_path):
    """The tensorrt_llm model's `max_attention_window_size` = "16,4096" (cycled over the layers: layer 0 slides
    over 16 tokens, layer 1 over 4096 >= max_seq_len, so full) on the Mistral made window-less (sliding_window
    null) equals transformers' own per-layer sliding: HF's Qwen2 layout with layer_types [sliding, full]."""
    from tritonllm.triton.engine_args import load_tensorrt_llm_settings

    model_dir, tokenizer, prompt_ids, _ = mistral
    full = with_config(model_dir, tmp_path / "full", sliding_window=None)
    per_layer = with_config(
        model_dir,
        tmp_path / "per_layer",
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        use_sliding_window=True,
        sliding_window=TINY_SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
    )
    expected = _hf_greedy_qwen2_without_biases(per_layer, prompt_ids, tokenizer)
    parameters = {
        "gpt_model_path": str(full),
        "max_attention_window_size": f"{TINY_SLIDING_WINDOW},4096",
        "max_seq_len": "256",
        "dtype": "float32",
        "device": DEVICE,
    }
    triton_config = {
        "name": "tensorrt_llm",
        "max_batch_size": 8,
        "parameters": {key: {"string_value": value} for key, value in parameters.items()},
    }
    (tmp_path / "tensorrt_llm" / "1").mkdir(parents=True)
    engine_config = load_tensorrt_llm_settings(triton_config, tmp_path / "tensorrt_llm").engine
    assert engine_config.kv_cache_config.max_attention_window == [TINY_SLIDING_WINDOW, 4096]
    engine = EmbeddedEngine(engine_config)
    try:
        assert engine.core.attention_windows == (TINY_SLIDING_WINDOW, None)
        assert run_all(engine, tokenizer, prompt_ids) == expected
    finally:
        engine.shutdown()


def _hf_greedy_qwen2_without_biases(model_dir, prompt_ids, tokenizer):
    """HF's Qwen2 always has q/k/v biases: zero ones added to the folder leave it the Mistral's network."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model_dir / "model.safetensors"))
    for name in list(weights):
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            weights[name.replace(".weight", ".bias")] = torch.zeros(weights[name].shape[0])
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return hf_greedy(model_dir, prompt_ids, MAX_NEW, tokenizer.eos_token_id)


def test_windows_resolve_per_layer_as_tensorrt_llm_repeats_them():
    assert layer_windows((), [8, 32], 5, 100) == (8, 32, 8, 32, 8)
    assert layer_windows((16, 16, None), None, 3, 100) == (16, 16, None)
    assert layer_windows((16, None, 16), [8, 200], 3, 100) == (8, None, 8)  # the smaller wins; >= max_seq_len: full
    assert layer_windows((), [8, 9, 10], 2, 100) == (8, 9)  # extra entries unused, as upstream


@pytest.mark.parametrize("windows", [[], [0], [-4], [8, "16"], [True], 16, [2.5]])
def test_bad_max_attention_window_is_an_error_naming_it(windows):
    with pytest.raises(ConfigError, match="kv_cache_config.max_attention_window"):
        EngineConfig.from_dict({"model": "m", "kv_cache_config": {"max_attention_window": windows}})
