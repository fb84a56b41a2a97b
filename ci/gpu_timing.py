"""Timing for the GPU check scripts (ci/gpu_*.py): CUDA-event medians, and CUDA-graph replays."""

from __future__ import annotations

import statistics

import torch


def timed_ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn):
    """fn captured once in a CUDA graph, as the engine runs a decode step: the replay, without host launch costs
    (the fused path has no host sync, so it captures; the loop syncs to learn its experts, so it cannot)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
