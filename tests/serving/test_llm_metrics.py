"""The LLM models' Prometheus gauges, against a fake pb_utils: names and labels of the contract (row 28), values
from the engine's stats and the process's memory, and a refresh thread that keeps them current."""

from __future__ import annotations

import dataclasses
import sys
import time

import fake_pb_utils as fake  # registered by conftest.py
import pytest

from tritonllm.engine.seam import EngineStats
from tritonllm.triton.llm_metrics import FAMILIES, GAUGES, EngineMetrics, gauge_values
from tritonllm.triton.runtime_memory import runtime_memory


@pytest.fixture(autouse=True)
def pb_utils(monkeypatch):
    fake.MetricFamily.families = {}
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    return fake


def stats(**changes) -> EngineStats:
    values = dict(
        num_total_blocks=100,
        num_free_blocks=100,
        tokens_per_block=32,
        num_running=0,
        num_waiting=0,
        num_steps=0,
        max_seq_len=1024,
        max_batch_size=8,
        max_num_tokens=8192,
    )
    return EngineStats(**{**values, **changes})


MEMORY = {"cpu": 3000, "gpu": 0, "pinned": 0}


def gauge(family: str, kind: str) -> fake.Metric:
    label = FAMILIES[family][1]
    matches = [m for m in fake.MetricFamily.families[family].metrics if m.labels[label] == kind]
    assert len(matches) == 1, f"{family}{{{label}={kind}}} exported {len(matches)} times"
    return matches[0]


def test_every_family_and_label_value_of_the_contract_is_exported():
    contract = {
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
    assert {name: (label, set(kinds)) for name, (_, label, kinds) in FAMILIES.items()} == contract


def test_gauge_values_follow_the_engine_stats():
    values = gauge_values(stats(num_free_blocks=90, num_running=2, num_waiting=1, num_steps=7), 5.0, MEMORY)
    assert set(values) == set(GAUGES)
    assert values[("nv_trt_llm_kv_cache_block_metrics", "free")] == 90
    assert values[("nv_trt_llm_kv_cache_block_metrics", "used")] == 10
    assert values[("nv_trt_llm_kv_cache_block_metrics", "max")] == 100
    assert values[("nv_trt_llm_kv_cache_block_metrics", "tokens_per")] == 32
    assert values[("nv_trt_llm_kv_cache_block_metrics", "fraction")] == pytest.approx(0.1)
    assert values[("nv_trt_llm_request_metrics", "active")] == 3  # running + waiting
    assert values[("nv_trt_llm_request_metrics", "scheduled")] == 2
    assert values[("nv_trt_llm_request_metrics", "waiting")] == 1
    assert values[("nv_trt_llm_request_metrics", "max")] == 8
    assert values[("nv_trt_llm_general_metrics", "iteration_counter")] == 7
    assert values[("nv_trt_llm_general_metrics", "timestamp")] == 5_000_000  # microseconds (contract Q8)
    assert values[("nv_trt_llm_runtime_memory_metrics", "cpu")] == 3000


def test_iteration_details_the_engine_does_not_report_read_as_zero_and_running_requests_as_generation():
    values = gauge_values(stats(num_running=3), 0.0, MEMORY)
    assert values[("nv_trt_llm_request_metrics", "context")] == 0
    assert values[("nv_trt_llm_inflight_batcher_metrics", "generation_requests")] == 3
    assert values[("nv_trt_llm_inflight_batcher_metrics", "total_context_tokens")] == 0
    assert values[("nv_trt_llm_inflight_batcher_metrics", "paused_requests")] == 0
    assert values[("nv_trt_llm_inflight_batcher_metrics", "micro_batch_id")] == 0


def test_iteration_details_are_used_when_the_engine_reports_them():
    detailed = dataclasses.replace(
        stats(num_running=3), num_context_requests=1, num_context_tokens=120, num_paused_requests=2
    )
    values = gauge_values(detailed, 0.0, MEMORY)
    assert values[("nv_trt_llm_request_metrics", "context")] == 1
    assert values[("nv_trt_llm_inflight_batcher_metrics", "generation_requests")] == 2
    assert values[("nv_trt_llm_inflight_batcher_metrics", "total_context_tokens")] == 120
    assert values[("nv_trt_llm_inflight_batcher_metrics", "paused_requests")] == 2


def test_an_empty_cache_has_a_zero_fraction():
    assert (
        gauge_values(stats(num_total_blocks=0, num_free_blocks=0), 0.0, MEMORY)[
            ("nv_trt_llm_kv_cache_block_metrics", "fraction")
        ]
        == 0.0
    )


def test_runtime_memory_reports_this_process_without_starting_cuda():
    memory = runtime_memory()
    assert set(memory) == {"cpu", "gpu", "pinned"}
    assert memory["cpu"] > 10 * 2**20  # a Python process with torch imported holds more than 10 MiB
    assert all(isinstance(value, int) and value >= 0 for value in memory.values())


def test_gauges_carry_the_contract_names_and_labels():
    EngineMetrics(lambda: stats(), "tensorrt_llm", "1", period_ms=1000, read_memory=lambda: MEMORY).update()
    assert all(f.kind == fake.MetricFamily.GAUGE for f in fake.MetricFamily.families.values())
    for family, kind in GAUGES:
        assert gauge(family, kind).labels["model"] == "tensorrt_llm"
        assert gauge(family, kind).labels["version"] == "1"


def test_the_thread_keeps_the_gauges_current_and_survives_a_failing_read():
    current = {"stats": stats(num_free_blocks=60, num_running=1)}

    def read():
        if current["stats"] is None:
            raise RuntimeError("engine gone")
        return current["stats"]

    metrics = EngineMetrics(read, "tensorrt_llm", "1", period_ms=5, read_memory=lambda: MEMORY).start()
    try:
        assert gauge("nv_trt_llm_kv_cache_block_metrics", "free").value() == 60  # start() sets them at once
        current["stats"] = None
        time.sleep(0.05)
        current["stats"] = stats(num_free_blocks=100)
        deadline = time.monotonic() + 5
        while gauge("nv_trt_llm_kv_cache_block_metrics", "free").value() != 100 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gauge("nv_trt_llm_kv_cache_block_metrics", "free").value() == 100
        assert gauge("nv_trt_llm_request_metrics", "active").value() == 0
    finally:
        metrics.stop()
    assert not metrics.thread.is_alive()
    # Freed at stop, while the stub can still clear them (left to its teardown, it segfaults at every shutdown).
    assert metrics.gauges == {} and metrics.families == {}
