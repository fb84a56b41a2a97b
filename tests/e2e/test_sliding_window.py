"""Sliding-window attention through the real tritonserver: the tiny Mistral (its own window of
TINY_SLIDING_WINDOW tokens) with the tensorrt_llm model's `max_attention_window_size` set per layer answers
direct requests, prompts and outputs longer than every window, with the tokens the embedded engine gives
in-process for the same windows (which tests/engine/test_sliding_window.py holds to Hugging Face's)."""

import e2e_clients
import pytest
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import EOS_TOKEN_ID, TINY_SLIDING_WINDOW

from ..engine.test_engine_parity import greedy, hf_greedy, make_engine

pytestmark = pytest.mark.server

# window_server's parameter: layer 0 slides over 8 tokens, layer 1 keeps the model's own window (the smaller wins)
MAX_ATTENTION_WINDOW_SIZE = "8,4096"

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The lighthouse keeper on the northern cape kept a notebook of every ship that passed. Some mornings",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def references(tiny_mistral):
    """(prompt ids, the engine's greedy ids with the server's windows, HF's with the model's own window)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_mistral)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    windows = [int(w) for w in MAX_ATTENTION_WINDOW_SIZE.split(",")]
    kv = {"tokens_per_block": 8, "max_tokens": 4096, "max_attention_window": windows}
    engine = make_engine(tiny_mistral, kv_cache_config=kv, device="cpu")
    try:
        assert engine.core.attention_windows == (windows[0], TINY_SLIDING_WINDOW)
        params = greedy(tokenizer, MAX_TOKENS)
        windowed = [engine.generate(ids, params).outputs[0].token_ids for ids in prompt_ids]
    finally:
        engine.shutdown()
    return prompt_ids, windowed, hf_greedy(tiny_mistral, prompt_ids, MAX_TOKENS, tokenizer.eos_token_id)


def test_the_server_attends_within_the_configured_windows(window_server, references):
    prompt_ids, windowed, hf = references
    assert all(len(ids) > TINY_SLIDING_WINDOW for ids in prompt_ids)
    assert windowed != hf  # the parameter's narrower window changes the answer
    served = [e2e_clients.greedy_token_ids(window_server, ids, MAX_TOKENS, EOS_TOKEN_ID) for ids in prompt_ids]
    assert served == windowed
