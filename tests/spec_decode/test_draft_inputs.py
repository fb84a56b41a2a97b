"""The tensorrt_llm model's external draft inputs (draft_input_ids, draft_logits, draft_acceptance_threshold)
become per-row SamplingParams fields; bad shapes are errors naming the input."""

import numpy as np
import pytest

from tritonllm.triton.llm_request import convert_request
from tritonllm.triton.pb import InputError


class Request:
    def __init__(self, **inputs):
        self.inputs_ = {name: np.asarray(value) for name, value in inputs.items()}


@pytest.fixture
def fake_pb(monkeypatch):
    import tritonllm.triton.llm_request as llm_request

    monkeypatch.setattr(llm_request, "optional_input", lambda request, name, dtype=None: request.inputs_.get(name))


BASE = {
    "input_ids": np.array([[5, 6], [7, 8]]),
    "input_lengths": np.array([[2], [2]]),
    "request_output_len": np.array([[4], [4]]),
}


def test_draft_inputs_per_row(fake_pb):
    logits = np.zeros((2, 3, 10), np.float32)
    logits[1, 2, 7] = 5.0
    rows = convert_request(
        Request(
            **BASE,
            draft_input_ids=np.array([[1, 2, 3], [4, 5, 6]], np.int32),
            draft_logits=logits,
            draft_acceptance_threshold=np.array([[0.5], [0.25]], np.float32),
        ),
        False,
        True,
    )
    assert [r.params.draft_tokens for r in rows] == [[1, 2, 3], [4, 5, 6]]
    assert [r.params.draft_acceptance_threshold for r in rows] == [0.5, 0.25]
    assert tuple(rows[1].params.draft_logits.shape) == (3, 10) and float(rows[1].params.draft_logits[2, 7]) == 5.0
    plain = convert_request(Request(**BASE), False, True)
    assert plain[0].params.draft_tokens is None and plain[0].params.draft_logits is None


def test_bad_draft_inputs_name_the_input(fake_pb):
    ids = np.array([[1, 2, 3], [4, 5, 6]], np.int32)
    with pytest.raises(InputError, match="'draft_logits' must be"):
        convert_request(
            Request(**BASE, draft_input_ids=ids, draft_logits=np.zeros((2, 2, 10), np.float32)), False, True
        )
    with pytest.raises(InputError, match="'draft_logits' needs input 'draft_input_ids'"):
        convert_request(Request(**BASE, draft_logits=np.zeros((2, 3, 10), np.float32)), False, True)
    with pytest.raises(InputError, match="draft_acceptance_threshold must be in"):
        convert_request(
            Request(**BASE, draft_input_ids=ids, draft_acceptance_threshold=np.array([[2.0], [2.0]])), False, True
        )
