"""`bench engine --profile`: the engine's workload once more under torch.profiler, and what the profile says (the
top kernels or CPU ops, the GPU's busy share, and on CUDA or with a trace file the step phases)."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from tritonllm.commands.bench_phases import phases_from_trace_file, print_phases, union_length
from tritonllm.commands.bench_report import progress

TOP_KERNELS = 15


def profile_engine(run: Callable[[], float], device, trace_path: Optional[str]) -> dict[str, Any]:
    """`run` (the engine's workload once more, returning its seconds) under torch.profiler: top kernels (on CPU:
    top ops), on CUDA the share of the profiled wall time in which some kernel ran and the step phases
    (bench_phases.py). Whatever the profiler cannot give is reported, not raised."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    options, note = _all_threads_option()
    progress("profiling one more engine run")
    with warnings.catch_warnings():
        # Said by some torch versions on entry; this profiler runs one cycle, so there is nothing to accumulate.
        warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
        with profile(activities=activities, **options) as prof:
            seconds = run()
    result: dict[str, Any] = {"profile_s": round(seconds, 3)}
    if note:
        result["profile_note"] = note
    try:
        result.update(_profile_summary(prof, device, seconds))
    except Exception as err:  # profiler internals differ between torch versions
        result["profile_error"] = f"{type(err).__name__}: {err}"
        progress(f"profile summary unavailable: {result['profile_error']}")
    if device.type == "cuda" or trace_path:
        result.update(_trace_phases(prof, trace_path))
    return result


def _trace_phases(prof, trace_path: Optional[str]) -> dict[str, Any]:
    """The step phases (bench_phases.py) from the chrome trace, written to `trace_path` or to a temporary file."""
    from tritonllm.engine.embedded.engine_core import STEP_RANGE_PREFIX

    with tempfile.TemporaryDirectory() as scratch:
        path = trace_path or str(Path(scratch) / "trace.json")
        result: dict[str, Any] = {}
        _export_trace(prof, path, result)
        if "profile_trace_error" in result:
            return result
        if trace_path:
            progress(f"chrome trace written to {trace_path}")
        try:
            phases = phases_from_trace_file(path, STEP_RANGE_PREFIX)
        except (OSError, ValueError, KeyError) as err:
            return {"profile_phases_error": f"{type(err).__name__}: {err}"}
    print_phases(phases, progress)
    return {"profile_phases": phases}


def _all_threads_option() -> tuple[dict, Optional[str]]:
    """The engine steps on its own thread, which the profiler records only when told to profile all threads."""
    try:
        from torch.profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}, None
    except (ImportError, TypeError):
        return {}, "this torch cannot profile all threads: CPU ops of the engine thread are missing"


def _export_trace(prof, trace_path: str, result: dict) -> None:
    try:
        prof.export_chrome_trace(str(Path(trace_path)))
    except Exception as err:
        result["profile_trace_error"] = f"{type(err).__name__}: {err}"


def _profile_summary(prof, device, seconds: float) -> dict[str, Any]:
    if device.type != "cuda":
        top = _top_cpu_ops(prof)
        _print_top(top, "ops by self CPU time")
        return {"profile_top_kernels": top}
    kernels = device_kernels(prof.events())
    busy = busy_share([(k.time_range.start, k.time_range.end) for k in kernels], seconds * 1e6)
    top = top_kernels([(k.name, k.time_range.end - k.time_range.start) for k in kernels])
    _print_top(top, f"kernels by total GPU time (GPU busy {busy:.1%} of the profiled {seconds:.1f}s)")
    return {"gpu_busy_share": round(busy, 4), "profile_top_kernels": top}


def device_kernels(events) -> list:
    """The GPU kernels among the profiler's events (copies and memsets left out)."""
    from torch.autograd import DeviceType

    return [
        e
        for e in events
        if getattr(e, "device_type", None) == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    ]


def busy_share(intervals: list[tuple[float, float]], wall_us: float) -> float:
    """The union of [start, end) intervals over the wall time: concurrent kernels count once."""
    return union_length(intervals) / wall_us if wall_us > 0 else 0.0


def top_kernels(timed: list[tuple[str, float]], limit: int = TOP_KERNELS) -> list[dict[str, Any]]:
    """(name, duration in us) pairs summed by name, the largest totals first."""
    totals: dict[str, list[float]] = {}
    for name, duration in timed:
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += duration
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:limit]
    return [
        {"name": name, "calls": calls, "total_ms": round(total / 1e3, 3), "mean_us": round(total / calls, 2)}
        for name, (calls, total) in ranked
    ]


def _top_cpu_ops(prof) -> list[dict[str, Any]]:
    averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:TOP_KERNELS]
    return [
        {
            "name": a.key,
            "calls": a.count,
            "total_ms": round(a.self_cpu_time_total / 1e3, 3),
            "mean_us": round(a.self_cpu_time_total / max(a.count, 1), 2),
        }
        for a in averages
    ]


def _print_top(top: list[dict[str, Any]], title: str) -> None:
    progress(f"top {len(top)} {title}:")
    progress(f"{'total ms':>11} {'calls':>8} {'mean us':>10}  name")
    for row in top:
        progress(f"{row['total_ms']:>11.1f} {row['calls']:>8} {row['mean_us']:>10.1f}  {row['name'][:100]}")
