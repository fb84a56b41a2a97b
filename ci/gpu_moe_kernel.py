"""The fused MoE kernel against the per-expert loop on one GPU: Mixtral-8x7B's layer (hidden 4096, experts of
14336, 8 experts, top 2) in bf16, at several token counts; times (CUDA events, the median of repeats) and the largest
difference. With --sweep it first times each kernel over candidate launch shapes at each token count and prints the
fastest (the rows of fused_moe.TILE_TABLE), then compares the loop with the table's tiles and with the sweep's best.
Run by `bash ci/gpu_session.sh moe-kernel` (or `moe-sweep`); CI never runs it (no GPU there)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time

import torch
from gpu_timing import graphed, timed_ms

from tritonllm.engine.embedded.network import fused_moe
from tritonllm.engine.embedded.network.moe import experts_portable, route

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2
TOKEN_COUNTS = (1, 8, 64, 256, 1024)


def block_ms(pairs: int) -> tuple[int, ...]:
    return (16,) if pairs <= 32 else (16, 32, 64) if pairs <= 512 else (64, 128)


def launches(pairs: int, kernel: str) -> list[fused_moe.Launch]:
    """The launch shapes to try for one kernel at one pair count (about a hundred compiles in all)."""
    if pairs <= 32:  # few rows: streaming the weights is all; narrow blocks, long K steps, the down K split
        if kernel == "gate_up":
            grid = itertools.product((32, 64, 128), (64, 128, 256), (1,), (4,), (3, 4))
        else:
            grid = itertools.product((32, 64, 128), (64, 128), (1, 2, 4, 8), (4,), (3,))
    elif pairs <= 512:
        grid = itertools.product(
            (64, 128), (64,), (1, 2) if kernel == "down" else (1,), (4, 8), (3, 4) if kernel == "gate_up" else (3,)
        )
    else:
        grid = itertools.product((64, 128), (64,), (1,), (4, 8), (3,))
    return [fused_moe.Launch(*shape) for shape in grid]


def sweep(x, w_gate_up, w_down, weights, ids) -> fused_moe.MoeTiles:
    """The fastest tiles at this token count: each kernel timed alone over its launch shapes, per block_m."""
    pairs = ids.numel()
    choices = []
    for block_m in block_ms(pairs):
        routing = fused_moe.align_by_expert(ids, EXPERTS, block_m)
        activated = fused_moe.gate_up_rows(x, w_gate_up, routing, TOP_K, fused_moe.MoeTiles(block_m))
        runs = {
            "gate_up": lambda t: fused_moe.gate_up_rows(x, w_gate_up, routing, TOP_K, t),
            "down": lambda t: fused_moe.down_pairs(activated, w_down, routing, weights, pairs, t),
        }
        best = {}
        for kernel, run in runs.items():
            timings = []
            for launch in launches(pairs, kernel):
                tiles = fused_moe.MoeTiles(block_m, **{kernel: launch})
                try:
                    timings.append((timed_ms(lambda: run(tiles), repeats=10), launch))
                except Exception as exc:  # a shape past the GPU's shared memory: skip it
                    print(json.dumps({"pairs": pairs, "kernel": kernel, "skip": launch.__dict__, "why": str(exc)[:80]}))
            best[kernel] = min(timings, key=lambda t: t[0])
        total = best["gate_up"][0] + best["down"][0]
        choices.append((total, block_m, best["gate_up"][1], best["down"][1]))
        print(
            json.dumps(
                {
                    "pairs": pairs,
                    "block_m": block_m,
                    "ms": round(total, 3),
                    "gate_up": best["gate_up"][1].__dict__,
                    "down": best["down"][1].__dict__,
                }
            ),
            flush=True,
        )
    _, block_m, gate_up, down = min(choices, key=lambda c: c[0])
    return fused_moe.MoeTiles(block_m, gate_up, down)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w_gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=dtype) * HIDDEN**-0.5
    w_down = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=dtype) * INTER**-0.5
    for tokens in TOKEN_COUNTS:
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=dtype)
        weights, ids = route(torch.randn(tokens, EXPERTS, device=dev), TOP_K, renormalize=True)
        started = time.time()
        variants = {"table": fused_moe.tiles_for(tokens * TOP_K, dev)}
        if args.sweep:
            variants["sweep"] = sweep(x, w_gate_up, w_down, weights, ids)
        loop = experts_portable(x, w_gate_up, w_down, weights, ids)
        loop_ms = timed_ms(lambda: experts_portable(x, w_gate_up, w_down, weights, ids))
        for name, tiles in variants.items():
            fused = fused_moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles)
            fused_ms = timed_ms(lambda: fused_moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles))
            graph_ms = timed_ms(graphed(lambda: fused_moe.fused_experts(x, w_gate_up, w_down, weights, ids, tiles)))
            row = {
                "tokens": tokens,
                "tiles": name,
                "shape": dataclasses.asdict(tiles),
                "fused_ms": round(fused_ms, 3),
                "loop_ms": round(loop_ms, 3),
                "speedup": round(loop_ms / fused_ms, 2),
                "fused_graph_ms": round(graph_ms, 3),
                "speedup_graph": round(loop_ms / graph_ms, 2),
                "max_abs_diff": float((fused.float() - loop.float()).abs().max()),
                "max_abs_loop": float(loop.float().abs().max()),
                "seconds": round(time.time() - started, 1),
            }
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
