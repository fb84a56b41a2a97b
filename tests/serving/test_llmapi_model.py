"""The LLM-API `tensorrt_llm` model run in-process: a repository from `build_llmapi_repo` for a tiny random model,
the real embedded engine, and a fake pb_utils standing in for Triton (auto_complete_config, requests, senders,
metrics). The real server is exercised by tests/e2e/test_llmapi.py."""

from __future__ import annotations

import time
from pathlib import Path

import fake_pb_utils as fake  # registered by conftest.py
import numpy as np
import pytest

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.deploy.llmapi_repo import build_llmapi_repo
from tritonllm.engine import SamplingParams
from tritonllm.triton.llmapi_inflight import LLMAPIInflightRequests

PROMPT = "The lamp turned"
TYPES = {bool: np.bool_, int: np.int32, float: np.float32}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    model = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return build_llmapi_repo(model, tmp_path_factory.mktemp("llmapi") / "repo", max_seq_len=256, max_batch_size=4)


@pytest.fixture(scope="module")
def model(repo, load_llmapi_model):
    """The loaded model (module-scoped: the engine takes a few seconds), with the fake pb_utils installed."""
    with load_llmapi_model(repo) as instance:
        yield instance


def request(prompt=PROMPT, request_id: str = "", **inputs) -> fake.InferenceRequest:
    tensors = {} if prompt is None else {"text_input": np.array([prompt.encode()], dtype=object)}
    for name, value in inputs.items():
        tensors[name] = value if isinstance(value, np.ndarray) else np.array([value], dtype=TYPES[type(value)])
    return fake.InferenceRequest(tensors, request_id=request_id)


def run(model, req, timeout: float = 60) -> list:
    """Execute one request; the (response, flags) it got once its final response was sent."""
    model.execute([req])
    return wait_final(req, timeout)


def wait_final(req, timeout: float = 60) -> list:
    sender = req.get_response_sender()
    deadline = time.monotonic() + timeout
    while not sender.finished:
        assert time.monotonic() < deadline, f"no final response within {timeout}s"
        time.sleep(0.005)
    return sender.sent


def outputs(response) -> dict:
    assert not response.has_error(), response.error().message()
    return {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}


def text(response) -> str:
    return outputs(response)["text_output"][0].decode()


def wait_idle(model, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while True:
        stats = model.engine.stats()
        if stats.num_running + stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.01)


ALL_OUTPUTS = dict(return_finish_reason=True, return_stop_reason=True, return_cumulative_logprob=True)


def test_auto_complete_takes_triton_config_from_model_yaml(model, repo):
    from tritonllm.models.llmapi import TritonPythonModel

    config = TritonPythonModel.auto_complete_config(fake.ModelConfig({"name": "tensorrt_llm"})).as_dict()
    assert config["max_batch_size"] == 0 and config["model_transaction_policy"] == {"decoupled": True}


def test_a_plain_request_gets_one_final_response_with_typed_outputs(model):
    ((response, flags),) = run(model, request(sampling_param_max_tokens=6, **ALL_OUTPUTS))
    assert flags == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    values = outputs(response)
    assert values["text_output"].dtype == object and values["text_output"].shape == (1,)
    assert values["text_output"][0].decode().startswith(PROMPT)  # exclude_input_from_output defaults to false
    assert values["finish_reason"].tolist() in ([b"length"], [b"stop"])
    assert values["stop_reason"].tolist() == [b"None"]
    assert values["cumulative_logprob"].dtype == np.float32 and values["cumulative_logprob"].shape == (1,)
    assert values["cumulative_logprob"][0] < 0


def test_only_the_requested_optional_outputs_are_sent(model):
    ((response, _),) = run(model, request(sampling_param_max_tokens=2))
    assert set(outputs(response)) == {"text_output"}


