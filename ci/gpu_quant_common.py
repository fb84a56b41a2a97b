"""What the quantized-kernel GPU scripts share (gpu_quant_kernels.py, gpu_int4_sweeps.py, gpu_fp8_sweeps.py):
Llama-3.1-8B's projection shapes, random weights of each format with the dense bf16 weight they stand for, enough
copies of a weight to overflow the L2, the calls, and CUDA-graph timing. JSON lines on stdout."""

from __future__ import annotations

import json
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from gpu_timing import timed_ms

from tritonllm.engine.embedded.quant import formats, kernels
from tritonllm.engine.embedded.quant import weight_only_kernel as wo
from tritonllm.engine.embedded.quant.weight_only_kernel import Variant

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
MS = (1, 8, 64, 256, 2048)
GROUP_SIZE = 128
ROTATE_BYTES = 256 << 20  # the copies of a weight that one timing cycles through: 5x the L2
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


# ---- weights ----


def quantized(fmt: str, n: int, k: int, generator: torch.Generator) -> dict:
    """Random weights of one format on the GPU, with the dense bf16 weight they stand for."""
    dev = DEVICE
    if fmt == "int4":
        q = torch.randint(0, 256, (n, k // 2), device=dev, dtype=torch.uint8, generator=generator)
        scale = (torch.rand(n, k // GROUP_SIZE, device=dev, generator=generator) * 0.004 + 0.001).to(DTYPE)
        zero = torch.randint(0, 16, (n, k // GROUP_SIZE), device=dev, dtype=torch.uint8, generator=generator)
        args = group_major(dict(qweight=q, weight_scale=scale, weight_zero=zero, group_size=GROUP_SIZE))
        dense = formats.dequantize_int4(q, scale, zero, GROUP_SIZE)  # (scales and zeros as QuantLinear stores them)
    elif fmt == "int8":  # per channel, as TensorRT-LLM's W8A16
        w = torch.randint(-128, 128, (n, k), device=dev, dtype=torch.int8, generator=generator)
        scale = (torch.rand(n, 1, device=dev, generator=generator) * 2e-4 + 5e-5).to(DTYPE)
        args = dict(weight=w, weight_scale=scale, group_size=k)
        dense = formats.dequantize_int8(w, scale, k)
    else:
        w = (torch.randn(n, k, device=dev, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        scale = torch.rand(n, device=dev, generator=generator) * 2e-4 + 5e-5
        args = dict(weight=w, weight_scale=scale)
        dense = formats.dequantize_fp8(w, scale, DTYPE)
    return dict(args=args, dense=dense)


def nbytes(args: dict) -> int:
    return sum(t.numel() * t.element_size() for t in args.values() if isinstance(t, torch.Tensor))


def copies(args: dict) -> list[dict]:
    """The weight and enough clones of it to overflow the L2."""
    count = max(1, -(-ROTATE_BYTES // nbytes(args)))
    clones = [
        {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in args.items()}
        for _ in range(count - 1)
    ]
    return [args] + clones


# ---- the calls ----


def call_default(fmt: str, x: torch.Tensor, args: dict) -> torch.Tensor:
    if fmt == "int4":
        return kernels.int4_linear(x, bias=None, **args)
    if fmt == "int8":
        return kernels.int8_linear(x, bias=None, **args)
    return kernels.fp8_linear(x, bias=None, **args)


def weight_only(args: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, int]:
    if "qweight" in args:
        return args["qweight"], args["weight_scale"], args["weight_zero"], args["group_size"], 4
    return args["weight"], args["weight_scale"], None, args["group_size"], 8


def call_variant(variant: Variant | str, x: torch.Tensor, args: dict) -> torch.Tensor:
    w, scale, zero, group_size, bits = weight_only(args)
    if variant == "dequantize":
        return F.linear(x, wo.dequantize(w, scale, zero, group_size, bits, x.dtype))
    assert isinstance(variant, Variant)
    return wo.weight_only_matmul(x, w, scale, zero, None, group_size, bits, variant)


# ---- timing ----


def timed_us(calls: list[Callable[[], object]], min_calls: int = 48, repeats: int = 7) -> tuple[float, str]:
    """Median microseconds a call, from CUDA-graph replays of the calls in turn (eager where capture fails)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    rounds = max(1, -(-min_calls // len(calls)))

    def run_all():
        for _ in range(rounds):
            for call in calls:
                call()

    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_all()
        replay = graph.replay
    except RuntimeError:
        mode, replay = "eager", run_all
    return timed_ms(replay, repeats) * 1000 / (rounds * len(calls)), mode


def errors(got: torch.Tensor, expected: torch.Tensor) -> dict:
    diff = (got.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30)
    return {"rel_err": float(diff), "max_abs_diff": float((got.float() - expected.float()).abs().max())}


def bf16_us(dense: torch.Tensor, x: torch.Tensor) -> float:
    weights = copies({"w": dense})
    return timed_us([lambda w=w["w"]: F.linear(x, w) for w in weights], min_calls=16 if x.shape[0] >= 256 else 48)[0]


def emit_totals(
    kind: str, totals: dict[int, dict[str, float]], baselines: tuple[str, ...], keep: int, extra: dict | None = None
) -> None:
    """Per M, one `kind` row: the baselines' totals over the shapes, `extra[m]`, and the `keep` fastest variants'."""
    for m, per in totals.items():
        complete = {v: t for v, t in per.items() if v not in baselines}
        top = sorted(complete, key=complete.__getitem__)[:keep]
        row = {f"{name}_total_us": round(per[name], 2) for name in baselines} | (extra or {}).get(m, {})
        emit(kind=kind, m=m, **row, top=[(v, round(complete[v], 2)) for v in top])


def shape_rows(fmt: str, ms: tuple[int, ...]) -> Iterator[tuple[str, dict, list[dict], int, torch.Tensor]]:
    """(shape name, its `fmt` weight, the copies a timing cycles through, m, random x [m, K]) for every shape and
    row count; a shape's weights are freed once its rows are done."""
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight = quantized(fmt, n, k, generator)
        rotation = copies(weight["args"])
        for m in ms:
            yield name, weight, rotation, m, torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=generator)
        del weight, rotation
        torch.cuda.empty_cache()


def group_major(args: dict) -> dict:
    """The same weight with scales and zeros stored [groups, N] (still viewed as [N, groups]), as QuantLinear
    stores them."""
    moved = {key: args[key].t().contiguous().t() for key in ("weight_scale", "weight_zero")}
    return {**args, **moved}


def row_major(args: dict) -> dict:
    """The same weight with scales and zeros stored [N, groups]."""
    return {**args, **{key: args[key].contiguous() for key in ("weight_scale", "weight_zero")}}
