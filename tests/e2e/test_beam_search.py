"""Beam search and request priority through the real server: tensorrt_llm returns every beam in one response
([1, beams, len], padded with -1), equal to Hugging Face's beams; the ensemble turns them into one text per beam."""

import e2e_clients as clients
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.server

MAX_TOKENS = 8
PROMPT = "The lighthouse keeper counted ships"


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def hf_beams(model, prompt_ids, beams, end_id):
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            num_beams=beams,
            num_return_sequences=beams,
            do_sample=False,
            eos_token_id=end_id,
            pad_token_id=end_id,
        )
    rows = out[:, len(prompt_ids) :].tolist()
    return [row[: row.index(end_id)] if end_id in row else row for row in rows]


def beam_rows(output_ids: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    return [output_ids[0, beam, : lengths[0, beam]].tolist() for beam in range(output_ids.shape[1])]


@pytest.mark.parametrize("streaming", [False, True])
def test_tensorrt_llm_returns_every_beam_like_hf(server, tokenizer, hf_model, streaming):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    expected = hf_beams(hf_model, prompt_ids, 3, tokenizer.end_id)
    reply = server.stream_infer(
        "tensorrt_llm",
        clients.direct_request(
            prompt_ids,
            MAX_TOKENS,
            tokenizer.end_id,
            exclude_input_in_output=True,
            streaming=streaming,
            beam_width=clients.scalar(3, np.int32),
            return_log_probs=True,
        ),
    )
    assert reply.error is None, reply.error
    output_ids, lengths = reply.outputs("output_ids")[-1], reply.outputs("sequence_length")[-1]
    assert output_ids.shape[:2] == (1, 3) and lengths.shape == (1, 3)
    assert beam_rows(output_ids, lengths) == expected
    for beam, length in enumerate(lengths[0]):
        assert (output_ids[0, beam, length:] == -1).all()  # padding
    assert reply.outputs("cum_log_probs")[-1].shape == (1, 3)
    if streaming:  # every update carries whole beams: the last one equals the non-streamed answer
        assert len(reply.outputs("output_ids")) > 1


def test_fewer_returned_beams_and_clear_errors(server, tokenizer, hf_model):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    expected = hf_beams(hf_model, prompt_ids, 4, tokenizer.end_id)
    reply = server.stream_infer(
        "tensorrt_llm",
        clients.direct_request(
            prompt_ids,
            MAX_TOKENS,
            tokenizer.end_id,
            exclude_input_in_output=True,
            beam_width=clients.scalar(4, np.int32),
            num_return_sequences=clients.scalar(2, np.int32),
        ),
    )
    assert reply.error is None, reply.error
    assert beam_rows(reply.outputs("output_ids")[-1], reply.outputs("sequence_length")[-1]) == expected[:2]
    too_wide = server.stream_infer(
        "tensorrt_llm",
        clients.direct_request(prompt_ids, MAX_TOKENS, tokenizer.end_id, beam_width=clients.scalar(8, np.int32)),
    )
    assert too_wide.error is not None and "max_beam_width" in str(too_wide.error)
    diverse = server.stream_infer(
        "tensorrt_llm",
        clients.direct_request(
            prompt_ids,
            MAX_TOKENS,
            tokenizer.end_id,
            beam_width=clients.scalar(2, np.int32),
            beam_search_diversity_rate=clients.scalar(0.5, np.float32),
        ),
    )
    assert diverse.error is not None and "beam_search_diversity_rate" in str(diverse.error)


def test_ensemble_gives_one_text_per_beam(server, tokenizer, hf_model):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    expected = [
        tokenizer.hf.decode(ids, skip_special_tokens=True)
        for ids in hf_beams(hf_model, prompt_ids, 2, tokenizer.end_id)
    ]
    reply = server.generate(
        {
            "text_input": PROMPT,
            "max_tokens": MAX_TOKENS,
            "bad_words": "",
            "stop_words": "",
            "beam_width": 2,
            "exclude_input_in_output": True,
        }
    )
    assert reply["text_output"] == expected


def test_priority_is_accepted_and_checked(server, tokenizer):
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    plain = clients.greedy_token_ids(server, prompt_ids, MAX_TOKENS, tokenizer.end_id)
    reply = server.stream_infer(
        "tensorrt_llm",
        clients.direct_request(
            prompt_ids,
            MAX_TOKENS,
            tokenizer.end_id,
            exclude_input_in_output=True,
            priority=clients.scalar(0.9, np.float32),
        ),
    )
    assert reply.error is None, reply.error
    assert reply.outputs("output_ids")[-1][0, 0].tolist() == plain
    bad = server.stream_infer(
        "tensorrt_llm",
        clients.direct_request(prompt_ids, MAX_TOKENS, tokenizer.end_id, priority=clients.scalar(1.5, np.float32)),
    )
    assert bad.error is not None and "priority" in str(bad.error)
    via_ensemble = server.generate(
        {
            "text_input": PROMPT,
            "max_tokens": MAX_TOKENS,
            "bad_words": "",
            "stop_words": "",
            "priority": 0.2,
            "exclude_input_in_output": True,
        }
    )
    assert via_ensemble["text_output"] == tokenizer.hf.decode(plain, skip_special_tokens=True)


@pytest.mark.parametrize("stream", [False, True])
def test_bls_gives_the_ensembles_beam_texts(server, stream):
    body = {
        "text_input": PROMPT,
        "max_tokens": MAX_TOKENS,
        "bad_words": "",
        "stop_words": "",
        "beam_width": 2,
        "exclude_input_in_output": True,
    }
    expected = server.generate(body)["text_output"]
    if stream:
        events = server.generate_stream({**body, "stream": True}, model="tensorrt_llm_bls")
        assert events[-1]["text_output"] == expected  # every streamed update carries whole beams
    else:
        assert server.generate(body, model="tensorrt_llm_bls")["text_output"] == expected
