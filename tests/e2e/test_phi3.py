"""Phi-3 through the real tritonserver: the tiny longrope Phi-3 in the repository `tritonllm repo build` makes, with
nothing set per family. Direct tensorrt_llm requests of prompts past its pre-training context answer Hugging Face's
greedy tokens, and the ensemble's text is their decoding."""

from typing import Iterator

import e2e_clients
import pytest
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import EOS_TOKEN_ID, TINY_ORIGINAL_CONTEXT, build_tiny_model
from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.tritonserver import Ports, TritonServer

from ..engine.test_engine_parity import hf_greedy
from ..engine.test_phi3 import LONG_PROMPTS

pytestmark = pytest.mark.server

PROMPTS = LONG_PROMPTS[:2]
MAX_TOKENS = 16
MAX_SEQ_LEN = 256  # past the pre-training context: the engine rotates with the long factors


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_phi3"), seed=2, arch="phi3-longrope")


@pytest.fixture(scope="module")
def phi3_server(tiny_phi3, tmp_path_factory) -> Iterator["e2e_clients.LiveServer"]:
    work = tmp_path_factory.mktemp("phi3_repo")
    repo = build_repo(tiny_phi3, work / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN)
    triton = TritonServer(repo, Ports.free(), log_file=work / "tritonserver.log")
    try:
        triton.start(timeout=180)
        yield e2e_clients.LiveServer(triton, work / "tritonserver.log", MAX_SEQ_LEN)
    finally:
        triton.stop()


def test_phi3_served_directly_and_through_the_ensemble_matches_hf(phi3_server, tiny_phi3):
    tokenizer = AutoTokenizer.from_pretrained(tiny_phi3)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    assert min(len(ids) for ids in prompt_ids) > TINY_ORIGINAL_CONTEXT
    expected = hf_greedy(tiny_phi3, prompt_ids, MAX_TOKENS, tokenizer.eos_token_id)
    served = [e2e_clients.greedy_token_ids(phi3_server, ids, MAX_TOKENS, EOS_TOKEN_ID) for ids in prompt_ids]
    assert served == expected
    body = {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "bad_words": "", "stop_words": ""}
    text = phi3_server.generate({**body, "exclude_input_in_output": True})["text_output"]
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True, clean_up_tokenization_spaces=False)