def test_streaming_sends_cumulative_text_ending_as_the_plain_answer(model):
    ((plain, _),) = run(model, request(sampling_param_max_tokens=12, sampling_param_exclude_input_from_output=True))
    sent = run(model, request(sampling_param_max_tokens=12, streaming=True, return_finish_reason=True))
    texts = [text(response) for response, _ in sent]
    assert len(sent) > 1 and [flags for _, flags in sent][-1] == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert texts[-1] == text(plain)  # a stream never echoes the prompt
    assert [outputs(r)["finish_reason"][0] for r, _ in sent][:-1] == [b"None"] * (len(sent) - 1)


def test_a_stop_string_ends_the_answer_and_is_named_as_the_stop_reason(model):
    ((plain, _),) = run(model, request(sampling_param_max_tokens=24, sampling_param_exclude_input_from_output=True))
    full = text(plain)
    stop = full[6:9]
    assert stop.strip(), f"pick another slice of {full!r}"
    ((response, _),) = run(
        model,
        request(
            sampling_param_max_tokens=24,
            sampling_param_exclude_input_from_output=True,
            sampling_param_stop=np.array([stop.encode()], dtype=object),
            **ALL_OUTPUTS,
        ),
    )
    values = outputs(response)
    assert text(response) == full[: full.index(stop)]
    assert values["finish_reason"].tolist() == [b"stop"] and values["stop_reason"].tolist() == [stop.encode()]
    wait_idle(model)  # the engine request was stopped and its blocks freed


def test_best_of_returns_the_most_likely_of_its_samples(model):
    inputs = dict(
        sampling_param_max_tokens=5,
        sampling_param_temperature=1.0,
        sampling_param_best_of=3,
        sampling_param_seed=np.array([7], dtype=np.uint64),
        sampling_param_exclude_input_from_output=True,
        return_cumulative_logprob=True,
    )
    ((response, _),) = run(model, request(**inputs))
    values = outputs(response)
    assert values["text_output"].shape == (1,)
    samples = model.engine.generate(
        model.inflight.tokenizer.encode(PROMPT, add_special_tokens=True),
        SamplingParams(
            max_tokens=5, temperature=1.0, n=3, seed=7, logprobs=True, end_id=model.inflight.tokenizer.end_id
        ),
    )
    best = max(samples.outputs, key=lambda c: c.cumulative_logprob)
    assert values["cumulative_logprob"][0] == pytest.approx(best.cumulative_logprob, abs=1e-3)


def test_a_cancelled_request_aborts_its_engine_request(model):
    wait_idle(model)
    steps_before = model.engine.stats().num_steps
    req = request(sampling_param_max_tokens=200, streaming=True)
    model.execute([req])
    sender = req.get_response_sender()
    deadline = time.monotonic() + 30
    while len(sender.sent) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    req.cancel()
    sent = wait_final(req)
    last, flags = sent[-1]
    assert flags == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert last.has_error() and last.error().code() == fake.TritonError.CANCELLED
    assert wait_idle(model).num_steps - steps_before < 150


def wait_sent(req, count: int, timeout: float = 30) -> None:
    sender = req.get_response_sender()
    deadline = time.monotonic() + timeout
    while len(sender.sent) < count:
        assert time.monotonic() < deadline, f"fewer than {count} responses within {timeout}s"
        time.sleep(0.005)


@pytest.mark.parametrize("streaming", [True, False])
def test_a_stop_request_with_a_running_requests_id_aborts_it_and_both_get_tensorrt_llms_answers(model, streaming):
    wait_idle(model)
    steps_before = model.engine.stats().num_steps
    running = request(request_id="stop-me", sampling_param_max_tokens=200, streaming=streaming, **ALL_OUTPUTS)
    model.execute([running])
    if streaming:
        wait_sent(running, 2)
    else:  # no response to wait for: wait until the engine runs it
        deadline = time.monotonic() + 30
        while model.engine.stats().num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.002)
    ((stop_answer, stop_flags),) = run(model, request("", request_id="stop-me", stop=True))
    assert stop_flags == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert stop_answer.error().code() == fake.TritonError.CANCELLED
    assert stop_answer.error().message() == "Request cancelled by client"
    last, flags = wait_final(running)[-1]
    assert flags == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    values = outputs(last)  # a normal last response with the text so far, as TensorRT-LLM's stopped stream ends
    assert values["finish_reason"].tolist() == [b"cancelled"]
    assert wait_idle(model).num_steps - steps_before < 150


