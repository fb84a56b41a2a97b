"""A non-decoupled repository (`build_repo(..., streaming=False)`): one response per request, so /generate and
plain HTTP infer work, a batch comes back as one response with a row per prompt, and streaming is refused."""
from __future__ import annotations

import numpy as np
import pytest
import tritonclient.http as httpclient

import e2e_clients as clients

pytestmark = pytest.mark.server

PROMPTS = ["Hello there", "The lamp turned and turned", "北京"]
MAX_TOKENS = 10


def body(prompt: str, **extra) -> dict:
    return {"text_input": prompt, "max_tokens": MAX_TOKENS, "bad_words": "", "stop_words": "", **extra}


def test_generate_answers_like_the_decoupled_repository(plain_server, server):
    for prompt in PROMPTS[:2]:
        text = plain_server.generate(body(prompt))["text_output"]
        assert text.startswith(prompt) and len(text) > len(prompt)
        assert text == server.generate(body(prompt))["text_output"]


def test_stream_true_is_refused(plain_server):
    status, message = plain_server.generate_error(body(PROMPTS[0], stream=True))
    assert status == 400
    assert "'streaming'" in message and "only supported in decoupled mode" in message


def test_batch_of_three_returns_one_response_with_three_rows(plain_server):
    client = httpclient.InferenceServerClient(f"localhost:{plain_server.ports.http}")
    try:
        inputs = []
        for name, array, dtype in (("text_input", np.array([[p.encode()] for p in PROMPTS], dtype=object), "BYTES"),
                                   ("max_tokens", np.full((3, 1), MAX_TOKENS, dtype=np.int32), "INT32")):
            tensor = httpclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer("ensemble", inputs)
    finally:
        client.close()
    texts = result.as_numpy("text_output")
    assert texts.shape[0] == 3
    assert clients.decode_texts(texts) == [plain_server.generate(body(p))["text_output"] for p in PROMPTS]
