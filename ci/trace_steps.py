"""Where a decode step's time goes, from a `bench engine --profile-trace` Chrome trace: the GPU kernels in launch
order, cut into steps at a kernel that runs once a step (--step-kernel, by default the greedy sampler's second
launch), then for each kernel of a decode step its launches a step, mean duration and mean gap to the end of the kernel
before (negative: overlapping it, as PDL launches do). Used by hand on traces from the GPU machine (docs/gpu-runs.md).

    python3 ci/trace_steps.py trace.json.gz [--step-kernel _fold_kernel] [--top 40]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict


def kernels(path: str) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel, by start."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    found = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") == "kernel"]
    return sorted(found, key=lambda k: k[1])


def steps(found: list[tuple[str, float, float]], marker: str) -> list[list[tuple[str, float, float]]]:
    """The kernels cut after each one whose name holds `marker`; only steps of the most common length (decode)."""
    cut, current = [], []
    for kernel in found:
        current.append(kernel)
        if marker in kernel[0]:
            cut.append(current)
            current = []
    lengths = Counter(len(step) for step in cut)
    if not lengths:
        raise SystemExit(f"no kernel's name holds {marker!r}")
    usual = lengths.most_common(1)[0][0]
    return [step for step in cut if len(step) == usual]


def short(name: str) -> str:
    return name if len(name) <= 60 else name[:57] + "..."


def report(decode: list[list[tuple[str, float, float]]], top: int) -> None:
    spans = [step[-1][1] + step[-1][2] - step[0][1] for step in decode[1:]]  # first step: no kernel before it
    print(f"{len(decode)} decode steps of {len(decode[0])} kernels, a step {sum(spans) / max(len(spans), 1):.1f} us")
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for step in decode:
        for index, (name, start, duration) in enumerate(step):
            before = step[index - 1] if index else None
            gap = start - (before[1] + before[2]) if before else 0.0
            entry = by_name[short(name)]
            entry[0] += 1
            entry[1] += duration
            entry[2] += gap
    count = len(decode)
    print(f"{'kernel':62} {'a step':>6} {'us each':>8} {'gap each':>8} {'us a step':>9}")
    ranked = sorted(by_name.items(), key=lambda item: -(item[1][1] + max(item[1][2], 0.0)))
    for name, (calls, total, gaps) in ranked[:top]:
        print(f"{name:62} {calls / count:6.1f} {total / calls:8.2f} {gaps / calls:8.2f} {(total + gaps) / count:9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Chrome trace (.json or .json.gz) from bench engine --profile-trace")
    parser.add_argument("--step-kernel", default="_fold_kernel", help="a name part of the kernel that ends each step")
    parser.add_argument("--top", type=int, default=40, help="how many kernels to list")
    args = parser.parse_args()
    report(steps(kernels(args.trace), args.step_kernel), args.top)


if __name__ == "__main__":
    main()
