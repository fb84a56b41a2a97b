"""Prometheus gauges of the `tensorrt_llm` model, refreshed from the engine's counters.

TensorRT-LLM's backend exports the executor's iteration stats as `nv_trt_llm_*` gauge families (contract row 28),
labelled with `model` and `version`; this module exports the subset the engine's `stats()` can fill truthfully:

  nv_trt_llm_request_metrics{request_type="active"|"max"|"scheduled"|"waiting"}
  nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"|"free"|"used"|"tokens_per"}
  nv_trt_llm_general_metrics{general_type="iteration_counter"|"timestamp"}

"active" counts every request the engine holds (running or waiting for KV blocks), "scheduled" the running ones,
"max" the engine's batch limit. A thread sets them every `stats_check_period_ms`, so Triton's metrics endpoint
(port 8002 by default) shows whether the engine is idle and its KV cache free, from outside the server process."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from .pb import pb_utils

log = logging.getLogger("tritonllm.tensorrt_llm")

# family name -> (description, label naming the value's kind)
FAMILIES = {
    "nv_trt_llm_request_metrics": ("TRT LLM request metrics", "request_type"),
    "nv_trt_llm_kv_cache_block_metrics": ("TRT LLM KV cache block metrics", "kv_cache_block_type"),
    "nv_trt_llm_general_metrics": ("General TRT LLM metrics", "general_type"),
}
GAUGES = tuple((family, kind) for family, kinds in (
    ("nv_trt_llm_request_metrics", ("active", "max", "scheduled", "waiting")),
    ("nv_trt_llm_kv_cache_block_metrics", ("max", "free", "used", "tokens_per")),
    ("nv_trt_llm_general_metrics", ("iteration_counter", "timestamp")),
) for kind in kinds)


def gauge_values(stats: Any, now: float) -> dict[tuple[str, str], float]:
    """(family, kind label) -> value, from an engine stats object (EngineStats' fields)."""
    used = stats.num_total_blocks - stats.num_free_blocks
    return {
        ("nv_trt_llm_request_metrics", "active"): stats.num_running + stats.num_waiting,
        ("nv_trt_llm_request_metrics", "max"): stats.max_batch_size,
        ("nv_trt_llm_request_metrics", "scheduled"): stats.num_running,
        ("nv_trt_llm_request_metrics", "waiting"): stats.num_waiting,
        ("nv_trt_llm_kv_cache_block_metrics", "max"): stats.num_total_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "free"): stats.num_free_blocks,
        ("nv_trt_llm_kv_cache_block_metrics", "used"): used,
        ("nv_trt_llm_kv_cache_block_metrics", "tokens_per"): stats.tokens_per_block,
        ("nv_trt_llm_general_metrics", "iteration_counter"): stats.num_steps,
        ("nv_trt_llm_general_metrics", "timestamp"): now,  # seconds, as TensorRT-LLM's Python model reports
    }


class EngineMetrics:
    """Gauges for one model instance; `start()` runs the refresh thread, `stop()` ends it."""

    def __init__(self, read_stats: Callable[[], Any], model: str, version: str, period_ms: int):
        self.read_stats = read_stats
        self.period = max(period_ms, 1) / 1000
        # The stub frees a family's metrics with the family: both must live as long as this object.
        self.families, self.gauges = self._create_gauges({"model": model, "version": str(version)})
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tritonllm-metrics", daemon=True)

    @staticmethod
    def _create_gauges(labels: dict[str, str]) -> tuple[dict[str, Any], dict[tuple[str, str], Any]]:
        pb = pb_utils()
        families = {name: pb.MetricFamily(name=name, description=description, kind=pb.MetricFamily.GAUGE)
                    for name, (description, _) in FAMILIES.items()}
        gauges = {(name, kind): families[name].Metric(labels={FAMILIES[name][1]: kind, **labels})
                  for name, kind in GAUGES}
        return families, gauges

    def start(self) -> "EngineMetrics":
        self.update()
        self.thread.start()
        return self

    def update(self) -> None:
        for key, value in gauge_values(self.read_stats(), time.time()).items():
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
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

