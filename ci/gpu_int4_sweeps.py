"""The int4 kernels' sweeps on one GPU (gpu_quant_kernels.py's --sweep-decode, --int4-prefill, --int4-gemm,
--scale-layouts, --race-check, --ncu-once): the decode kernel's program shapes per projection and row count, its
tiles at prefill sizes, int4_gemm's tiles, the scales' layouts, split-K's repeatability. JSON lines on stdout."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from typing import Callable

import torch
import torch.nn.functional as F
import triton
from gpu_quant_common import (
    DEVICE,
    DTYPE,
    GROUP_SIZE,
    SHAPES,
    bf16_us,
    call_variant,
    copies,
    emit,
    emit_totals,
    errors,
    quantized,
    row_major,
    shape_rows,
    timed_us,
)

from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode
from tritonllm.engine.embedded.quant import int4_gemm, kernels
from tritonllm.engine.embedded.quant.int4_decode_kernel import DecodeVariant
from tritonllm.engine.embedded.quant.int4_gemm import GemmTiles


def decode_variants(m: int, family: str = "default") -> list[DecodeVariant]:
    """The variants one --sweep-decode times at m rows: `family` is "default" (byte_variants), "words", "lanes",
    "mma" or "lanes+mma" (both GEMVs in one sweep, against the word table)."""
    if family == "lanes+mma":
        return lanes_variants(m) + tensor_core_variants(m)
    choices = {"default": byte_variants, "words": words_variants, "lanes": lanes_variants, "mma": mma_variants}
    return choices[family](m)


def byte_variants(m: int) -> list[DecodeVariant]:
    """The tl.dot shapes (16-row tiles) and, for one row, the CUDA-core GEMV's over bytes."""
    found = [DecodeVariant(block_n=64, split_k=8, num_warps=2), DecodeVariant(block_n=128, split_k=2, num_warps=2)]
    if SWEEP_DOT_SHAPES:
        for bn, warps, stages, split in itertools.product((16, 32, 64, 128), (2, 4), (3, 4), (1, 2, 4, 8)):
            found.append(DecodeVariant(block_n=bn, block_k=128, split_k=split, num_warps=warps, num_stages=stages))
    if m == 1:
        for bn, warps, split, prefetch in itertools.product((16, 32, 64), (1, 2, 4), (8, 16, 32), (False, True)):
            found.append(
                DecodeVariant(
                    block_m=1,
                    block_n=bn,
                    block_k=128,
                    split_k=split,
                    num_warps=warps,
                    num_stages=1,
                    use_dot=False,
                    prefetch=prefetch,
                )
            )
        for split, prefetch in itertools.product((16, 32, 64), (False, True)):
            found.append(
                DecodeVariant(
                    block_m=1,
                    block_n=32,
                    block_k=64,
                    split_k=split,
                    num_warps=2,
                    num_stages=1,
                    use_dot=False,
                    prefetch=prefetch,
                )
            )
    return found


SWEEP_DOT_SHAPES = False  # the dot shapes were swept on 2026-12-02 (docs/gpu-runs.md): two of them kept above


def words_variants(m: int) -> list[DecodeVariant]:
    """The byte GEMV, then the word GEMV over whole rows (docs/gpu-runs.md, twenty-third session: few columns a
    program, K steps of several scale groups, no split): shapes of 4, 8 and 16 words a thread a step, each with
    and without the next step's words prefetched, x as one vector, and a cap of 96 registers (ncu on an H100 found
    the best shapes at 128 registers, 25% occupancy, issuing in half the cycles: latency-bound). Timed without
    PDL: back-to-back GEMVs would overlap more than the engine's norms and GEMVs do."""
    if m != 1:
        return []
    found = [DecodeVariant(block_m=1, block_n=32, block_k=128, split_k=16, num_warps=1, num_stages=1, use_dot=False)]
    shapes = ((8, 1024, 2), (16, 1024, 4), (16, 2048, 8), (8, 512, 1), (16, 512, 2), (32, 512, 4), (32, 1024, 8))
    shapes += ((16, 1024, 8), (8, 1024, 4), (16, 512, 4), (32, 256, 2), (64, 256, 4), (64, 512, 8))
    for (bn, bk, warps), prefetch, x_vector, registers in itertools.product(
        shapes, (False, True), (False, True), (0, 96)
    ):
        variant = kernels.word_gemv(bn, bk, warps, x_vector=x_vector, prefetch=prefetch, pdl=False)
        found.append(dataclasses.replace(variant, max_registers=registers))
    return found


