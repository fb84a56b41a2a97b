"""gRPC streams (tritonclient): the streaming ensemble, a batch of prompts through the ensemble, and direct
`tensorrt_llm` requests with token ids (output shapes, prompt echo, log-probs, end_id, streaming deltas)."""

from __future__ import annotations

import e2e_clients as clients
import numpy as np
import pytest
from e2e_clients import scalar, strings

pytestmark = pytest.mark.server

PROMPT = "静かな海の上で、"
MAX_TOKENS = 16


def ensemble_inputs(prompt: str, max_tokens: int = MAX_TOKENS, **extra) -> dict[str, np.ndarray]:
    inputs = {"text_input": strings(prompt), "max_tokens": scalar(max_tokens, np.int32)}
    for name, value in extra.items():
        inputs[name] = scalar(value, clients.PYTHON_DTYPES[type(value)])
    return inputs


def single_text(server, prompt: str, **extra) -> str:
    reply = server.stream_infer("ensemble", ensemble_inputs(prompt, **extra))
    assert reply.error is None, reply.error
    (text,) = reply.texts()
    return text


def test_streaming_ensemble_pieces_join_to_the_whole_text(server):
    whole = single_text(server, PROMPT, exclude_input_in_output=True)
    assert (
        whole
        == server.generate({"text_input": PROMPT, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True})[
            "text_output"
        ]
    )
    reply = server.stream_infer("ensemble", ensemble_inputs(PROMPT, exclude_input_in_output=True, stream=True))
    assert reply.error is None, reply.error
    pieces = reply.texts()
    assert len(pieces) >= MAX_TOKENS - 1  # streamed token by token
    assert "".join(pieces) == whole


def test_batch_of_three_prompts_answers_each_row_as_its_own_request(server):
    prompts = ["Hello there", "The lamp turned and turned", "北京"]
    inputs = {
        "text_input": np.array([[p] for p in prompts], dtype=object),
        "max_tokens": np.full((3, 1), 10, dtype=np.int32),
    }
    reply = server.stream_infer("ensemble", inputs)
    assert reply.error is None, reply.error
    by_row = {}
    for result in reply.results:
        (batch_index,) = result.as_numpy("batch_index").reshape(-1)
        (text,) = clients.decode_texts(result.as_numpy("text_output"))
        assert int(batch_index) not in by_row, "one response per row expected"
        by_row[int(batch_index)] = text
    assert sorted(by_row) == [0, 1, 2]
    for row, prompt in enumerate(prompts):
        assert by_row[row] == single_text(server, prompt, max_tokens=10)
        assert by_row[row].startswith(prompt)  # the echoed prompt is the row's own, without padding


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode("Renée's crème brûlée", add_special_tokens=True)


def direct(server, prompt_ids, tokenizer, max_tokens=MAX_TOKENS, **extra) -> clients.StreamReply:
    reply = server.stream_infer(
        "tensorrt_llm", clients.direct_request(prompt_ids, max_tokens, tokenizer.end_id, **extra)
    )
    assert reply.error is None, reply.error
    return reply


def test_direct_request_shapes_and_prompt_echo(server, tokenizer, prompt_ids):
    echoed = direct(server, prompt_ids, tokenizer)
    (output_ids,) = echoed.outputs("output_ids")
    (sequence_length,) = echoed.outputs("sequence_length")
    length = len(prompt_ids) + MAX_TOKENS
    assert output_ids.shape == (1, 1, length) and output_ids.dtype == np.int32
    assert sequence_length.shape == (1, 1) and sequence_length[0, 0] == length
    assert output_ids[0, 0, : len(prompt_ids)].tolist() == prompt_ids

    excluded = direct(server, prompt_ids, tokenizer, exclude_input_in_output=True)
    (generated,) = excluded.outputs("output_ids")
    assert generated.shape == (1, 1, MAX_TOKENS)
    assert excluded.outputs("sequence_length")[0].tolist() == [[MAX_TOKENS]]
    assert generated[0, 0].tolist() == output_ids[0, 0, len(prompt_ids) :].tolist()
    assert excluded.outputs("cum_log_probs") == []  # only on request


def test_direct_request_log_probs(server, tokenizer, prompt_ids):
    reply = direct(server, prompt_ids, tokenizer, exclude_input_in_output=True, return_log_probs=True)
    (cum_log_probs,) = reply.outputs("cum_log_probs")
    (output_log_probs,) = reply.outputs("output_log_probs")
    assert cum_log_probs.shape == (1, 1) and cum_log_probs.dtype == np.float32
    assert output_log_probs.shape == (1, 1, MAX_TOKENS)
    assert np.all(output_log_probs <= 0)
    assert cum_log_probs[0, 0] == pytest.approx(output_log_probs.sum(), abs=1e-3)


def test_direct_streaming_sends_only_the_new_tokens(server, tokenizer, prompt_ids):
    whole = direct(server, prompt_ids, tokenizer, exclude_input_in_output=True).outputs("output_ids")[0]
    reply = direct(server, prompt_ids, tokenizer, streaming=True)
    chunks = reply.outputs("output_ids")
    assert all(chunk.shape[:2] == (1, 1) for chunk in chunks)
    assert len(chunks) == MAX_TOKENS
    assert [t for chunk in chunks for t in chunk.reshape(-1).tolist()] == whole.reshape(-1).tolist()


def test_end_id_stops_where_greedy_produces_it(server, tokenizer, prompt_ids):
    greedy = clients.greedy_token_ids(server, prompt_ids, MAX_TOKENS, tokenizer.end_id)
    position = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    reply = server.stream_infer(
        "tensorrt_llm", clients.direct_request(prompt_ids, MAX_TOKENS, greedy[position], exclude_input_in_output=True)
    )
    assert reply.error is None, reply.error
    (output_ids,) = reply.outputs("output_ids")
    assert output_ids.reshape(-1).tolist() == greedy[:position]
