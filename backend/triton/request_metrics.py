"""Per-request histograms of an LLM model, observed once per engine request (one batch row) when it finishes.

  nv_llm_input_token_len{response_metric_type="total_input_tokens"}    prompt tokens
  nv_llm_output_token_len{response_metric_type="total_output_tokens"}  generated tokens, all sequences of the row
  nv_llm_time_to_first_token_seconds                                   engine arrival -> first generated token
  nv_llm_inter_token_latency_seconds                                   mean gap between a sequence's tokens
  nv_llm_spec_draft_tokens / nv_llm_spec_accepted_draft_tokens         draft tokens proposed / accepted
  nv_llm_spec_acceptance_rate                                          accepted / proposed, per request

All carry the `model` and `version` labels. The token-length buckets are TensorRT-LLM's (10, 50, 100, 500,
1000; contract row 28). The two latency histograms are this package's answer to pain point P14 (TensorRT-LLM
exports none). Their times come from the engine's per-request timestamps (`RequestPerfMetrics`), so streaming and
non-streaming requests are measured alike; a request whose engine gave no timestamps is left out of them.
The speculative-decoding histograms count only requests that had draft tokens (sum and count give the totals).
Cancelled requests count too: their tokens were generated."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..engine.types import RequestOutput
from .pb import pb_utils

TOKEN_BUCKETS = (10, 50, 100, 500, 1000)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ACCEPTANCE_RATE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

INPUT_TOKENS = "nv_llm_input_token_len"
OUTPUT_TOKENS = "nv_llm_output_token_len"
TIME_TO_FIRST_TOKEN = "nv_llm_time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "nv_llm_inter_token_latency_seconds"
DRAFT_TOKENS = "nv_llm_spec_draft_tokens"
ACCEPTED_DRAFT_TOKENS = "nv_llm_spec_accepted_draft_tokens"
ACCEPTANCE_RATE = "nv_llm_spec_acceptance_rate"

# family name -> (description, extra labels, buckets)
HISTOGRAMS = {
    INPUT_TOKENS: (
        "Prompt length of finished LLM requests, in tokens",
        {"response_metric_type": "total_input_tokens"},
        TOKEN_BUCKETS,
    ),
    OUTPUT_TOKENS: (
        "Generated length of finished LLM requests, in tokens",
        {"response_metric_type": "total_output_tokens"},
        TOKEN_BUCKETS,
    ),
    TIME_TO_FIRST_TOKEN: (
        "Time from a request's arrival at the engine to its first generated token, in seconds",
        {},
        TIME_TO_FIRST_TOKEN_BUCKETS,
    ),
    INTER_TOKEN_LATENCY: (
        "Mean time between consecutive generated tokens of a sequence, in seconds",
        {},
        INTER_TOKEN_LATENCY_BUCKETS,
    ),
    DRAFT_TOKENS: ("Speculative draft tokens proposed for a finished request", {}, TOKEN_BUCKETS),
    ACCEPTED_DRAFT_TOKENS: (
        "Speculative draft tokens the target model accepted, per finished request",
        {},
        TOKEN_BUCKETS,
    ),
    ACCEPTANCE_RATE: (
        "Accepted / proposed speculative draft tokens of a finished request",
        {},
        ACCEPTANCE_RATE_BUCKETS,
    ),
}


@dataclass(frozen=True)
class RequestObservation:
    """What one finished engine request adds to the histograms."""

    input_tokens: int
    output_tokens: int
    time_to_first_token: Optional[float] = None  # seconds; None without engine timestamps
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, one per sequence of >= 2 tokens
    draft_tokens: int = 0  # speculative decoding: proposed and accepted draft tokens, all sequences of the row
    accepted_draft_tokens: int = 0


def observe_request(output: RequestOutput) -> RequestObservation:
    """The observation of a finished RequestOutput (its `token_ids` are the generated tokens only)."""
    return RequestObservation(
        input_tokens=len(output.prompt_token_ids),
        output_tokens=sum(len(completion.token_ids) for completion in output.outputs),
        time_to_first_token=time_to_first_token(output),
        inter_token_latencies=[
            latency for latency in map(mean_inter_token_latency, output.outputs) if latency is not None
        ],
        draft_tokens=sum(m.total_draft_tokens for m in _timings(output)),
        accepted_draft_tokens=sum(m.total_accepted_draft_tokens for m in _timings(output)),
    )


def _timings(output: RequestOutput) -> list:
    return [c.request_perf_metrics for c in output.outputs if c.request_perf_metrics is not None]


def time_to_first_token(output: RequestOutput) -> Optional[float]:
    timings = [c.request_perf_metrics for c in output.outputs if c.request_perf_metrics is not None]
    arrivals = [t.arrival_time_ns for t in timings if t.arrival_time_ns > 0]
    first_tokens = [t.first_token_time_ns for t in timings if t.first_token_time_ns > 0]
    if not arrivals or not first_tokens:
        return None
    return max(min(first_tokens) - min(arrivals), 0) / 1e9


def mean_inter_token_latency(completion: Any) -> Optional[float]:
    timing = completion.request_perf_metrics
    gaps = len(completion.token_ids) - 1
    if timing is None or gaps < 1 or not timing.first_token_time_ns or not timing.last_token_time_ns:
        return None
    return max(timing.last_token_time_ns - timing.first_token_time_ns, 0) / gaps / 1e9


def report_finished(
    on_finished: Optional[Callable[[RequestOutput], None]], output: RequestOutput, log: logging.Logger
) -> None:
    """Hand a finished request to the model's metrics hook, if any; a failure there is logged, never raised (metrics
    must never cost a client its response)."""
    if on_finished is None:
        return
    try:
        on_finished(output)
    except Exception:
        log.exception("could not record the metrics of a finished request")


class RequestMetrics:
    """The histograms of one model instance; `observe(output)` records a finished engine request."""

    def __init__(self, model: str, version: str):
        pb = pb_utils()
        labels = {"model": model, "version": str(version)}
        # The stub frees a family's metrics with the family: keep both for as long as this object lives.
        self.families = {
            name: pb.MetricFamily(name=name, description=description, kind=pb.MetricFamily.HISTOGRAM)
            for name, (description, _, _) in HISTOGRAMS.items()
        }
        self.histograms = {
            name: self.families[name].Metric(labels={**extra, **labels}, buckets=list(buckets))
            for name, (_, extra, buckets) in HISTOGRAMS.items()
        }

    def release(self) -> None:
        """Free the histograms, then their families, while the stub can still clear them: left to the stub's own
        teardown, they are freed after its shared memory and it crashes (a segfault on every shutdown)."""
        self.histograms.clear()
        self.families.clear()

    def observe(self, output: RequestOutput) -> None:
        if not self.histograms:  # released: the model is being finalized
            return
        observation = observe_request(output)
        self.histograms[INPUT_TOKENS].observe(observation.input_tokens)
        self.histograms[OUTPUT_TOKENS].observe(observation.output_tokens)
        if observation.time_to_first_token is not None:
            self.histograms[TIME_TO_FIRST_TOKEN].observe(observation.time_to_first_token)
        for latency in observation.inter_token_latencies:
            self.histograms[INTER_TOKEN_LATENCY].observe(latency)
        if observation.draft_tokens:
            self.histograms[DRAFT_TOKENS].observe(observation.draft_tokens)
            self.histograms[ACCEPTED_DRAFT_TOKENS].observe(observation.accepted_draft_tokens)
            self.histograms[ACCEPTANCE_RATE].observe(observation.accepted_draft_tokens / observation.draft_tokens)
