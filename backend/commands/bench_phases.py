"""Where a profiled run's device time went, step phase by step phase, from torch.profiler's chrome trace.

The engine marks each step's launches with a profiler range ("step prefill" / "step decode", engine_core.step_range).
A GPU event (kernel, copy, memset) belongs to the range whose thread launched it: the trace ties the event to its
launch (runtime or driver call: Triton kernels launch through the driver, CUDA graphs through cudaGraphLaunch) by a
correlation id. Per phase this gives the steps, the kernel time, and the steps' spans on the GPU (first event's
start to last one's end); what a span holds beyond its busy time is the GPU waiting inside a step, and the wall
time outside every span is the GPU waiting between steps (on the host: scheduling, sampling's copies, Python)."""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
OUTSIDE = "outside steps"  # GPU work launched outside every step range (warm-up leftovers, the profiler's own)
TOP_PER_PHASE = 8
GAP_US = 5.0  # idle stretches inside a step shorter than this are launch latency, not worth naming


@dataclass
class _Step:
    phase: str
    gpu: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, name) in us


def phases_from_trace_file(path: str | Path, range_prefix: str) -> dict[str, Any]:
    with open(path) as handle:
        return phases_from_trace(json.load(handle), range_prefix)


def phases_from_trace(trace: dict, range_prefix: str) -> dict[str, Any]:
    """The summary of a chrome trace (the dict torch.profiler's export_chrome_trace writes)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    ranges = _step_ranges(events, range_prefix)
    launches = {
        _correlation(e): (e.get("tid"), float(e["ts"]))
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and _correlation(e) is not None
    }
    steps = [_Step(phase) for _, _, _, phase in ranges]
    outside = _Step(OUTSIDE)
    by_thread = _index_by_thread(ranges)
    for event in events:
        if event.get("cat") not in GPU_CATEGORIES:
            continue
        start = float(event["ts"])
        interval = (start, start + float(event.get("dur", 0.0)), event.get("name", "?"))
        launch = launches.get(_correlation(event))
        index = _range_of(by_thread, *launch) if launch is not None else None
        (steps[index] if index is not None else outside).gpu.append(interval)
    return _summary([s for s in steps if s.gpu] + ([outside] if outside.gpu else []), ranges)


def _correlation(event: dict) -> Optional[int]:
    return (event.get("args") or {}).get("correlation")


def _step_ranges(events: list[dict], prefix: str) -> list[tuple[Any, float, float, str]]:
    """(thread, start, end, phase) of every step range, in start order."""
    found = [
        (e.get("tid"), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"][len(prefix) :])
        for e in events
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefix)
    ]
    return sorted(found, key=lambda r: r[1])


def _index_by_thread(ranges) -> dict[Any, tuple[list[float], list[tuple[float, int]]]]:
    """Per thread: the ranges' starts (sorted) and (end, index into `ranges`) alongside."""
    table: dict[Any, tuple[list[float], list[tuple[float, int]]]] = {}
    for index, (thread, start, end, _) in enumerate(ranges):
        starts, rest = table.setdefault(thread, ([], []))
        starts.append(start)
        rest.append((end, index))
    return table


def _range_of(by_thread, thread, ts: float) -> Optional[int]:
    """The index of the step range of `thread` around time `ts` (ranges of one thread do not overlap)."""
    if thread not in by_thread:
        return None
    starts, rest = by_thread[thread]
    at = bisect.bisect_right(starts, ts) - 1
    if at < 0:
        return None
    end, index = rest[at]
    return index if ts <= end else None


