"""Gemma 3 through the real tritonserver: the tiny Gemma 3 (`--arch gemma3`: 5 sliding layers to 1 global, prompts
longer than the window) served by the decoupled repository answers the tensorrt_llm model, the ensemble and
tensorrt_llm_bls, streamed and not, with the greedy tokens the embedded engine gives in-process (which
tests/engine/test_gemma.py holds to Hugging Face's)."""

import e2e_clients
import numpy as np
import pytest

from tritonllm.checkpoints.tiny import EOS_TOKEN_ID, TINY_SLIDING_WINDOW, build_tiny_model
from tritonllm.deploy.repo import build_repo
from tritonllm.tokenizer import load_tokenizer

from ..engine.test_engine_parity import greedy, hf_greedy, make_engine
from .conftest import MAX_SEQ_LEN, _run

pytestmark = pytest.mark.server

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The lighthouse keeper on the northern cape kept a notebook of every ship that passed. Some mornings",
]
MAX_TOKENS = 24
MODELS = ["ensemble", "tensorrt_llm_bls"]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_gemma3"), seed=2, arch="gemma3")


@pytest.fixture(scope="module")
def gemma3_server(tiny_gemma3, tmp_path_factory):
    """The decoupled repository (`tritonllm repo build`) for the tiny Gemma 3; module-scoped."""
    work = tmp_path_factory.mktemp("gemma3")
    yield from _run(build_repo(tiny_gemma3, work / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN), work)


@pytest.fixture(scope="module")
def references(tiny_gemma3):
    """(tokenizer, prompt ids, the in-process engine's greedy ids), which equal HF's."""
    tokenizer = load_tokenizer(str(tiny_gemma3))
    prompt_ids = [tokenizer.encode(p, add_special_tokens=True) for p in PROMPTS]
    engine = make_engine(tiny_gemma3, device="cpu")
    try:
        params = greedy(tokenizer.hf, MAX_TOKENS)
        expected = [engine.generate(ids, params).outputs[0].token_ids for ids in prompt_ids]
    finally:
        engine.shutdown()
    assert expected == hf_greedy(tiny_gemma3, prompt_ids, MAX_TOKENS, EOS_TOKEN_ID)
    assert all(len(ids) > TINY_SLIDING_WINDOW for ids in prompt_ids)
    return tokenizer, prompt_ids, expected


def test_tensorrt_llm_gives_the_engines_tokens_whole_and_streamed(gemma3_server, references):
    _, prompt_ids, expected = references
    served = [e2e_clients.greedy_token_ids(gemma3_server, ids, MAX_TOKENS, EOS_TOKEN_ID) for ids in prompt_ids]
    assert served == expected
    for ids, tokens in zip(prompt_ids, expected):
        request = e2e_clients.direct_request(ids, MAX_TOKENS, EOS_TOKEN_ID, exclude_input_in_output=True)
        request["streaming"] = e2e_clients.scalar(True, np.bool_)
        reply = gemma3_server.stream_infer("tensorrt_llm", request)
        assert reply.error is None, reply.error
        pieces = [out.reshape(-1).tolist() for out in reply.outputs("output_ids")]
        assert len(pieces) > 1 and sum(pieces, []) == tokens


@pytest.mark.parametrize("model", MODELS)
def test_text_models_give_the_engines_text_whole_and_streamed(gemma3_server, references, model):
    tokenizer, _, expected = references
    for prompt, tokens in zip(PROMPTS, expected):
        body = {"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert gemma3_server.generate(body, model=model)["text_output"] == text
        events = gemma3_server.generate_stream({**body, "stream": True}, model=model)
        assert len(events) > 1 and "".join(event["text_output"] for event in events) == text
    assert e2e_clients.engine_is_idle(gemma3_server.wait_engine_idle())
