"""Per-request histograms (token lengths, time to first token, inter-token latency) against a fake pb_utils, and the
sender thread's hook that feeds them."""

from __future__ import annotations

import sys
import time

import fake_pb_utils as fake  # registered by conftest.py
import pytest

from tritonllm.engine.types import CompletionOutput, RequestOutput, RequestPerfMetrics
from tritonllm.triton.request_metrics import (
    HISTOGRAMS,
    INPUT_TOKENS,
    INTER_TOKEN_LATENCY,
    OUTPUT_TOKENS,
    TIME_TO_FIRST_TOKEN,
    RequestMetrics,
    observe_request,
)

MS = 1_000_000  # nanoseconds


@pytest.fixture(autouse=True)
def pb_utils(monkeypatch):
    fake.MetricFamily.families = {}
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


def completion(
    tokens: int, first_ms: float = 0, last_ms: float = 0, index: int = 0, arrival_ms: float = 1
) -> CompletionOutput:
    timing = RequestPerfMetrics(
        arrival_time_ns=int(arrival_ms * MS),
        first_token_time_ns=int(first_ms * MS),
        last_token_time_ns=int(last_ms * MS),
    )
    return CompletionOutput(
        index=index, token_ids=list(range(tokens)), finish_reason="length", request_perf_metrics=timing
    )


def finished(prompt_len: int, *completions: CompletionOutput) -> RequestOutput:
    return RequestOutput(
        request_id=1, prompt_token_ids=list(range(prompt_len)), outputs=list(completions), finished=True
    )


def test_an_observation_counts_prompt_and_generated_tokens_and_derives_latencies():
    observation = observe_request(finished(12, completion(5, first_ms=21, last_ms=61)))
    assert observation.input_tokens == 12
    assert observation.output_tokens == 5
    assert observation.time_to_first_token == pytest.approx(0.020)  # arrival at 1 ms, first token at 21 ms
    assert observation.inter_token_latencies == [pytest.approx(0.010)]  # 40 ms over 4 gaps


def test_every_sequence_of_a_row_adds_its_tokens_and_its_own_latency():
    observation = observe_request(
        finished(3, completion(4, first_ms=11, last_ms=41), completion(2, first_ms=6, last_ms=16, index=1))
    )
    assert observation.output_tokens == 6
    assert observation.time_to_first_token == pytest.approx(0.005)  # the earliest first token
    assert sorted(observation.inter_token_latencies) == [pytest.approx(0.010), pytest.approx(0.010)]


def test_no_timestamps_no_latencies_and_one_token_no_inter_token_latency():
    observation = observe_request(finished(3, completion(1, first_ms=0, last_ms=0, arrival_ms=0)))
    assert observation.time_to_first_token is None
    assert observation.inter_token_latencies == []
    assert observe_request(finished(3, completion(1, first_ms=5, last_ms=5))).inter_token_latencies == []


def test_histograms_carry_the_contract_names_labels_and_buckets():
    RequestMetrics("tensorrt_llm", "1")
    families = fake.MetricFamily.families
    assert set(families) == set(HISTOGRAMS)
    assert all(family.kind == fake.MetricFamily.HISTOGRAM for family in families.values())
    for name, kind in ((INPUT_TOKENS, "total_input_tokens"), (OUTPUT_TOKENS, "total_output_tokens")):
        (metric,) = families[name].metrics
        assert metric.labels == {"model": "tensorrt_llm", "version": "1", "response_metric_type": kind}
        assert metric.buckets == [10, 50, 100, 500, 1000]
    for name in (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY):
        (metric,) = families[name].metrics
        assert metric.labels == {"model": "tensorrt_llm", "version": "1"}


def test_observe_feeds_each_histogram():
    metrics = RequestMetrics("tensorrt_llm", "1")
    metrics.observe(finished(12, completion(5, first_ms=21, last_ms=61)))
    metrics.observe(finished(7, completion(1, first_ms=0, last_ms=0, arrival_ms=0)))
    assert metrics.histograms[INPUT_TOKENS].observations == [12, 7]
    assert metrics.histograms[OUTPUT_TOKENS].observations == [5, 1]
    assert metrics.histograms[TIME_TO_FIRST_TOKEN].observations == [pytest.approx(0.020)]
    assert metrics.histograms[INTER_TOKEN_LATENCY].observations == [pytest.approx(0.010)]


