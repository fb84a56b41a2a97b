"""A mixture of experts through the real tritonserver: the tiny Mixtral's repository (ensemble, tensorrt_llm_bls,
tensorrt_llm) answers with Hugging Face's greedy tokens (direct requests to tensorrt_llm), and the ensemble and the
BLS give the same text, streamed and not (tests/engine/test_moe.py holds the engine to transformers in-process)."""

import e2e_clients
import pytest
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import EOS_TOKEN_ID, build_tiny_model
from tritonllm.deploy.repo import build_repo

from ..engine.test_engine_parity import hf_greedy
from .conftest import MAX_SEQ_LEN, _run

pytestmark = pytest.mark.server

BLS = "tensorrt_llm_bls"
PROMPTS = ["Once upon a time, in a small village by the sea, there lived", "The keeper wrote the weather"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_mixtral"), seed=2, arch="mixtral")


@pytest.fixture(scope="module")
def mixtral_server(tiny_mixtral, tmp_path_factory):
    """The decoupled repository (`tritonllm repo build`) for the tiny Mixtral; module-scoped."""
    work = tmp_path_factory.mktemp("mixtral")
    yield from _run(build_repo(tiny_mixtral, work / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN), work)


@pytest.fixture(scope="module")
def references(tiny_mixtral):
    tokenizer = AutoTokenizer.from_pretrained(tiny_mixtral)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    return tokenizer, prompt_ids, hf_greedy(tiny_mixtral, prompt_ids, MAX_TOKENS, tokenizer.eos_token_id)


def body(prompt: str, **extra) -> dict:
    return {"text_input": prompt, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True, **extra}


def streamed(server, model: str, request: dict) -> list[str]:
    return [event["text_output"] for event in server.generate_stream({**request, "stream": True}, model=model)]


def test_direct_requests_give_hf_greedy_tokens(mixtral_server, references):
    _, prompt_ids, expected = references
    served = [e2e_clients.greedy_token_ids(mixtral_server, ids, MAX_TOKENS, EOS_TOKEN_ID) for ids in prompt_ids]
    assert served == expected


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_ensemble_and_bls_give_hf_text_streamed_and_not(mixtral_server, references, index):
    tokenizer, _, expected = references
    want = tokenizer.decode(expected[index], skip_special_tokens=True)
    prompt = PROMPTS[index]
    whole = mixtral_server.generate(body(prompt), model="ensemble")["text_output"]
    assert whole == want
    assert mixtral_server.generate(body(prompt), model=BLS)["text_output"] == whole
    for model in ("ensemble", BLS):
        pieces = streamed(mixtral_server, model, body(prompt))
        assert len(pieces) == len(expected[index]) and "".join(pieces) == whole, model
