"""Context and generation logits through the real server (shapes as the contract's end_to_end_test asserts)."""

import e2e_clients as clients
import numpy as np
import pytest

pytestmark = pytest.mark.server

MAX_TOKENS = 6


def test_direct_request_returns_context_and_generation_logits(server, tokenizer):
    prompt_ids = tokenizer.encode("The lighthouse keeper counted ships", add_special_tokens=True)
    reply = server.stream_infer(
        "tensorrt_llm",
        clients.direct_request(
            prompt_ids,
            MAX_TOKENS,
            tokenizer.end_id,
            exclude_input_in_output=True,
            return_context_logits=True,
            return_generation_logits=True,
            return_log_probs=True,
        ),
    )
    assert reply.error is None, reply.error
    (context,) = reply.outputs("context_logits")
    (generation,) = reply.outputs("generation_logits")
    (output_ids,) = reply.outputs("output_ids")
    (log_probs,) = reply.outputs("output_log_probs")
    vocab = tokenizer.vocab_size
    assert context.shape == (1, len(prompt_ids), vocab) and context.dtype == np.float32
    assert generation.shape == (1, 1, output_ids.shape[-1], vocab)
    # Greedy: every generated token is the argmax of its logits, and its log-prob their log-softmax there.
    assert generation[0, 0].argmax(-1).tolist() == output_ids[0, 0].tolist()
    assert context[0, -1].argmax() == output_ids[0, 0, 0]
    shifted = generation[0, 0] - generation[0, 0].max(-1, keepdims=True)
    expected = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    chosen = np.take_along_axis(expected, output_ids[0, 0][:, None], axis=1)[:, 0]
    np.testing.assert_allclose(log_probs[0, 0], chosen, atol=1e-4)


def test_ensemble_passes_generation_logits_through(server):
    reply = server.generate(
        {
            "text_input": "The lighthouse keeper",
            "max_tokens": 4,
            "bad_words": "",
            "stop_words": "",
            "return_generation_logits": True,
        }
    )
    generation = np.array(reply["generation_logits"])
    assert generation.size % 4 == 0 and generation.size > 0
