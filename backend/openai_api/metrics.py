"""The frontend's Prometheus metrics (GET /metrics), in a registry of its own so that several apps in one
process (tests) keep separate counts. Engine-side metrics stay on Triton's metrics port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class FrontendMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tritonllm_openai_requests",
            "OpenAI requests answered, by endpoint, model and HTTP status",
            ["endpoint", "model", "status"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "tritonllm_openai_requests_in_flight",
            "OpenAI requests being answered",
            ["endpoint"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tritonllm_openai_prompt_tokens", "prompt tokens of answered requests", ["model"], registry=self.registry
        )
        self.completion_tokens = Counter(
            "tritonllm_openai_completion_tokens",
            "tokens generated for answered requests",
            ["model"],
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "tritonllm_openai_request_duration_seconds",
            "time from a request's arrival to its last byte",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.first_token_latency = Histogram(
            "tritonllm_openai_time_to_first_token_seconds",
            "time from a request's arrival to its first generated text",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def finished(
        self, endpoint: str, model: str, status: int, seconds: float, prompt_tokens: int = 0, completion_tokens: int = 0
    ) -> None:
        self.requests.labels(endpoint, model, str(status)).inc()
        self.request_latency.labels(endpoint).observe(seconds)
        if prompt_tokens or completion_tokens:
            self.prompt_tokens.labels(model).inc(prompt_tokens)
            self.completion_tokens.labels(model).inc(completion_tokens)