def lanes_variants(m: int) -> list[DecodeVariant]:
    """The word GEMV's table (kernels.one_row_table, each tried on every shape), then the lane GEMV
    (int4_lanes.py): 4, 8 and 16 rows a program, 1, 2 and 4 warps, K in 1, 2 or 4 slices, with and without the
    next step's words prefetched. Without PDL, as words_variants."""
    if m != 1:
        return []
    found = table_without_pdl()
    for rows, warps, split, prefetch in itertools.product((4, 8, 16), (1, 2, 4), (1, 2, 4), (False, True)):
        found.append(kernels.lane_gemv(rows, warps, split_k=split, prefetch=prefetch, pdl=False))
    return found


def table_without_pdl() -> list[DecodeVariant]:
    """This GPU's one-row shapes (kernels.one_row_table), launched without PDL as the sweeps time them."""
    return [dataclasses.replace(variant, pdl=False) for variant in kernels.one_row_table().values()]


def mma_variants(m: int) -> list[DecodeVariant]:
    """The lane GEMV's table (kernels.one_row_table, each tried on every shape), then the tensor-core GEMV
    (int4_mma.py): 1 or 2 tiles of 16 rows a warp, 1, 2 and 4 warps, K in 1 to 8 slices, registers left to ptxas
    (which then issues the next step's loads late, to save registers) or capped at 168 (early; MMA_REGISTERS, a
    comma-separated list, picks the caps). Without PDL, as words_variants."""
    return table_without_pdl() + tensor_core_variants(m) if m == 1 else []


def tensor_core_variants(m: int) -> list[DecodeVariant]:
    """mma_variants' tensor-core GEMVs alone."""
    if m != 1:
        return []
    found = []
    caps = tuple(int(cap) for cap in os.environ.get("MMA_REGISTERS", "0,168").split(","))
    for tiles, warps, split, registers in itertools.product((1, 2), (1, 2, 4), (1, 2, 4, 8), caps):
        variant = kernels.mma_gemv(tiles, warps, split_k=split, pdl=False)
        found.append(dataclasses.replace(variant, max_registers=registers))
    return found


def use_swept_shapes(path: str, pdl: bool = True) -> dict[tuple[int, int], DecodeVariant]:
    """Fills this GPU's one-row table (kernels.one_row_table) with each shape's best one-row variant from a
    --sweep-decode output (its decode-best rows at m = 1), launched with PDL where it is a word GEMV and `pdl`, so
    that a bench in the same GPU call runs what the sweep found (a bench prelude)."""
    table = kernels.one_row_table()
    for line in open(path):
        row = json.loads(line) if line.startswith("{") else {}
        if row.get("kind") == "decode-best" and row.get("m") == 1 and row.get("best"):
            variant = DecodeVariant(**row["best"]["fields"])
            table[SHAPES[row["shape"]]] = dataclasses.replace(variant, pdl=pdl and variant.words)
    print(f"one-row shapes from {path}: {table}", file=sys.stderr)
    return table


