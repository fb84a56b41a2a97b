"""The FP8 kernels on one GPU (gpu_quant_kernels.py's --fp8-rows and --sweep-fp8): the fused norm and SiLU
writing FP8 rows against the plain kernels plus the activation quantizer, and _scaled_mm against the Triton FP8
matmul's tiles. JSON lines on stdout."""

from __future__ import annotations

from typing import Callable

import torch
import triton
from gpu_quant_common import DEVICE, DTYPE, bf16_us, emit, errors, shape_rows, timed_us

from tritonllm.engine.embedded.quant import fp8_kernel
from tritonllm.engine.embedded.quant.fp8_matmul_kernel import Fp8Tiles, fp8_matmul


def time_fp8_rows(ms: tuple[int, ...]) -> None:
    """The fused norm and SiLU writing their outputs' FP8 rows against the plain kernel plus the activation
    quantizer (what each FP8 projection launched before), at Llama-3.1-8B's widths; SiLU's per-row program at
    a few warp counts."""
    from tritonllm.engine.embedded.network import fused_ops

    generator = torch.Generator(device=DEVICE).manual_seed(0)
    hidden, inter = 4096, 14336
    weight = torch.ones(hidden, device=DEVICE, dtype=DTYPE)
    for m in ms:
        x = torch.randn(m, hidden, device=DEVICE, dtype=DTYPE, generator=generator)
        res = torch.randn(m, hidden, device=DEVICE, dtype=DTYPE, generator=generator)
        gate_up = torch.randn(m, 2 * inter, device=DEVICE, dtype=DTYPE, generator=generator)
        row = {"kind": "fp8-rows", "m": m}
        row["norm_then_quant_us"] = timed_us(
            [lambda: fp8_kernel.quantize_rows(fused_ops.rms_norm(x, weight, 1e-6, res)[0])]
        )[0]
        row["norm_with_rows_us"] = timed_us([lambda: fused_ops.rms_norm(x, weight, 1e-6, res, fp8_rows=True)])[0]
        row["silu_then_quant_us"] = timed_us([lambda: fp8_kernel.quantize_rows(fused_ops.silu_and_mul(gate_up))])[0]
        row["silu_alone_us"] = timed_us([lambda: fused_ops.silu_and_mul(gate_up)])[0]
        row["silu_with_rows_two_launches_us"] = timed_us([lambda: fused_ops.silu_and_mul(gate_up, fp8_rows=True)])[0]
        fused_ops.SILU_FP8_SPLIT = False
        row["silu_with_rows_one_launch_us"] = timed_us([lambda: fused_ops.silu_and_mul(gate_up, fp8_rows=True)])[0]
        fused_ops.SILU_FP8_SPLIT = True
        split, one = (
            fused_ops.silu_and_mul(gate_up, fp8_rows=True).fp8_rows,
            fp8_kernel.quantize_rows(fused_ops.silu_and_mul(gate_up)),
        )
        row["silu_rows_equal"] = torch.equal(split[0].view(torch.uint8), one[0].view(torch.uint8)) and torch.equal(
            split[1], one[1]
        )
        row["quant_4096_one_block_us"] = timed_us([lambda: fp8_kernel.quantize_rows(x)])[0]
        row["quant_4096_two_passes_us"] = timed_us([lambda: quantize_two_passes(x)])[0]
        emit(**{key: round(value, 2) if isinstance(value, float) else value for key, value in row.items()})


