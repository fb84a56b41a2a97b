"""The tensorrt_llm_bls model on the real server: the ensemble's text (streamed and not, multi-byte characters
and leading spaces included), batches and num_return_sequences, stop words matched on the text across streamed
chunks (which stop the engine request), client cancellation reaching the engine, and clear errors."""

from __future__ import annotations

import json

import e2e_clients as clients
import numpy as np
import pytest
from e2e_clients import scalar, strings

pytestmark = pytest.mark.server

BLS = "tensorrt_llm_bls"
PROMPTS = ["Où est la gare ?", "静かな海の上で、", "The keeper wrote the weather"]
MAX_TOKENS = 16


def body(prompt: str, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    return {"text_input": prompt, "max_tokens": max_tokens, "exclude_input_in_output": True, **extra}


def grpc_inputs(prompt: str, max_tokens: int = MAX_TOKENS, **extra) -> dict[str, np.ndarray]:
    inputs = {"text_input": strings(prompt), "max_tokens": scalar(max_tokens, np.int32)}
    for name, value in extra.items():
        inputs[name] = value if isinstance(value, np.ndarray) else scalar(value, clients.PYTHON_DTYPES[type(value)])
    return inputs


def streamed_pieces(server, model: str, request: dict) -> list[str]:
    return [event["text_output"] for event in server.generate_stream({**request, "stream": True}, model=model)]


# ---------------------------------------------------------------------------------------------- same text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_bls_gives_the_ensembles_text(server, prompt):
    whole = server.generate(body(prompt), model="ensemble")["text_output"]
    assert server.generate(body(prompt), model=BLS)["text_output"] == whole
    echoed = server.generate(body(prompt, exclude_input_in_output=False), model=BLS)["text_output"]
    assert echoed == server.generate(body(prompt, exclude_input_in_output=False), model="ensemble")["text_output"]
    pieces = streamed_pieces(server, BLS, body(prompt))
    assert pieces == streamed_pieces(server, "ensemble", body(prompt)), "the same pieces, one per token"
    assert len(pieces) == MAX_TOKENS and "".join(pieces) == whole


def test_multibyte_characters_and_leading_spaces_survive_streaming(server):
    whole = server.generate(body(PROMPTS[1]), model=BLS)["text_output"]
    assert any(ord(c) > 127 and c != "\ufffd" for c in whole) and " " in whole, f"pick another prompt: {whole!r}"
    reply = server.stream_infer(BLS, grpc_inputs(PROMPTS[1], stream=True, exclude_input_in_output=True))
    assert reply.error is None, reply.error
    assert "".join(reply.texts()) == whole


def test_a_batch_answers_each_row_tagged_with_batch_index(server):
    inputs = {
        "text_input": np.array([[p] for p in PROMPTS], dtype=object),
        "max_tokens": np.full((3, 1), 10, dtype=np.int32),
        "exclude_input_in_output": np.full((3, 1), True),
    }
    for streaming in (False, True):
        reply = server.stream_infer(BLS, {**inputs, "stream": np.full((3, 1), streaming)})
        assert reply.error is None, reply.error
        by_row: dict[int, str] = {}
        for result in reply.results:
            row = int(result.as_numpy("batch_index").reshape(-1)[0])
            by_row[row] = by_row.get(row, "") + clients.decode_texts(result.as_numpy("text_output"))[0]
        assert by_row == {
            row: server.generate(body(p, 10), model="ensemble")["text_output"] for row, p in enumerate(PROMPTS)
        }


def test_three_return_sequences_come_tagged_with_sequence_index(server):
    knobs = dict(
        num_return_sequences=np.array([[3]], np.int32),
        temperature=1.0,
        seed=np.array([[11]], np.uint64),
        exclude_input_in_output=True,
    )
    replies = {model: server.stream_infer(model, grpc_inputs(PROMPTS[2], **knobs)) for model in (BLS, "ensemble")}
    texts = {}
    for model, reply in replies.items():
        assert reply.error is None, reply.error
        texts[model] = {
            int(r.as_numpy("sequence_index").reshape(-1)[0]): clients.decode_texts(r.as_numpy("text_output"))[0]
            for r in reply.results
        }
    assert sorted(texts[BLS]) == [0, 1, 2]
    assert texts[BLS] == texts["ensemble"]
    assert len(set(texts[BLS].values())) == 3, "sampled sequences differ"


def test_logits_and_log_probs_come_through_like_the_ensembles(server):
    request = body(PROMPTS[2], 4, return_generation_logits=True, return_context_logits=True, return_log_probs=True)
    bls, ensemble = server.generate(request, model=BLS), server.generate(request, model="ensemble")
    for name in ("generation_logits", "context_logits", "output_log_probs", "cum_log_probs"):
        assert np.array(bls[name]).size > 0, name
        np.testing.assert_allclose(np.array(bls[name]), np.array(ensemble[name]), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- stop words


def boundary_stop_word(tokenizer, ids: list[int]) -> tuple[str, int]:
    """A stop word made of the last two characters of one generated token and the first two of the next, and
    where it first occurs in the text. No token sequence preprocessing makes of it matches the generated tokens,
    so only the BLS's text-level check can stop there, and it spans two streamed chunks."""
    for k in range(1, len(ids) - 1):
        before, after = tokenizer.decode(ids[: k + 1]), tokenizer.decode([ids[k + 1]])
        this = tokenizer.decode([ids[k]])
        if len(this) >= 3 and len(after) >= 3 and (this + after).isascii() and before.endswith(this):
            word = this[-2:] + after[:2]
            text = tokenizer.decode(ids[: k + 2])
            if text.find(word) == len(before) - 2:
                return word, len(before) + 2
    raise AssertionError(f"no two ASCII tokens to split a stop word across in {ids}: pick another prompt")


def test_a_stop_word_split_across_chunks_ends_the_stream_and_the_engine_request(server, tokenizer):
    prompt = PROMPTS[2]
    greedy = clients.greedy_token_ids(server, tokenizer.encode(prompt, add_special_tokens=True), 40, tokenizer.end_id)
    word, cut = boundary_stop_word(tokenizer, greedy)
    whole = tokenizer.decode(greedy)
    before = server.wait_engine_idle()
    max_tokens = server.max_seq_len - len(tokenizer.encode(prompt, add_special_tokens=True)) - 1
    pieces = streamed_pieces(server, BLS, body(prompt, max_tokens, stop_words=[word]))
    assert "".join(pieces) == whole[:cut] and whole[:cut].endswith(word)
    assert not any(word in piece for piece in pieces), "the word came in two pieces"
    clients.assert_cut_short(server, before, max_tokens)  # the stop word cancelled the engine's request


def test_a_stop_word_cuts_the_whole_text_after_it(server, tokenizer):
    prompt = PROMPTS[2]
    greedy = clients.greedy_token_ids(server, tokenizer.encode(prompt, add_special_tokens=True), 40, tokenizer.end_id)
    word, cut = boundary_stop_word(tokenizer, greedy)
    text = server.generate(body(prompt, 40, stop_words=[word]), model=BLS)["text_output"]
    assert text == tokenizer.decode(greedy)[:cut]
    echoed = server.generate(body(prompt, 40, stop_words=[word], exclude_input_in_output=False), model=BLS)
    assert echoed["text_output"].endswith(text) and echoed["text_output"].startswith(prompt)


# ---------------------------------------------------------------------------------------------- cancellation


@pytest.fixture
def long_stream(server, tokenizer):
    """A streaming BLS request for as many tokens as max_seq_len allows, and the engine's idle state before."""
    before = server.wait_engine_idle()
    assert clients.engine_is_idle(before), f"the engine is busy before the test: {before}"
    max_tokens = server.max_seq_len - len(tokenizer.encode(PROMPTS[2], add_special_tokens=True)) - 1
    return body(PROMPTS[2], max_tokens, stream=True), before


def assert_engine_stopped_early(server, request, before) -> None:
    clients.assert_cut_short(server, before, request["max_tokens"])


def test_grpc_client_cancelling_a_bls_stream_frees_the_engine(server, long_stream):
    request, before = long_stream
    stream = server.grpc_stream()
    try:
        stream.send(BLS, grpc_inputs(request["text_input"], request["max_tokens"], stream=True))
        reply = clients.StreamReply()
        while len(reply.results) < 5 and not reply.finished:
            clients.add_event(reply, *stream.next_event(timeout=30))
        assert not reply.finished, reply.error
    finally:
        stream.close(cancel=True)
    assert_engine_stopped_early(server, request, before)


def test_http_client_closing_a_bls_stream_frees_the_engine(server, long_stream):
    request, before = long_stream
    connection = server.connection()
    try:
        connection.request(
            "POST", f"/v2/models/{BLS}/generate_stream", json.dumps(request), {"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 200
        events = clients.sse_events(response)
        received = [next(events) for _ in range(5)]
        assert all("text_output" in event for event in received), received
    finally:
        connection.close()
    assert_engine_stopped_early(server, request, before)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"max_tokens": 0}, ["'max_tokens'", ">= 1"]),
        ({"lora_task_id": 3}, ["LoRA is not enabled", "enable_lora"]),  # this repository runs without LoRA
        ({"num_draft_tokens": 2}, ["'num_draft_tokens'", "draft model", "tensorrt_llm_draft_model_name"]),
        ({"beam_width": 8}, ["beam_width=8", "max_beam_width 4"]),
        ({"guided_decoding_guide_type": "yaml"}, ["'guided_decoding_guide_type'", "must be one of"]),
        ({"image_url_input": "http://example.com/cat.jpg"}, ["'image_url_input'", "multimodal", "not supported yet"]),
        ({"max_tokens": 5000}, ["max_tokens", "max_seq_len"]),
    ],
)
def test_malformed_requests_get_an_error_naming_the_input(server, extra, words):
    status, message = server.generate_error({"text_input": "Hi", "max_tokens": 5, **extra}, model=BLS)
    assert status == 400, message
    for word in words:
        assert word in message, message


def test_a_missing_prompt_is_refused_by_triton(server):
    status, message = server.generate_error({"max_tokens": 5}, model=BLS)
    assert status == 400 and "text_input" in message
