"""One line a variant from a GPU call's bench.jsonl (ci/gpu_session.sh's `bench` lines): its runs' engine tok/s,
their mean, and that mean over the mean of the plain bf16 variant of the same request shape, so that a call's ratios
read at a glance (docs/gpu-runs.md records them).

    python3 ci/bench_summary.py OUT/bench.jsonl [--base "llama-3.1-8b bf16 1x128/128"]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict


def runs_by_label(path: str) -> dict[str, list[float]]:
    """Each label's engine tok/s in file order (lines without a result skipped)."""
    runs: dict[str, list[float]] = defaultdict(list)
    with open(path) as lines:
        for line in lines:
            if not line.strip():
                continue
            entry = json.loads(line)
            result = entry.get("result") or {}
            if "engine_tok_s" in result:
                runs[entry["label"]].append(float(result["engine_tok_s"]))
    return runs


def shape_of(label: str) -> str:
    """The request shape a label ends with (e.g. 1x128/128), "" if none."""
    match = re.search(r"(\d+x\d+/\d+)$", label)
    return match.group(1) if match else ""


def summary(runs: dict[str, list[float]], base: str | None) -> list[str]:
    """The table's lines: label, runs, mean and the ratio to the bf16 variant of the same shape (or `base`)."""
    means = {label: sum(values) / len(values) for label, values in runs.items()}
    bases = {shape_of(label): mean for label, mean in means.items() if re.search(r" bf16 \d+x\d+/\d+$", label)}
    if base is not None:
        bases = {shape_of(base): means[base]} if base in means else {}
    lines = []
    for label, values in runs.items():
        reference = bases.get(shape_of(label))
        ratio = f"{means[label] / reference:.3f}" if reference else "-"
        shown = " / ".join(f"{value:.2f}" for value in values)
        lines.append(f"{label:<60} {shown:<28} mean {means[label]:8.2f}  x bf16 {ratio}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_jsonl", help="a GPU call's bench.jsonl")
    parser.add_argument("--base", help="the label the ratios are taken against (default: bf16 of the same shape)")
    args = parser.parse_args()
    print("\n".join(summary(runs_by_label(args.bench_jsonl), args.base)))


if __name__ == "__main__":
    main()