def quantize_two_passes(x: torch.Tensor) -> None:
    """quantize_rows' kernel with ONE_BLOCK off (what it ran before for K <= 4096), for the comparison."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    block = min(fp8_kernel.MAX_BLOCK, triton.next_power_of_2(x.shape[1]))
    fp8_kernel._quantize_rows_kernel[(x.shape[0],)](
        x, out, scales, scales, x.shape[1], x.stride(0), STATIC=False, BLOCK=block, ONE_BLOCK=False, num_warps=4
    )


FP8_TILES = [
    Fp8Tiles(64, 64, 128, num_warps=4, num_stages=4),
    Fp8Tiles(64, 128, 128, num_warps=4, num_stages=4),
    Fp8Tiles(64, 256, 128, num_warps=8, num_stages=3),
    Fp8Tiles(128, 64, 128, num_warps=4, num_stages=4),
    Fp8Tiles(128, 128, 128, num_warps=8, num_stages=3),
    Fp8Tiles(128, 128, 128, num_warps=4, num_stages=4),
    Fp8Tiles(128, 256, 128, num_warps=8, num_stages=3),
    Fp8Tiles(128, 256, 64, num_warps=8, num_stages=4),
    Fp8Tiles(256, 128, 128, num_warps=8, num_stages=3),
]


def sweep_fp8(ms: tuple[int, ...]) -> None:
    """At each M: bf16 F.linear; the activation quantizer; _scaled_mm row-wise and per tensor (GEMM alone, the
    cuBLASLt path a per-tensor recipe would take); the Triton FP8 matmul's tiles. Per shape, then totals."""
    totals: dict[int, dict[str, float]] = {m: {} for m in ms}
    for name, weight, rotation, m, x in shape_rows("fp8", ms):
        x_q, x_scale = fp8_kernel.quantize_rows(x)
        one = torch.ones((), device=DEVICE)
        calls: dict[str, Callable] = {
            "bf16": None,
            "quantize": lambda a: fp8_kernel.quantize_rows(x),
            "rowwise": lambda a: torch._scaled_mm(
                x_q, a["weight"].t(), scale_a=x_scale, scale_b=a["weight_scale"].reshape(1, -1), out_dtype=DTYPE
            ),
            "tensorwise": lambda a: torch._scaled_mm(x_q, a["weight"].t(), scale_a=one, scale_b=one, out_dtype=DTYPE),
            "tensorwise_f32": lambda a: torch._scaled_mm(
                x_q, a["weight"].t(), scale_a=one, scale_b=one, out_dtype=torch.float32
            ),
            "rowwise_fast": lambda a: torch._scaled_mm(
                x_q,
                a["weight"].t(),
                scale_a=x_scale,
                scale_b=a["weight_scale"].reshape(1, -1),
                out_dtype=DTYPE,
                use_fast_accum=True,
            ),
            "tensorwise_f32_fast": lambda a: torch._scaled_mm(
                x_q, a["weight"].t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True
            ),
        }
        for tiles in FP8_TILES:
            calls[str(tiles)] = lambda a, t=tiles: fp8_matmul(
                x_q, x_scale, a["weight"], a["weight_scale"], None, DTYPE, t
            )
        expected = (x_q.float() * x_scale) @ weight["dense"].float().T
        row = {}
        for key, call in calls.items():
            try:
                if key == "bf16":
                    us = bf16_us(weight["dense"], x)
                else:
                    if not key.startswith(("quantize", "tensorwise")):
                        err = errors(call(weight["args"]), expected)["rel_err"]
                        if err > 2e-2:
                            emit(kind="fp8-wrong", shape=name, m=m, key=key, rel_err=err)
                            continue
                        if key.startswith("rowwise"):  # what fast accumulation costs in accuracy
                            emit(kind="fp8-error", shape=name, m=m, key=key, rel_err=err)
                    us = timed_us([lambda a=a: call(a) for a in rotation], min_calls=16, repeats=5)[0]
            except Exception as error:
                emit(kind="fp8-error", shape=name, m=m, key=key, error=repr(error)[:300])
                continue
            row[key] = round(us, 2)
            totals[m][key] = totals[m].get(key, 0.0) + us
        emit(kind="fp8", shape=name, m=m, us=row)
    for m, per in totals.items():
        emit(
            kind="fp8-overall", m=m, total_us={key: round(us, 2) for key, us in sorted(per.items(), key=lambda i: i[1])}
        )