def time_decode_variants(
    kind: str,
    name: str,
    x: torch.Tensor,
    weight: dict,
    rotation: list[dict],
    variants: list[DecodeVariant] | list[GemmTiles],
    matmul: Callable = int4_decode.int4_decode_matmul,
) -> dict[str, float]:
    """Each int4 kernel variant on x (the decode kernel's, or int4_gemm's tiles with matmul=int4_gemm): its
    relative error and microseconds emitted as `kind` rows; returns the times of those within 2e-2 of the dense
    product."""
    times = {}
    for variant in variants:
        try:
            call = lambda a, v=variant: matmul(  # noqa: E731
                x, a["qweight"], a["weight_scale"], a["weight_zero"], None, GROUP_SIZE, v
            )
            err = errors(call(weight["args"]), F.linear(x, weight["dense"]))["rel_err"]
            us = timed_us([lambda a=a: call(a) for a in rotation], repeats=5)[0]
        except Exception as error:
            emit(kind=f"{kind}-error", shape=name, m=x.shape[0], variant=str(variant), error=repr(error)[:300])
            continue
        emit(kind=kind, shape=name, m=x.shape[0], variant=str(variant), us=round(us, 2), rel_err=err)
        if err < 2e-2:
            times[str(variant)] = us
    return times


def sweep_decode(ms: tuple[int, ...], family: str = "default") -> None:
    """The decode kernel's variants against the general kernel's default and bf16, per shape and M; then the
    variant of least total time over the four shapes, and the best per shape summed (a per-shape table)."""
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    totals: dict[int, dict[str, float]] = {m: {} for m in ms}
    best_sum: dict[int, float] = {m: 0.0 for m in ms}
    for name, (n, k) in SHAPES.items():
        weight = quantized("int4", n, k, generator)
        rotation = copies(weight["args"])
        for m in ms:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=generator)
            dense_us = bf16_us(weight["dense"], x)
            general = kernels.choose_variant(m, n, k)  # weight_only_kernel's, as before the decode kernel
            general_us = timed_us([lambda a=a: call_variant(general, x, a) for a in rotation])[0]
            for key, us in (("bf16", dense_us), ("general", general_us)):
                totals[m][key] = totals[m].get(key, 0.0) + us
            variants = {str(v): v for v in decode_variants(m, family)}
            times = time_decode_variants("decode", name, x, weight, rotation, list(variants.values()))
            for variant, us in times.items():
                totals[m][variant] = totals[m].get(variant, 0.0) + us
            best = min(((us, variant) for variant, us in times.items()), default=None)
            fields = best and dataclasses.asdict(variants[best[1]])  # what use_swept_shapes builds it from
            emit(
                kind="decode-best",
                shape=name,
                m=m,
                bf16_us=round(dense_us, 2),
                general_us=round(general_us, 2),
                best=best and {"variant": best[1], "us": round(best[0], 2), "fields": fields},
            )
            best_sum[m] += best[0] if best else float("nan")
        del weight, rotation
        torch.cuda.empty_cache()
    best_totals = {m: {"per_shape_best_total_us": round(best_sum[m], 2)} for m in ms}
    emit_totals("decode-overall", totals, ("bf16", "general"), 5, best_totals)