def test_released_histograms_are_gone_and_later_requests_are_not_counted():
    """finalize frees them while the stub can still clear them (left to its teardown, it segfaults)."""
    metrics = RequestMetrics("tensorrt_llm", "1")
    metrics.release()
    assert metrics.histograms == {} and metrics.families == {}
    metrics.observe(finished(3, completion(2, first_ms=1, last_ms=5)))  # a response sent during shutdown


class _Handle:
    def __init__(self, request_id):
        self.request_id = request_id


class _ScriptedEngine:
    """Answers every request at once with one finished output of three tokens, on the caller's thread."""

    def __init__(self):
        self.next_id = 0

    def generate_async(self, prompt, params, streaming, on_output):
        self.next_id += 1
        handle = _Handle(self.next_id)
        on_output(handle, finished(len(prompt), completion(3, first_ms=2, last_ms=4)))
        return handle

    def abort(self, request_id):
        pass


def wait_finished(request, timeout: float = 5.0) -> None:
    """Until the sender thread has sent the final response (shutting down earlier would cancel the request)."""
    deadline = time.monotonic() + timeout
    while not request.get_response_sender().finished:
        assert time.monotonic() < deadline, "no final response"
        time.sleep(0.005)


def test_the_sender_thread_reports_each_finished_row_once():
    import numpy as np

    from tritonllm.triton.llm_inflight import LLMInflightRequests

    seen = []
    server = LLMInflightRequests(
        _ScriptedEngine(),
        decoupled=True,
        exclude_input_in_output=True,
        cancellation_check_ms=10,
        on_finished=seen.append,
    )
    request = fake.InferenceRequest(
        {
            "input_ids": np.array([[5, 6, 7], [8, 9, 0]], dtype=np.int32),
            "input_lengths": np.array([3, 2], dtype=np.int32),
            "request_output_len": np.array([3, 3], dtype=np.int32),
        }
    )
    server.submit(request)
    wait_finished(request)
    server.shutdown()
    assert sorted(len(output.prompt_token_ids) for output in seen) == [2, 3]


def test_a_failing_metrics_hook_does_not_cost_the_client_its_response():
    import numpy as np

    from tritonllm.triton.llm_inflight import LLMInflightRequests

    def broken(_output):
        raise RuntimeError("metrics down")

    server = LLMInflightRequests(
        _ScriptedEngine(), decoupled=True, exclude_input_in_output=True, cancellation_check_ms=10, on_finished=broken
    )
    request = fake.InferenceRequest(
        {
            "input_ids": np.array([[5, 6]], dtype=np.int32),
            "input_lengths": np.array([2], dtype=np.int32),
            "request_output_len": np.array([3], dtype=np.int32),
        }
    )
    server.submit(request)
    wait_finished(request)
    server.shutdown()
    ((response, _flags),) = request.get_response_sender().sent
    assert not response.has_error()


def test_speculative_requests_add_their_draft_counts_and_acceptance_rate(pb_utils):
    from tritonllm.triton.request_metrics import ACCEPTANCE_RATE, ACCEPTED_DRAFT_TOKENS, DRAFT_TOKENS

    metrics = RequestMetrics("tensorrt_llm", "1")
    plain = completion(4, first_ms=2, last_ms=5)
    drafted = completion(6, first_ms=2, last_ms=5)
    drafted.request_perf_metrics.total_draft_tokens, drafted.request_perf_metrics.total_accepted_draft_tokens = 8, 6
    metrics.observe(finished(3, plain))
    metrics.observe(finished(3, drafted))
    observed = {
        name: metrics.histograms[name].observations for name in (DRAFT_TOKENS, ACCEPTED_DRAFT_TOKENS, ACCEPTANCE_RATE)
    }
    assert observed == {DRAFT_TOKENS: [8], ACCEPTED_DRAFT_TOKENS: [6], ACCEPTANCE_RATE: [0.75]}