def _summary(steps: list[_Step], ranges) -> dict[str, Any]:
    every = [interval for step in steps for interval in step.gpu]
    if not every:
        return {"phases": {}, "note": "the trace holds no GPU events"}
    first = min([r[1] for r in ranges] + [i[0] for i in every])
    wall = max(i[1] for i in every) - first
    busy = union_length((s, e) for s, e, _ in every)
    phases: dict[str, dict[str, Any]] = {}
    for step in steps:
        entry = phases.setdefault(
            step.phase, {"steps": 0, "kernel_ms": 0.0, "busy_ms": 0.0, "span_ms": 0.0, "_k": {}, "_gaps": {}}
        )
        entry["steps"] += 1
        entry["kernel_ms"] += sum(e - s for s, e, _ in step.gpu) / 1e3
        entry["busy_ms"] += union_length((s, e) for s, e, _ in step.gpu) / 1e3
        entry["span_ms"] += (max(e for _, e, _ in step.gpu) - min(s for s, _, _ in step.gpu)) / 1e3
        for s, e, name in step.gpu:
            calls_total = entry["_k"].setdefault(name, [0, 0.0])
            calls_total[0] += 1
            calls_total[1] += e - s
        for between, idle in _gaps(step.gpu):
            calls_total = entry["_gaps"].setdefault(between, [0, 0.0])
            calls_total[0] += 1
            calls_total[1] += idle
    spans = sum(p["span_ms"] for p in phases.values())
    for entry in phases.values():
        entry["waiting_in_steps_ms"] = entry["span_ms"] - entry["busy_ms"]
        entry["mean_span_us"] = 1e3 * entry["span_ms"] / entry["steps"]
        entry["top"] = _top(entry.pop("_k"))
        entry["top_gaps"] = _top(entry.pop("_gaps"))  # the GPU idle inside steps, by the events around it
        for key in ("kernel_ms", "busy_ms", "span_ms", "waiting_in_steps_ms", "mean_span_us"):
            entry[key] = round(entry[key], 3)
    return {
        "wall_ms": round(wall / 1e3, 3),
        "gpu_busy_ms": round(busy / 1e3, 3),
        "waiting_between_steps_ms": round(wall / 1e3 - spans, 3),
        "phases": phases,
    }


def _gaps(events: list[tuple[float, float, str]]) -> list[tuple[str, float]]:
    """("after X, before Y", idle us) for each idle stretch of at least GAP_US between a step's GPU events."""
    found, reach, last = [], None, ""
    for start, end, name in sorted(events):
        if reach is not None and start - reach >= GAP_US:
            found.append((f"after {last[:55]} | before {name[:55]}", start - reach))
        if reach is None or end > reach:
            reach, last = end, name
    return found


def _top(kernels: dict[str, list]) -> list[dict[str, Any]]:
    ranked = sorted(kernels.items(), key=lambda item: -item[1][1])[:TOP_PER_PHASE]
    return [
        {"name": name[:120], "calls": calls, "total_ms": round(total / 1e3, 3), "mean_us": round(total / calls, 2)}
        for name, (calls, total) in ranked
    ]


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals: concurrent events count once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def print_phases(summary: dict[str, Any], say) -> None:
    """The summary as a few readable lines through `say` (bench_report.progress)."""
    if not summary.get("phases"):
        say(f"step phases: {summary.get('note', 'none found')}")
        return
    say(
        f"step phases: wall {summary['wall_ms']:.1f} ms, GPU busy {summary['gpu_busy_ms']:.1f} ms, "
        f"GPU waiting between steps {summary['waiting_between_steps_ms']:.1f} ms"
    )
    for phase, entry in summary["phases"].items():
        say(
            f"  {phase}: {entry['steps']} steps, kernels {entry['kernel_ms']:.1f} ms, spans {entry['span_ms']:.1f} ms "
            f"({entry['mean_span_us']:.0f} us a step, {entry['waiting_in_steps_ms']:.1f} ms of it waiting)"
        )
        for row in entry["top"]:
            say(f"    {row['total_ms']:>9.1f} ms {row['calls']:>7} x {row['mean_us']:>8.1f} us  {row['name'][:90]}")
        for row in entry["top_gaps"][:4]:
            say(
                f"    idle {row['total_ms']:>6.1f} ms {row['calls']:>7} x {row['mean_us']:>8.1f} us  "
                f"{row['name'][:100]}"
            )
