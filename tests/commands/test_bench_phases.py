"""bench_phases.py: a profiled run's GPU events split by the engine's step ranges, on hand-built chrome traces."""

import json

import pytest

from tritonllm.commands.bench_phases import OUTSIDE, phases_from_trace, phases_from_trace_file, union_length

PREFIX = "step "


def _range(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": PREFIX + name, "ts": ts, "dur": dur, "tid": tid}


def _launch(corr, ts, tid=1, cat="cuda_runtime"):
    return {
        "ph": "X",
        "cat": cat,
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 1,
        "tid": tid,
        "args": {"correlation": corr},
    }


def _kernel(corr, name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}


def _trace():
    """A prefill step (host 0-10 us) whose kernels run 5-25 with a 5 us hole; two decode steps (host 30-32 and
    60-62) whose kernels run 40-50 and 70-76; one kernel launched outside every range; another thread's range
    at the same time as the prefill, which must not claim the prefill's launches."""
    return {
        "traceEvents": [
            _range("prefill", 0, 10),
            _range("decode", 0, 100, tid=2),  # another thread: launches of thread 1 are not its
            _launch(1, 2),
            _launch(2, 3, cat="cuda_driver"),  # Triton launches through the driver
            _kernel(1, "gemm", 5, 10),
            _kernel(2, "attn", 20, 5),
            _range("decode", 30, 2),
            _launch(3, 31),
            _kernel(3, "graph_gemm", 40, 6),
            _kernel(3, "graph_norm", 46, 4),  # a graph's kernels share its launch's correlation
            _range("decode", 60, 2),
            _launch(4, 61),
            _kernel(4, "graph_gemm", 70, 6),
            _launch(5, 90),
            _kernel(5, "memcpy", 95, 5, cat="gpu_memcpy"),
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1},  # not a complete event: ignored
        ]
    }


def test_events_split_by_the_range_that_launched_them():
    summary = phases_from_trace(_trace(), PREFIX)
    prefill, decode, outside = (summary["phases"][p] for p in ("prefill", "decode", OUTSIDE))
    assert (prefill["steps"], prefill["kernel_ms"], prefill["span_ms"]) == (1, 0.015, 0.02)
    assert prefill["waiting_in_steps_ms"] == pytest.approx(0.005)
    assert (decode["steps"], decode["kernel_ms"], decode["span_ms"], decode["mean_span_us"]) == (2, 0.016, 0.016, 8.0)
    assert decode["waiting_in_steps_ms"] == 0.0 and decode["top_gaps"] == []
    assert prefill["top_gaps"] == [{"name": "after gemm | before attn", "calls": 1, "total_ms": 0.005, "mean_us": 5.0}]
    assert [row["name"] for row in decode["top"]] == ["graph_gemm", "graph_norm"]
    assert decode["top"][0] == {"name": "graph_gemm", "calls": 2, "total_ms": 0.012, "mean_us": 6.0}
    assert outside["steps"] == 1 and outside["kernel_ms"] == 0.005
    # Wall 0-100 us; busy 15 + 10 + 6 + 5 = 36; spans 20 + 16 + 5 = 41, so 59 us between them.
    assert (summary["wall_ms"], summary["gpu_busy_ms"], summary["waiting_between_steps_ms"]) == (0.1, 0.036, 0.059)


def test_a_trace_without_gpu_events_says_so(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_range("decode", 0, 5), _launch(1, 2)]}))
    assert phases_from_trace_file(path, PREFIX) == {"phases": {}, "note": "the trace holds no GPU events"}


def test_union_length_counts_overlaps_once():
    assert union_length([(0, 3), (1, 4), (2, 2.5), (6, 8)]) == 6.0
    assert union_length([]) == 0.0