def sweep_int4_prefill(ms: tuple[int, ...]) -> None:
    """The int4 decode kernel's tl.dot tiles at prefill sizes (its magic-number nibbles, no split: its workspace
    is decode's; narrow column blocks give the narrow projections programs enough to fill the SMs) against the
    path those sizes take now (the weight dequantized into a scratch buffer, then F.linear) and bf16: per shape,
    then the four projections' totals."""
    variants = [
        DecodeVariant(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
        for bm, bn, bk, warps, stages in itertools.product((64, 128), (32, 64, 128), (64, 128), (4, 8), (3, 4))
    ]
    totals: dict[int, dict[str, float]] = {m: {} for m in ms}
    for name, weight, rotation, m, x in shape_rows("int4", ms):
        per = totals[m]
        per["bf16"] = per.get("bf16", 0.0) + bf16_us(weight["dense"], x)
        dequantize_us = timed_us([lambda a=a: call_variant("dequantize", x, a) for a in rotation])[0]
        per["dequantize"] = per.get("dequantize", 0.0) + dequantize_us
        for variant, us in time_decode_variants("prefill", name, x, weight, rotation, variants).items():
            per[variant] = per.get(variant, 0.0) + us
    emit_totals("prefill-overall", totals, ("bf16", "dequantize"), 4)


def sweep_int4_gemm(ms: tuple[int, ...]) -> None:
    """int4_gemm.py's tiles (the weight as the tensor cores' register operand; the default shape with K split 2-8)
    against bf16, the dequantize path and the decode kernel's choice (16-row tiles with x as the A operand) at many
    rows, or a few (16-row tiles of int4_gemm then): per shape and M the best, then the totals."""
    tiles = [
        GemmTiles(block_n=bn, block_m=bm, block_k=bk, num_warps=warps, num_stages=stages)
        for bn, bm, bk, warps, stages in itertools.product((64, 128), (16, 32, 64, 128), (64, 128), (4, 8), (3, 4))
    ]
    for split, bm in itertools.product((2, 4, 8), (16, 64, 128)):  # K cut for the narrow projections (down_proj's)
        tiles.append(GemmTiles(block_m=bm, split_k=split))
    totals: dict[int, dict[str, float]] = {m: {} for m in ms}
    for name, weight, rotation, m, x in shape_rows("int4", ms):
        n, k = SHAPES[name]
        decode = kernels.choose_decode_variant(m, n, k)
        base = {
            "bf16": bf16_us(weight["dense"], x),
            "dequantize": timed_us([lambda a=a: call_variant("dequantize", x, a) for a in rotation])[0],
            "decode": time_decode_variants("gemm-decode", name, x, weight, rotation, [decode]).get(str(decode), 0.0),
        }
        rows = max(16, triton.next_power_of_2(m))  # 16-row tiles only where a few rows are all there is
        fitting = [t for t in tiles if t.block_m <= rows and (t.block_m > 16 or m <= 16)]
        times = time_decode_variants("gemm", name, x, weight, rotation, fitting, int4_gemm.int4_gemm)
        best = min(((us, tile) for tile, us in times.items()), default=None)
        rounded = {f"{key}_us": round(us, 2) for key, us in base.items()}
        emit(kind="gemm-best", shape=name, m=m, **rounded, best=best and {"tiles": best[1], "us": round(best[0], 2)})
        for key, us in (*base.items(), *times.items()):
            totals[m][key] = totals[m].get(key, 0.0) + us
    emit_totals("gemm-overall", totals, ("bf16", "dequantize", "decode"), 4)


def layout_variants(m: int, n: int, k: int) -> list[DecodeVariant]:
    """The chosen decode variant and, for one row, the GEMV shapes around it."""
    found = [kernels.choose_decode_variant(m, n, k)]
    if m == 1:
        for bn, warps, split in itertools.product((16, 32, 64), (1, 2), (8, 16, 32)):
            variant = DecodeVariant(
                block_m=1, block_n=bn, block_k=128, split_k=split, num_warps=warps, num_stages=1, use_dot=False
            )
            if variant not in found:
                found.append(variant)
    return found


def scale_layouts(ms: tuple[int, ...]) -> None:
    """The int4 decode kernel with row-major against group-major scales and zeros, per shape and M: each layout's
    time with the chosen variant and its best over layout_variants; then the totals over the four shapes."""
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    totals: dict[tuple[int, str], float] = {}
    for name, (n, k) in SHAPES.items():
        weight = quantized("int4", n, k, generator)
        layouts = {"group": copies(weight["args"])}
        layouts["row"] = [row_major(a) for a in layouts["group"]]
        expected_for = {}
        for m in ms:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=generator)
            expected_for[m] = F.linear(x, weight["dense"])
            row = {"kind": "layout", "shape": name, "m": m, "bf16_us": round(bf16_us(weight["dense"], x), 2)}
            for layout, rotation in layouts.items():
                best = None
                for index, variant in enumerate(layout_variants(m, n, k)):
                    call = lambda a, v=variant: int4_decode.int4_decode_matmul(  # noqa: E731
                        x, a["qweight"], a["weight_scale"], a["weight_zero"], None, GROUP_SIZE, v
                    )
                    err = errors(call(rotation[0]), expected_for[m])["rel_err"]
                    us = timed_us([lambda a=a: call(a) for a in rotation], repeats=5)[0]
                    if index == 0:
                        row[f"{layout}_chosen_us"], row[f"{layout}_chosen_err"] = round(us, 2), err
                    if err < 2e-2 and (best is None or us < best[0]):
                        best = (us, str(variant))
                row[f"{layout}_best"] = best and [round(best[0], 2), best[1]]
                for key, us in ((f"{layout}_chosen", row[f"{layout}_chosen_us"]), (f"{layout}_best", best[0])):
                    totals[(m, key)] = totals.get((m, key), 0.0) + us
                totals[(m, "bf16")] = totals.get((m, "bf16"), 0.0) + (row["bf16_us"] if layout == "row" else 0)
            emit(**row)
        del weight, layouts
        torch.cuda.empty_cache()
    for m in ms:
        emit(kind="layout-total", m=m, **{key: round(us, 2) for (mm, key), us in totals.items() if mm == m})


