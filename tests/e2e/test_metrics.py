"""`curl :METRICS_PORT/metrics` after a burst of requests to `tensorrt_llm`: every family of contract row 28 with
the `model` and `version` labels, and histogram counts that agree with what was sent and generated.

The session's server also serves the other tests, so the histograms are compared before and after the burst."""

from __future__ import annotations

import time

import e2e_clients as clients
import pytest

pytestmark = pytest.mark.server

LABELS = {"model": "tensorrt_llm", "version": "1"}
TOKEN_BUCKETS = ("10", "50", "100", "500", "1000", "+Inf")
# One prompt per token-length bucket (and more than one in the lowest); max_tokens spread over the buckets too.
PROMPT_LENGTHS = (3, 7, 30, 75, 260, 700)
MAX_TOKENS = (1, 12, 4, 60, 2, 120)
GAUGES = {
    "nv_trt_llm_request_metrics": ("request_type", {"active", "max", "scheduled", "context", "waiting"}),
    "nv_trt_llm_runtime_memory_metrics": ("memory_type", {"cpu", "gpu", "pinned"}),
    "nv_trt_llm_kv_cache_block_metrics": (
        "kv_cache_block_type",
        {"max", "free", "used", "tokens_per", "fraction", "reused"},
    ),
    "nv_trt_llm_inflight_batcher_metrics": (
        "inflight_batcher_specific_metric",
        {"total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"},
    ),
    "nv_trt_llm_general_metrics": ("general_type", {"timestamp", "iteration_counter"}),
}


def histogram(samples: list, name: str, **labels) -> dict:
    """{"count": n, "sum": s, "buckets": {le: cumulative count}} of the histogram with these labels."""
    wanted = {**LABELS, **labels}
    mine = [s for s in samples if s.name.startswith(name + "_") and wanted.items() <= s.labels.items()]
    return {
        "count": sum(s.value for s in mine if s.name == name + "_count"),
        "sum": sum(s.value for s in mine if s.name == name + "_sum"),
        "buckets": {s.labels["le"]: s.value for s in mine if s.name == name + "_bucket"},
    }


def difference(after: dict, before: dict) -> dict:
    return {
        "count": after["count"] - before["count"],
        "sum": after["sum"] - before["sum"],
        "buckets": {le: value - before["buckets"].get(le, 0) for le, value in after["buckets"].items()},
    }


def cumulative_counts(values, boundaries=TOKEN_BUCKETS) -> dict:
    return {le: sum(1 for v in values if le == "+Inf" or v <= float(le)) for le in boundaries}


def prompt(length: int, vocab_size: int) -> list[int]:
    return [3 + (7 * i) % (vocab_size - 3) for i in range(length)]


def burst(server, tokenizer) -> list[int]:
    """Send every request at once on one gRPC stream; the generated token count of each."""
    stream = server.grpc_stream()
    try:
        for index, (length, max_tokens) in enumerate(zip(PROMPT_LENGTHS, MAX_TOKENS)):
            stream.send(
                "tensorrt_llm",
                clients.direct_request(
                    prompt(length, tokenizer.vocab_size), max_tokens, tokenizer.end_id, exclude_input_in_output=True
                ),
                request_id=f"burst-{index}",
            )
        generated: dict[str, int] = {}
        while len(generated) < len(PROMPT_LENGTHS):
            result, error = stream.next_event(timeout=120)
            assert error is None, error
            output_ids = result.as_numpy("output_ids")
            if output_ids is not None:
                generated[result.get_response().id] = output_ids.shape[-1]
    finally:
        stream.close()
    return [generated[f"burst-{index}"] for index in range(len(PROMPT_LENGTHS))]


@pytest.fixture(scope="module")
def scrape(server, tokenizer):
    """(metrics before, metrics after, generated token counts) around one burst."""
    server.wait_engine_idle()
    before = clients.parse_samples(server.metrics_text())
    generated = burst(server, tokenizer)
    deadline = time.monotonic() + 10
    while True:  # observations land before each final response is sent; allow the scrape a moment anyway
        text = server.metrics_text()
        after = clients.parse_samples(text)
        observed = difference(histogram(after, "nv_llm_input_token_len"), histogram(before, "nv_llm_input_token_len"))
        if observed["count"] >= len(PROMPT_LENGTHS) or time.monotonic() > deadline:
            return before, after, generated, text


