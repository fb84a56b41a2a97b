"""The fused MoE kernel against the per-expert loop on one GPU: Mixtral-8x7B's layer (hidden 4096, experts of
14336, 8 experts, top 2) in bf16, at several token counts; times (CUDA events, the median of repeats) and the largest
difference. Run by `bash ci/gpu_session.sh moe-kernel`; CI never runs it (no GPU there)."""

from __future__ import annotations

import json
import statistics
import sys

import torch

from tritonllm.engine.embedded.network.fused_moe import fused_experts
from tritonllm.engine.embedded.network.moe import experts_portable, route

HIDDEN, INTER, EXPERTS, TOP_K = 4096, 14336, 8, 2


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


def main() -> int:
    torch.manual_seed(0)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    w_gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=dtype) * HIDDEN**-0.5
    w_down = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=dtype) * INTER**-0.5
    for tokens in (1, 8, 64, 256, 1024):
        x = torch.randn(tokens, HIDDEN, device=dev, dtype=dtype)
        weights, ids = route(torch.randn(tokens, EXPERTS, device=dev), TOP_K, renormalize=True)
        fused = fused_experts(x, w_gate_up, w_down, weights, ids)
        loop = experts_portable(x, w_gate_up, w_down, weights, ids)
        fused_ms = timed_ms(lambda: fused_experts(x, w_gate_up, w_down, weights, ids))
        loop_ms = timed_ms(lambda: experts_portable(x, w_gate_up, w_down, weights, ids))
        row = {
            "tokens": tokens,
            "fused_ms": round(fused_ms, 3),
            "loop_ms": round(loop_ms, 3),
            "speedup": round(loop_ms / fused_ms, 2),
            "max_abs_diff": float((fused.float() - loop.float()).abs().max()),
            "max_abs_loop": float(loop.float().abs().max()),
        }
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