def race_check() -> None:
    """Split-K launches many times over, on the gate/up and down shapes at 1 and 8 rows: the default shapes, the
    shapes whose sums sweeps found wrong (16 x 32 tiles on two warps; tensor-core GEMVs of several warps, before
    their programs' warps met at a barrier ahead of the counter), lane GEMVs of two warps split: the worst
    relative error of 100 launches each, and the time (us)."""
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for shape in ("gate_up", "down"):
        n, k = SHAPES[shape]
        weight = quantized("int4", n, k, generator)
        rotation = copies(weight["args"])
        for m in (1, 8):
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=generator)
            expected = F.linear(x, weight["dense"])
            variants = [kernels.choose_decode_variant(m, n, k)]
            variants += [DecodeVariant(block_n=32, block_k=128, split_k=split, num_warps=2) for split in (2, 8)]
            if m == 1:
                variants += [kernels.mma_gemv(1, 4, split_k=2), kernels.mma_gemv(1, 2, split_k=4)]
                variants += [kernels.mma_gemv(2, 2, split_k=8), kernels.lane_gemv(4, 2, split_k=4)]
            for variant in variants:
                call = lambda a, v=variant: int4_decode.int4_decode_matmul(  # noqa: E731
                    x, a["qweight"], a["weight_scale"], a["weight_zero"], None, GROUP_SIZE, v
                )
                worst = max(errors(call(weight["args"]), expected)["rel_err"] for _ in range(100))
                us = timed_us([lambda r=r: call(r) for r in rotation], repeats=5)[0]
                emit(kind="race", shape=shape, m=m, variant=str(variant), worst_rel_err=worst, us=round(us, 2))
        del weight, rotation
        torch.cuda.empty_cache()


def ncu_once() -> None:
    """Each projection's one-row int4 kernel (kernels.choose_decode_variant) and its bf16 F.linear, launched twice
    each on fresh weights: a program for `ncu` to profile (gpu_session.sh int4-ncu), not a timing."""
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        weight = quantized("int4", n, k, generator)
        x = torch.randn(1, k, device=DEVICE, dtype=DTYPE, generator=generator)
        for _ in range(2):
            kernels.int4_linear(x, bias=None, **weight["args"])
            F.linear(x, weight["dense"])
        torch.cuda.synchronize()
        emit(kind="ncu-once", shape=name, variant=str(kernels.choose_decode_variant(1, n, k)))
        del weight