def test_input_token_histogram_counts_every_prompt_in_the_contract_buckets(scrape):
    before, after, _, _ = scrape
    name = "nv_llm_input_token_len"
    delta = difference(
        histogram(after, name, response_metric_type="total_input_tokens"),
        histogram(before, name, response_metric_type="total_input_tokens"),
    )
    assert delta["count"] == len(PROMPT_LENGTHS)
    assert delta["sum"] == sum(PROMPT_LENGTHS)
    assert delta["buckets"] == cumulative_counts(PROMPT_LENGTHS)


def test_output_token_histogram_counts_every_generated_token(scrape):
    before, after, generated, _ = scrape
    name = "nv_llm_output_token_len"
    delta = difference(
        histogram(after, name, response_metric_type="total_output_tokens"),
        histogram(before, name, response_metric_type="total_output_tokens"),
    )
    assert delta["count"] == len(MAX_TOKENS)
    assert delta["sum"] == sum(generated)
    assert delta["buckets"] == cumulative_counts(generated)
    assert all(1 <= count <= limit for count, limit in zip(generated, MAX_TOKENS))


def test_latency_histograms_observe_each_request(scrape):
    before, after, generated, _ = scrape
    first_token = difference(
        histogram(after, "nv_llm_time_to_first_token_seconds"), histogram(before, "nv_llm_time_to_first_token_seconds")
    )
    assert first_token["count"] == len(PROMPT_LENGTHS)
    assert 0 < first_token["sum"] < 120
    inter_token = difference(
        histogram(after, "nv_llm_inter_token_latency_seconds"), histogram(before, "nv_llm_inter_token_latency_seconds")
    )
    assert inter_token["count"] == sum(1 for count in generated if count >= 2)
    for delta in (first_token, inter_token):
        counts = list(delta["buckets"].values())
        assert counts == sorted(counts) and counts[-1] == delta["count"]  # cumulative, +Inf holds them all


def test_histograms_are_typed_and_labelled_as_the_contract_says(scrape):
    _, after, _, text = scrape
    for name in (
        "nv_llm_input_token_len",
        "nv_llm_output_token_len",
        "nv_llm_time_to_first_token_seconds",
        "nv_llm_inter_token_latency_seconds",
    ):
        assert f"# TYPE {name} histogram" in text
    buckets = [
        s.labels["le"]
        for s in after
        if s.name == "nv_llm_input_token_len_bucket" and s.labels.get("model") == "tensorrt_llm"
    ]
    assert [float(le) for le in buckets] == [float(le) for le in TOKEN_BUCKETS]


def test_every_gauge_family_of_the_contract_is_exported_with_model_and_version(scrape):
    _, after, _, text = scrape
    for family, (kind_label, kinds) in GAUGES.items():
        assert f"# TYPE {family} gauge" in text
        found = {s.labels[kind_label] for s in after if s.name == family and LABELS.items() <= s.labels.items()}
        assert found == kinds, family


def test_gauges_agree_with_an_idle_engine_after_the_burst(server, scrape):
    before, _, _, _ = scrape
    idle = server.wait_engine_idle()
    assert clients.engine_is_idle(idle), idle
    assert idle[("nv_trt_llm_kv_cache_block_metrics", "fraction")] == 0
    assert idle[("nv_trt_llm_runtime_memory_metrics", "cpu")] > 50 * 2**20  # a stub with torch and a model loaded
    assert abs(idle[("nv_trt_llm_general_metrics", "timestamp")] / 1e6 - time.time()) < 60  # microseconds
    iterations_before = next(
        s.value
        for s in before
        if s.name == "nv_trt_llm_general_metrics"
        and s.labels.get("general_type") == "iteration_counter"
        and s.labels.get("model") == "tensorrt_llm"
    )
    assert idle[("nv_trt_llm_general_metrics", "iteration_counter")] > iterations_before