def test_a_stop_request_for_an_unknown_id_is_answered_not_found_and_disturbs_nobody(model):
    other = request(request_id="busy", sampling_param_max_tokens=40, streaming=True, return_finish_reason=True)
    model.execute([other])
    ((answer, _),) = run(model, request("", request_id="nobody", stop=True))
    assert answer.error().code() == fake.TritonError.NOT_FOUND
    assert "'nobody'" in answer.error().message() and "'stop'" in answer.error().message()
    last, _ = wait_final(other)[-1]
    assert outputs(last)["finish_reason"].tolist() in ([b"length"], [b"stop"])


def test_a_stop_request_without_an_id_is_refused_by_name(model):
    ((answer, _),) = run(model, request("", stop=True))
    assert answer.error().code() == fake.TritonError.INVALID_ARG
    assert "'stop'" in answer.error().message() and "request id must be provided" in answer.error().message()


@pytest.mark.parametrize(
    "inputs, named",
    [
        (dict(prompt=None), "text_input"),
        (dict(sampling_param_max_tokens=0), "sampling_param_max_tokens"),
        (dict(sampling_param_max_tokens=1000), "sampling_param_max_tokens"),  # beyond max_seq_len 256
    ],
)
def test_errors_name_the_input_and_carry_na_text(model, inputs, named):
    ((response, flags),) = run(model, request(**inputs))
    assert flags == fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert response.has_error() and f"'{named}'" in response.error().message()
    assert response.error().code() == fake.TritonError.INVALID_ARG
    assert [t.as_numpy().tolist() for t in response.output_tensors()] == [[b"N/A"]]


def test_streaming_is_refused_when_the_model_is_not_decoupled(model):
    server = LLMAPIInflightRequests(model.engine, model.inflight.tokenizer, decoupled=False)
    try:
        req = request(streaming=True)
        server.submit(req)
        ((response, _),) = req.get_response_sender().sent
        assert "'streaming'" in response.error().message()
    finally:
        server.shutdown()


def test_finished_requests_feed_the_histograms(model):
    histograms = model.request_metrics.histograms
    before = len(histograms["nv_llm_input_token_len"].observations)
    run(model, request(sampling_param_max_tokens=3))
    deadline = time.monotonic() + 5
    while len(histograms["nv_llm_input_token_len"].observations) == before:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    prompt_len = len(model.inflight.tokenizer.encode(PROMPT, add_special_tokens=True))
    assert histograms["nv_llm_input_token_len"].observations[-1] == prompt_len
    assert 1 <= histograms["nv_llm_output_token_len"].observations[-1] <= 3
    gauges = fake.MetricFamily.families["nv_trt_llm_kv_cache_block_metrics"].metrics
    assert {metric.labels["model"] for metric in gauges} == {"tensorrt_llm"}


PERF_OUTPUTS = {
    "kv_cache_reused_block": np.int32,
    "kv_cache_missed_block": np.int32,
    "kv_cache_alloc_new_blocks": np.int32,
    "kv_cache_alloc_total_blocks": np.int32,
    "kv_cache_hit_rate": np.float32,
    "arrival_time_ns": np.int64,
    "first_scheduled_time_ns": np.int64,
    "first_token_time_ns": np.int64,
    "last_token_time_ns": np.int64,
    "acceptance_rate": np.float32,
    "total_accepted_draft_tokens": np.int32,
    "total_draft_tokens": np.int32,
}


