"""The tensorrt_llm_bls logic without a server: stop words on text, sequence text, request reading, the gRPC
endpoint found on tritonserver's command line, and one request run end to end against scripted tensorrt_llm
responses (preprocessing and postprocessing stand-ins), with a fake pb_utils."""

from __future__ import annotations

import sys
import threading
import time

import fake_pb_utils as fake  # registered by conftest.py
import numpy as np
import pytest

from tritonllm.bls import handler as bls_handler
from tritonllm.bls.grpc_endpoint import GrpcEndpointError, grpc_url_from_arguments
from tritonllm.bls.inflight import BlsInflightRequests
from tritonllm.bls.llm_calls import LlmCancelled, LlmResponse
from tritonllm.bls.request import read_request
from tritonllm.bls.sequences import SequenceText
from tritonllm.triton.pb import InputError


@pytest.fixture(autouse=True)
def pb_utils(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_stop_word_split_across_pieces_ends_the_text_right_after_it(accumulate):
    sequence = SequenceText(["STOP"], accumulate)
    sent = [sequence.add_delta(piece, False) for piece in ["Hello S", "T", "OP and", " more"]]
    assert sequence.text == "Hello STOP" and sequence.finished and sequence.stopped_by_word
    if accumulate:
        assert sent[:3] == ["Hello S", "Hello ST", "Hello STOP"]
    else:
        assert sent[:3] == ["Hello S", "T", "OP"]


def test_pieces_without_a_stop_word_pass_unchanged_until_the_final_one():
    sequence = SequenceText(["zzz"])
    assert [sequence.add_delta(p, f) for p, f in [("a", False), ("b", False), ("c", True)]] == ["a", "b", "c"]
    assert sequence.finished and not sequence.stopped_by_word


def test_whole_text_is_searched_after_the_echoed_prompt():
    sequence = SequenceText(["cat"], generation_start=len("my cat"))
    assert sequence.add_whole("my cat sat on the cat mat", True) == "my cat sat on the cat"


# ------------------------------------------------------------------------------------------------ requests


def bls_request(**inputs):
    values = {"text_input": np.array([["Hello"]], object), "max_tokens": np.array([[8]], np.int32), **inputs}
    return fake.InferenceRequest({name: np.asarray(value) for name, value in values.items()})


def test_read_request_renames_inputs_for_tensorrt_llm():
    request = read_request(
        bls_request(
            top_k=np.array([[3]], np.int32),
            stream=np.array([[True]]),
            min_length=np.array([[2]], np.int32),
            return_generation_logits=np.array([True]),
            num_return_sequences=np.array([2], np.int32),
            stop_words=np.array([["end", ""]], object),
        ),
        decoupled=True,
    )
    assert request.streaming and request.sequences_per_row == [2] and request.stop_words == [["end"]]
    llm = request.llm_inputs({"INPUT_ID": np.zeros((1, 3), np.int32), "OUT_END_ID": np.ones((1, 1), np.int32)})
    assert llm["runtime_top_k"].tolist() == [[3]] and llm["streaming"].tolist() == [[True]]
    assert llm["min_tokens"].tolist() == [[2]], "min_length reaches tensorrt_llm as min_tokens"
    assert llm["num_return_sequences"].shape == (1, 1), "reshaped inputs go on as [batch, 1]"
    assert llm["return_generation_logits"].tolist() == [[True]]
    assert set(llm) >= {"input_ids", "end_id"}
    assert set(request.preprocessing_inputs()) == {"QUERY", "REQUEST_OUTPUT_LEN", "STOP_WORDS_DICT"}


def test_lora_inputs_reach_tensorrt_llm():
    weights, config = np.ones((1, 2, 6), np.float16), np.array([[[1, 0, 1], [2, 0, 1]]], np.int32)
    request = read_request(
        bls_request(
            lora_task_id=np.array([7], np.uint64),
            lora_weights=weights,
            lora_config=config,
            lora_name=np.array(["fr"], object),
        ),
        decoupled=True,
    )
    llm = request.llm_inputs({"INPUT_ID": np.zeros((1, 3), np.int32)})
    assert llm["lora_task_id"].tolist() == [[7]] and llm["lora_name"].tolist() in ([["fr"]], [[b"fr"]])
    assert llm["lora_weights"] is not None and np.array_equal(llm["lora_weights"], weights)
    assert np.array_equal(llm["lora_config"], config)


@pytest.mark.parametrize(
    "inputs, message",
    [
        ({"num_draft_tokens": np.array([[-1]], np.int32)}, "'num_draft_tokens' must be >= 0"),
        ({"num_draft_tokens": np.array([[2]], np.int32), "beam_width": np.array([[2]], np.int32)}, "'beam_width'"),
        (
            {"num_draft_tokens": np.array([[2]], np.int32), "return_generation_logits": np.array([True])},
            "'return_generation_logits'",
        ),
        ({"beam_width": np.array([[0]], np.int32)}, "'beam_width' must be >= 1"),
        ({"image_url_input": np.array([["http://x"]], object)}, "multimodal"),
        ({"max_tokens": np.array([[0]], np.int32)}, "'max_tokens' must be >= 1"),
        ({"num_return_sequences": np.array([0], np.int32)}, "'num_return_sequences' must be >= 1"),
    ],
)
def test_read_request_refuses_unsupported_or_bad_inputs(inputs, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_request(bls_request(**inputs), decoupled=True)


def test_a_beam_search_is_one_response_stream_and_reaches_tensorrt_llm():
    request = read_request(
        bls_request(beam_width=np.array([[3]], np.int32), num_return_sequences=np.array([[2]], np.int32)),
        decoupled=False,
    )
    assert request.sequences_per_row == [1]  # all beams come in one response, so non-decoupled works
    assert request.llm_inputs({"INPUT_ID": np.zeros((1, 3), np.int32)})["beam_width"].tolist() == [[3]]


def test_harmless_values_of_unsupported_inputs_pass():
    read_request(
        bls_request(
            num_draft_tokens=np.array([[0]], np.int32),
            beam_width=np.array([[1]], np.int32),
            use_draft_logits=np.array([False]),
            guided_decoding_guide_type=np.array([[""]], object),
        ),
        decoupled=True,
    )


def test_non_decoupled_refuses_what_needs_several_responses():
    with pytest.raises(InputError, match="'stream' = true needs a decoupled"):
        read_request(bls_request(stream=np.array([[True]])), decoupled=False)
    with pytest.raises(InputError, match="'num_return_sequences' > 1 needs a decoupled"):
        read_request(bls_request(num_return_sequences=np.array([3], np.int32)), decoupled=False)
    batch = read_request(
        bls_request(text_input=np.array([["a"], ["b"]], object), max_tokens=np.array([[4], [4]], np.int32)),
        decoupled=False,
    )
    assert batch.batch_size == 2, "a batch is answered with one response of several rows"


# ------------------------------------------------------------------------------------------------ gRPC endpoint


@pytest.mark.parametrize(
    "arguments, url",
    [
        (["tritonserver", "--model-repository", "r"], "localhost:8001"),
        (["tritonserver", "--grpc-port=9101"], "localhost:9101"),
        (["tritonserver", "--grpc-port", "9102", "--grpc-address=10.0.0.5"], "10.0.0.5:9102"),
        (["tritonserver", "--grpc-address", "::1", "--grpc-port=7"], "[::1]:7"),
    ],
)
def test_grpc_url_from_the_server_command_line(arguments, url):
    assert grpc_url_from_arguments(arguments) == url


def test_a_server_without_grpc_is_a_clear_error():
    with pytest.raises(GrpcEndpointError, match="--allow-grpc=false"):
        grpc_url_from_arguments(["tritonserver", "--allow-grpc=false"])


# ------------------------------------------------------------------------------------------------ one request


class ScriptedCall:
    """tensorrt_llm responses given in advance; records cancel()."""

    def __init__(self, responses):
        self.scripted = responses
        self.cancelled = threading.Event()

    def responses(self):
        for response in self.scripted:
            if self.cancelled.is_set():
                raise LlmCancelled()
            yield response

    def cancel(self):
        self.cancelled.set()


class ScriptedTransport:
    def __init__(self, responses):
        self.call = ScriptedCall(responses)
        self.inputs = None

    def start(self, inputs, request_id):
        self.inputs = inputs
        return self.call

    def close(self):
        pass


def llm_response(pieces: list[str], final: bool, batch_index=None, sequence_index=None) -> LlmResponse:
    """A response whose 'tokens' are indexes into a piece table the fake postprocessing decodes."""
    ids = np.array([[[PIECES.index(p) for p in pieces]]], np.int32)
    outputs = {
        "output_ids": ids,
        "sequence_length": np.array([[ids.shape[-1]]], np.int32),
        "detok_is_final": np.array([[final]]),
    }
    if batch_index is not None:
        outputs["batch_index"] = np.array([[batch_index]], np.int32)
    if sequence_index is not None:
        outputs["sequence_index"] = np.array([[sequence_index]], np.int32)
    return LlmResponse(outputs, final)


PIECES = ["Hel", "lo", " wor", "ld", " S", "TO", "P", " after", "!"]


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(
        bls_handler,
        "preprocess",
        lambda inputs, request_id="": {
            "INPUT_ID": np.zeros((1, 2), np.int32),
            "REQUEST_INPUT_LEN": np.array([[2]], np.int32),
        },
    )
    monkeypatch.setattr(
        bls_handler,
        "postprocess",
        lambda outputs, request_id="": [
            "".join(PIECES[t] for t in row[0][: int(length[0])])
            for row, length in zip(outputs["output_ids"], outputs["sequence_length"])
        ],
    )


def handler_for(request, transport, decoupled=True, accumulate=False):
    return bls_handler.BlsHandler(
        read_request(request, decoupled), request.get_response_sender(), transport, accumulate
    )


def run(request, responses, decoupled=True, accumulate=False):
    transport = ScriptedTransport(responses)
    handler_for(request, transport, decoupled, accumulate).run()
    sent = request.get_response_sender().sent
    assert sent and sent[-1][1] == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL, "the request must end with FINAL"
    return sent, transport


def texts(sent) -> list[str]:
    return [
        fake.get_output_tensor_by_name(r, "text_output").as_numpy()[0].decode()
        for r, _ in sent
        if r is not None and not r.has_error()
    ]


def test_stream_sends_each_piece_and_the_last_with_final(stand_ins):
    request = bls_request(stream=np.array([[True]]))
    sent, _ = run(
        request, [llm_response(["Hel"], False), llm_response(["lo"], False), llm_response([" wor", "ld"], True)]
    )
    assert texts(sent) == ["Hel", "lo", " world"]
    assert [flags for _, flags in sent] == [0, 0, fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL]


def test_accumulate_tokens_sends_all_text_so_far(stand_ins):
    sent, _ = run(
        bls_request(stream=np.array([[True]])),
        [llm_response(["Hel"], False), llm_response(["lo"], True)],
        accumulate=True,
    )
    assert texts(sent) == ["Hel", "Hello"]


def test_a_streamed_stop_word_ends_the_stream_and_cancels_tensorrt_llm(stand_ins):
    request = bls_request(stream=np.array([[True]]), stop_words=np.array([["STOP"]], object))
    script = [llm_response([p], False) for p in ["Hel", " S", "TO", "P", " after", "!"]]
    sent, transport = run(request, script)
    assert texts(sent) == ["Hel", " S", "TO", "P"]
    assert sent[-1][1] == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL and len(sent) == 4
    assert transport.call.cancelled.is_set()


def test_whole_text_is_cut_after_the_stop_word(stand_ins):
    request = bls_request(stop_words=np.array([["STOP"]], object), exclude_input_in_output=np.array([[True]]))
    sent, transport = run(request, [llm_response(["Hel", " S", "TO", "P", " after"], True)])
    assert texts(sent) == ["Hel STOP"] and len(sent) == 1
    assert not transport.call.cancelled.is_set(), "tensorrt_llm had already finished"


def test_three_sequences_are_tagged_and_final_after_the_last(stand_ins):
    request = bls_request(num_return_sequences=np.array([3], np.int32))
    script = [llm_response(["Hel"], True, sequence_index=i) for i in (1, 0, 2)]
    sent, _ = run(request, script)
    indexes = [int(fake.get_output_tensor_by_name(r, "sequence_index").as_numpy()[0, 0]) for r, _ in sent]
    assert indexes == [1, 0, 2]
    assert [flags for _, flags in sent] == [0, 0, fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL]


def test_bad_input_is_answered_in_execute_with_an_error_naming_it(stand_ins):
    transport = ScriptedTransport([])
    server = BlsInflightRequests(transport, decoupled=True, accumulate=False, cancellation_check_ms=100)
    request = bls_request(image_url_input=np.array([["http://example.com/cat.jpg"]], object))
    try:
        server.submit(request)
        ((response, flags),) = request.get_response_sender().sent  # answered before submit returned
    finally:
        server.shutdown()
    assert flags == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert response.has_error() and "image_url_input" in response.error().message()
    assert response.error().code() == fake.TritonError.INVALID_ARG
    assert transport.inputs is None, "nothing reached tensorrt_llm"


def test_a_request_runs_on_its_own_thread_and_is_forgotten_when_done(stand_ins):
    transport = ScriptedTransport([llm_response(["Hel"], True)])
    server = BlsInflightRequests(transport, decoupled=True, accumulate=False, cancellation_check_ms=100)
    request = bls_request()
    try:
        server.submit(request)
        deadline = time.monotonic() + 10
        while server.num_active and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        server.shutdown()
    assert texts(request.get_response_sender().sent) == ["Hel"] and server.num_active == 0


def test_cancel_before_the_call_starts_is_answered_as_cancelled(stand_ins):
    request = bls_request()
    handler = handler_for(request, ScriptedTransport([]))
    handler.cancel()
    handler.run()
    ((response, _),) = request.get_response_sender().sent
    assert response.error().code() == fake.TritonError.CANCELLED


def test_a_client_that_went_away_cancels_the_running_call(stand_ins):
    request = bls_request(stream=np.array([[True]]))
    transport = ScriptedTransport([llm_response(["Hel"], False), llm_response(["lo"], False)])
    handler = handler_for(request, transport)
    handler.call = transport.call  # as if the request were running
    request.get_response_sender().is_cancelled = lambda: True
    handler.poll_cancelled()
    assert transport.call.cancelled.is_set()


def test_no_cancellation_check_once_the_final_response_is_sent(stand_ins):
    """Triton crashes when is_cancelled() reaches a request whose final response went out."""
    request = bls_request()
    handler = handler_for(request, ScriptedTransport([llm_response(["Hel"], True)]))
    handler.run()
    asked = []
    request.get_response_sender().is_cancelled = lambda: asked.append(1) or False
    handler.poll_cancelled()
    assert asked == []
