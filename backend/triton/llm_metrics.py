"""Prometheus gauges of an LLM model (`tensorrt_llm`, either flavour), refreshed from the engine's counters.

TensorRT-LLM's backend exports the executor's iteration stats as `nv_trt_llm_*` gauge families (contract row 28).
Every value carries the `model` and `version` labels and one label naming what it counts:

  nv_trt_llm_request_metrics{request_type=active|max|scheduled|context|waiting}
  nv_trt_llm_runtime_memory_metrics{memory_type=cpu|gpu|pinned}
  nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max|free|used|tokens_per|fraction|reused}
  nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric=total_context_tokens|generation_requests|
                                      micro_batch_id|paused_requests}
  nv_trt_llm_general_metrics{general_type=timestamp|iteration_counter}

A thread sets them every `stats_check_period_ms`, so Triton's metrics endpoint (port 8002 by default) shows from
outside the server whether the engine is idle and its KV cache free. The timestamp is in microseconds since the
epoch, as TensorRT-LLM's C++ backend reports it and its CI parses it (contract Q8; the anchor's Python model
reported seconds). docs/metrics.md says what each value means here and which ones are approximations."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Mapping

from .pb import pb_utils
from .runtime_memory import runtime_memory

log = logging.getLogger("tritonllm.metrics")

REQUESTS = "nv_trt_llm_request_metrics"
MEMORY = "nv_trt_llm_runtime_memory_metrics"
KV_CACHE = "nv_trt_llm_kv_cache_block_metrics"
INFLIGHT_BATCHER = "nv_trt_llm_inflight_batcher_metrics"
GENERAL = "nv_trt_llm_general_metrics"

# family name -> (description, the label naming the value, its values)
FAMILIES = {
    REQUESTS: (
        "Requests in the LLM engine, by state",
        "request_type",
        ("active", "max", "scheduled", "context", "waiting"),
    ),
    MEMORY: ("Memory used by the LLM runtime, in bytes", "memory_type", ("cpu", "gpu", "pinned")),
    KV_CACHE: (
        "Paged KV cache blocks of the LLM engine",
        "kv_cache_block_type",
        ("max", "free", "used", "tokens_per", "fraction", "reused"),
    ),
    INFLIGHT_BATCHER: (
        "In-flight batching state of the last engine iteration",
        "inflight_batcher_specific_metric",
        ("total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"),
    ),
    GENERAL: (
        "LLM engine clock: iterations run and when the gauges were sampled (microseconds since the epoch)",
        "general_type",
        ("timestamp", "iteration_counter"),
    ),
}
GAUGES = tuple((family, kind) for family, (_, _, kinds) in FAMILIES.items() for kind in kinds)


def gauge_values(stats: Any, now: float, memory: Mapping[str, int]) -> dict[tuple[str, str], float]:
    """(family, label value) -> value, from an engine stats object (EngineStats' fields), the time `now` (seconds
    since the epoch) and `memory` (runtime_memory()'s bytes per memory_type).

    Iteration details the engine may not report (which running requests are in their context phase, how many
    prompt tokens the last step ran, paused requests) are read when its stats carry them and are 0 otherwise;
    then every running request counts as a generation request."""
    used = stats.num_total_blocks - stats.num_free_blocks
    context = getattr(stats, "num_context_requests", 0)
    values = {
        (REQUESTS, "active"): stats.num_running + stats.num_waiting,
        (REQUESTS, "max"): stats.max_batch_size,
        (REQUESTS, "scheduled"): stats.num_running,
        (REQUESTS, "context"): context,
        (REQUESTS, "waiting"): stats.num_waiting,
        (KV_CACHE, "max"): stats.num_total_blocks,
        (KV_CACHE, "free"): stats.num_free_blocks,
        (KV_CACHE, "used"): used,
        (KV_CACHE, "tokens_per"): stats.tokens_per_block,
        (KV_CACHE, "fraction"): used / stats.num_total_blocks if stats.num_total_blocks > 0 else 0.0,
        (KV_CACHE, "reused"): getattr(stats, "num_reused_blocks", 0),
        (INFLIGHT_BATCHER, "total_context_tokens"): getattr(stats, "num_context_tokens", 0),
        (INFLIGHT_BATCHER, "generation_requests"): max(stats.num_running - context, 0),
        (INFLIGHT_BATCHER, "micro_batch_id"): 0,  # one micro-batch: no pipeline parallelism
        (INFLIGHT_BATCHER, "paused_requests"): getattr(stats, "num_paused_requests", 0),
        (GENERAL, "timestamp"): int(now * 1_000_000),
        (GENERAL, "iteration_counter"): stats.num_steps,
    }
    values.update({(MEMORY, kind): memory.get(kind, 0) for kind in FAMILIES[MEMORY][2]})
    return values


class EngineMetrics:
    """Gauges for one model instance; `start()` runs the refresh thread, `stop()` ends it."""

    def __init__(
        self,
        read_stats: Callable[[], Any],
        model: str,
        version: str,
        period_ms: int,
        read_memory: Callable[[], Mapping[str, int]] = runtime_memory,
    ):
        self.read_stats = read_stats
        self.read_memory = read_memory
        self.period = max(period_ms, 1) / 1000
        # The stub frees a family's metrics with the family: both must live as long as this object.
        self.families, self.gauges = self._create_gauges({"model": model, "version": str(version)})
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tritonllm-metrics", daemon=True)

    @staticmethod
    def _create_gauges(labels: dict[str, str]) -> tuple[dict[str, Any], dict[tuple[str, str], Any]]:
        pb = pb_utils()
        families = {
            name: pb.MetricFamily(name=name, description=description, kind=pb.MetricFamily.GAUGE)
            for name, (description, _, _) in FAMILIES.items()
        }
        gauges = {
            (name, kind): families[name].Metric(labels={FAMILIES[name][1]: kind, **labels}) for name, kind in GAUGES
        }
        return families, gauges

    def start(self) -> "EngineMetrics":
        self.update()
        self.thread.start()
        return self

    def update(self) -> None:
        for key, value in gauge_values(self.read_stats(), time.time(), self.read_memory()).items():
            self.gauges[key].set(float(value))

    def _loop(self) -> None:
        failed = False
        while not self.stopping.wait(self.period):
            try:
                self.update()
                failed = False
            except Exception:  # a metrics hiccup must never disturb serving; say so once per failure streak
                if not failed:
                    log.exception("could not refresh the engine metrics")
                failed = True

    def stop(self, timeout: float = 5.0) -> None:
        """Stop refreshing and free the gauges, then their families, while the stub can still clear them (see
        RequestMetrics.release)."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if not self.thread.is_alive():
            self.gauges.clear()
            self.families.clear()