def test_return_perf_metrics_adds_the_kv_cache_and_timing_outputs_with_their_declared_types(model):
    prompt = " ".join(["lamp"] * 80)  # several KV blocks, so that the second request reuses the first one's
    prompt_blocks = -(-len(model.inflight.tokenizer.encode(prompt, add_special_tokens=True)) // 32)
    seen = []
    for _ in range(2):
        ((response, _),) = run(
            model, request(prompt, sampling_param_max_tokens=4, sampling_param_return_perf_metrics=True)
        )
        values = outputs(response)
        assert {name: values[name].dtype for name in PERF_OUTPUTS} == PERF_OUTPUTS
        assert all(values[name].shape == (1,) for name in PERF_OUTPUTS)
        seen.append({name: values[name][0].item() for name in PERF_OUTPUTS})
    first, second = seen
    assert first["kv_cache_reused_block"] == 0 and first["kv_cache_missed_block"] == prompt_blocks
    assert first["kv_cache_hit_rate"] == 0.0
    assert second["kv_cache_reused_block"] > 0  # the prefix cache gave the full prompt blocks
    assert second["kv_cache_reused_block"] + second["kv_cache_missed_block"] == prompt_blocks
    assert second["kv_cache_hit_rate"] == pytest.approx(second["kv_cache_reused_block"] / prompt_blocks)
    for metrics in seen:
        assert metrics["kv_cache_alloc_total_blocks"] >= metrics["kv_cache_alloc_new_blocks"] > 0
        times = [
            metrics[n]
            for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
        ]
        assert 0 < times[0] <= times[1] <= times[2] <= times[3]
        assert (metrics["acceptance_rate"], metrics["total_draft_tokens"]) == (0.0, 0)
    ((plain, _),) = run(model, request(sampling_param_max_tokens=2))
    assert not set(PERF_OUTPUTS) & set(outputs(plain))  # only when asked for


def test_a_lora_request_without_lora_enabled_is_refused_naming_the_lora_inputs(model, tmp_path):
    adapter = {
        "lora_id": np.array([3], dtype=np.uint64),
        "lora_name": np.array([b"mine"], dtype=object),
        "lora_path": np.array([str(tmp_path).encode()], dtype=object),
    }
    ((response, _),) = run(model, request(**adapter))
    message = response.error().message()
    assert message.startswith("inputs 'lora_id', 'lora_name', 'lora_path': ") and "LoRA is not enabled" in message


def test_a_guided_request_without_guided_decoding_backend_is_refused_naming_the_guided_inputs(model):
    ((response, _),) = run(model, request(guided_decoding_guide_type=np.array([b"json"], dtype=object)))
    message = response.error().message()
    assert message.startswith("inputs 'guided_decoding_guide_type', 'guided_decoding_guide': ")
    assert "guided_decoding_backend: xgrammar" in message


def test_with_max_batch_size_every_output_carries_a_batch_dimension_of_one(model):
    server = LLMAPIInflightRequests(model.engine, model.inflight.tokenizer, decoupled=False, batched=True)
    try:
        tensors = {"text_input": np.array([[PROMPT.encode()]], dtype=object)}
        tensors.update(
            {name: np.array([[True]]) for name in ("return_finish_reason", "sampling_param_return_perf_metrics")}
        )
        req = fake.InferenceRequest(tensors)
        server.submit(req)
        ((response, flags),) = wait_final(req)
        values = outputs(response)
        assert values["text_output"].shape == (1, 1) and values["text_output"][0, 0].decode().startswith(PROMPT)
        assert values["finish_reason"].shape == (1, 1) and values["kv_cache_alloc_new_blocks"].shape == (1, 1)
        bad = fake.InferenceRequest({"text_input": np.array([[b"a"], [b"b"]], dtype=object)})
        server.submit(bad)
        ((error, _),) = wait_final(bad)
        assert "'text_input' carries a batch of 2" in error.error().message()
        assert [t.as_numpy().shape for t in error.output_tensors()] == [(1, 1)]
    finally:
        server.shutdown()
