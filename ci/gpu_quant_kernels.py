"""The quantized matmuls (quant/kernels.py) on one GPU, on Llama-3.1-8B's projections in bf16: each checked against
F.linear of the dequantized weight (fp8 also against its emulated product) and timed against the bf16 F.linear at
several M. `--sweep` times the kernel's program shapes (quant/weight_only_kernel.Variant) and the large-M
strategies instead, so that one GPU call picks the defaults of kernels.choose_variant. JSON lines on stdout.

Times are CUDA-graph replays (decode runs in graphs; eager launches would time the host), over enough copies of
each weight to overflow the 50 MB L2, so they are memory-bound where they should be; the median of repeats.
Run by `bash ci/gpu_session.sh quant-kernels` or `quant-sweep`; CI never runs it (no GPU there)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
import triton

from tritonllm.engine.embedded.quant import formats, fp8_kernel, int4_gemm, kernels
from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode
from tritonllm.engine.embedded.quant import weight_only_kernel as wo
from tritonllm.engine.embedded.quant.fp8_matmul_kernel import Fp8Tiles, fp8_matmul
from tritonllm.engine.embedded.quant.int4_decode_kernel import DecodeVariant
from tritonllm.engine.embedded.quant.int4_gemm import GemmTiles
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
    replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (rounds * len(calls)))
    return statistics.median(times), mode


def errors(got: torch.Tensor, expected: torch.Tensor) -> dict:
    diff = (got.float() - expected.float()).norm() / expected.float().norm().clamp(min=1e-30)
    return {"rel_err": float(diff), "max_abs_diff": float((got.float() - expected.float()).abs().max())}


def bf16_us(dense: torch.Tensor, x: torch.Tensor) -> float:
    weights = copies({"w": dense})
    return timed_us([lambda w=w["w"]: F.linear(x, w) for w in weights], min_calls=16 if x.shape[0] >= 256 else 48)[0]


# ---- the two runs ----


def check_and_time(formats: list[str], ms: tuple[int, ...]) -> None:
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for fmt, (name, (n, k)) in itertools.product(formats, SHAPES.items()):
        if fmt == "fp8" and not kernels.fp8_supported(DEVICE):
            emit(kind="skip", format=fmt, reason="no FP8 tensor cores")
            continue
        weight = quantized(fmt, n, k, generator)
        rotation = copies(weight["args"])
        for m in ms:
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE, generator=generator)
            got = call_default(fmt, x, weight["args"])
            row = dict(kind="check", format=fmt, shape=name, n=n, k=k, m=m, **errors(got, F.linear(x, weight["dense"])))
            if fmt == "fp8":
                x_q, x_scale = kernels.quantize_per_token(x)
                emulated = F.linear(x_q.float() * x_scale, weight["dense"].float())
                row["rel_err_vs_emulated"] = errors(got, emulated)["rel_err"]
                row["quantize_us"] = round(timed_us([lambda: fp8_kernel.quantize_rows(x)])[0], 2)
                row["quantize_torch_us"] = round(timed_us([lambda: kernels.quantize_per_token(x)])[0], 2)
            else:
                row["variant"] = (
                    str(kernels.choose_decode_variant(m, n, k)) if m <= kernels.SMALL_M else kernels.LARGE_M_STRATEGY
                )
                # split K's in-launch reduction, many launches in a row: the worst error of any
                worst = max(
                    errors(call_default(fmt, x, weight["args"]), F.linear(x, weight["dense"]))["rel_err"]
                    for _ in range(100)
                )
                row["rel_err_worst_of_100"] = worst
            quant_us, mode = timed_us(
                [lambda a=a: call_default(fmt, x, a) for a in rotation], min_calls=16 if m >= 256 else 48
            )
            dense_us = bf16_us(weight["dense"], x)
            emit(
                **row,
                quant_us=round(quant_us, 2),
                bf16_us=round(dense_us, 2),
                speedup=round(dense_us / quant_us, 2),
                timing=mode,
            )
        del weight, rotation
        torch.cuda.empty_cache()


def sweep_variants(m: int) -> list[Variant | str]:
    """The program shapes worth timing at M = m (a few dozen: each compiles once, a second or two)."""
    found: list[Variant | str] = []
    if m <= 8:
        block_m = 1 << (m - 1).bit_length()
        for bn, bk, split in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4, 8)):
            if block_m * bn * bk <= 16384:
                for warps in (4, 8) if bk == 512 else (4,):
                    found.append(Variant(block_m, bn, bk, split_k=split, use_dot=False, num_warps=warps))
    if m <= 16:
        for bn, bk, split in itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4)):
            found.append(Variant(16, bn, bk, split_k=split))
    else:
        for bm, bn, bk, warps in itertools.product((32, 64, 128), (64, 128), (32, 64), (4, 8)):
            if bm <= max(32, m):
                found.append(Variant(bm, bn, bk, num_warps=warps, num_stages=3))
        found.append("dequantize")
    return found


def time_variant(variant: Variant | str, x: torch.Tensor, weight: dict, rotation: list[dict]) -> tuple[float, float]:
    """(microseconds a call, relative error against the bf16 product)."""
    err = errors(call_variant(variant, x, weight["args"]), F.linear(x, weight["dense"]))["rel_err"]
    calls = [lambda a=a: call_variant(variant, x, a) for a in rotation]
    return timed_us(calls, min_calls=16 if x.shape[0] >= 256 else 48, repeats=5)[0], err


def sweep_shape(fmt: str, name: str, m: int, weight: dict, rotation: list[dict], totals: dict) -> None:
    """Every variant at one (shape, M): a `sweep` line each, then the shape's `best`; adds to totals[variant]."""
    n, k = SHAPES[name]
    x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
    dense_us = bf16_us(weight["dense"], x)
    totals.setdefault("bf16", []).append(dense_us)
    best: tuple[float, str] | None = None
    for variant in sweep_variants(m):
        try:
            us, err = time_variant(variant, x, weight, rotation)
        except Exception as error:  # a shape that does not compile or launch (registers, shared memory)
            emit(kind="sweep-error", format=fmt, shape=name, m=m, variant=str(variant), error=repr(error)[:200])
            continue
        emit(kind="sweep", format=fmt, shape=name, m=m, variant=str(variant), us=round(us, 2), rel_err=err)
        if err < 2e-2:
            totals.setdefault(str(variant), []).append(us)
            best = min(best or (us, str(variant)), (us, str(variant)))
    summary = None if best is None else {"variant": best[1], "us": round(best[0], 2)}
    emit(kind="best", format=fmt, shape=name, m=m, bf16_us=round(dense_us, 2), best=summary)


def sweep(formats: list[str], ms: tuple[int, ...]) -> None:
    """Per format and M, the variants on every shape; then `best-overall`: the variant of the least total time
    over the shapes (one choose_variant entry), beside bf16's total."""
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for fmt in [f for f in formats if f != "fp8"]:
        totals: dict[int, dict[str, list[float]]] = {m: {} for m in ms}
        for name, (n, k) in SHAPES.items():
            weight = quantized(fmt, n, k, generator)
            rotation = copies(weight["args"])
            for m in ms:
                sweep_shape(fmt, name, m, weight, rotation, totals[m])
            del weight, rotation
            torch.cuda.empty_cache()
        for m, per_variant in totals.items():
            complete = {v: sum(t) for v, t in per_variant.items() if len(t) == len(SHAPES) and v != "bf16"}
            best = min(complete, key=complete.__getitem__) if complete else None
            bf16_total = sum(per_variant.get("bf16", []))
            emit(
                kind="best-overall",
                format=fmt,
                m=m,
                variant=best,
                total_us=None if best is None else round(complete[best], 2),
                bf16_total_us=round(bf16_total, 2),
                speedup=None if best is None else round(bf16_total / complete[best], 2),
            )


# ---- the int4 decode kernel and the FP8 matmuls (--sweep-decode, --sweep-fp8) ----


def decode_variants(m: int) -> list[DecodeVariant]:
    """The tl.dot shapes (16-row tiles) and, for one row, the CUDA-core GEMV's."""
    if DECODE_SWEEP_LANES:  # with DECODE_SWEEP_MMA too: both GEMVs in one sweep
        return lanes_variants(m) + (tensor_core_variants(m) if DECODE_SWEEP_MMA else [])
    if DECODE_SWEEP_MMA:
        return mma_variants(m)
    if DECODE_SWEEP_WORDS:
        return words_variants(m)
    found = [DecodeVariant(block_n=64, split_k=8, num_warps=2), DecodeVariant(block_n=128, split_k=2, num_warps=2)]
    if DECODE_SWEEP_DOT:
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


DECODE_SWEEP_DOT = False  # the dot shapes were swept on 2026-12-02 (docs/gpu-runs.md): two of them kept above
DECODE_SWEEP_WORDS = False  # --words: only the one-row GEMV over int32 words, against the byte GEMV
DECODE_SWEEP_LANES = False  # --lanes: the lane GEMV's shapes against the word GEMV's table
DECODE_SWEEP_MMA = False  # --mma: the tensor-core GEMV's shapes against the lane GEMV's table


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


def sweep_decode(ms: tuple[int, ...]) -> None:
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
            variants = {str(v): v for v in decode_variants(m)}
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


def group_major(args: dict) -> dict:
    """The same weight with scales and zeros stored [groups, N] (still viewed as [N, groups]), as QuantLinear
    stores them."""
    moved = {key: args[key].t().contiguous().t() for key in ("weight_scale", "weight_zero")}
    return {**args, **moved}


def row_major(args: dict) -> dict:
    """The same weight with scales and zeros stored [N, groups]."""
    return {**args, **{key: args[key].contiguous() for key in ("weight_scale", "weight_zero")}}


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


def time_greedy(ms: tuple[int, ...]) -> None:
    """sampler's greedy pick (greedy_kernel.py, the LM head's bf16 output read once) against torch's ops on the
    fp32 copy (what a greedy step ran before), Llama-3's 128,256-entry vocabulary: time and agreement."""
    from tritonllm.engine.embedded import greedy_kernel, sampler

    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for m in ms:
        logits = torch.randn(m, 128_256, device=DEVICE, dtype=DTYPE, generator=generator) * 3

        def torch_ops():
            full = logits.float()
            tokens = full.argmax(dim=-1)
            return tokens, sampler.chosen_logprobs(full, tokens)

        got, want = greedy_kernel.greedy_pick(logits), torch_ops()
        emit(
            kind="greedy",
            m=m,
            kernel_us=round(timed_us([lambda: greedy_kernel.greedy_pick(logits)])[0], 2),
            torch_us=round(timed_us([torch_ops])[0], 2),
            tokens_equal=torch.equal(got[0], want[0]),
            logprob_max_diff=float((got[1] - want[1]).abs().max()),
        )


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time the program shapes instead of the defaults")
    parser.add_argument("--sweep-decode", action="store_true", help="time the int4 decode kernel's variants")
    parser.add_argument("--words", action="store_true", help="with --sweep-decode: the int32-word GEMV's shapes only")
    parser.add_argument(
        "--lanes", action="store_true", help="with --sweep-decode: lane GEMVs, word table (with --mma: both GEMVs)"
    )
    parser.add_argument("--mma", action="store_true", help="with --sweep-decode: tensor-core GEMVs, lane table")
    parser.add_argument("--fp8-rows", action="store_true", help="fused norm / SiLU FP8 rows against the quantizer")
    parser.add_argument("--race-check", action="store_true", help="split-K launches repeated, worst error")
    parser.add_argument("--scale-layouts", action="store_true", help="int4 decode: row- against group-major scales")
    parser.add_argument("--sweep-fp8", action="store_true", help="time _scaled_mm against the Triton FP8 matmul")
    parser.add_argument("--greedy", action="store_true", help="greedy sampling's kernel against torch's ops")
    parser.add_argument("--int4-prefill", action="store_true", help="int4 dot tiles at prefill sizes")
    parser.add_argument("--int4-gemm", action="store_true", help="int4_gemm's tiles against dequantize at many rows")
    parser.add_argument("--ncu-once", action="store_true", help="one-row int4 and bf16 launches for ncu to profile")
    parser.add_argument("--formats", default="int4,int8,fp8", help="comma-separated of int4, int8, fp8")
    parser.add_argument("--ms", default=",".join(map(str, MS)), help="comma-separated row counts")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    ms = tuple(int(m) for m in args.ms.split(","))
    torch.manual_seed(0)
    emit(
        kind="device",
        name=torch.cuda.get_device_name(),
        torch=torch.__version__,
        fp8=kernels.fp8_supported(DEVICE),
    )
    if args.race_check:
        race_check()
    elif args.ncu_once:
        ncu_once()
    elif args.fp8_rows:
        time_fp8_rows(ms)
    elif args.sweep_decode:
        global DECODE_SWEEP_WORDS, DECODE_SWEEP_LANES, DECODE_SWEEP_MMA
        DECODE_SWEEP_WORDS = args.words
        DECODE_SWEEP_LANES = args.lanes
        DECODE_SWEEP_MMA = args.mma
        sweep_decode(ms)
    elif args.scale_layouts:
        scale_layouts(ms)
    elif args.sweep_fp8:
        sweep_fp8(ms)
    elif args.greedy:
        time_greedy(ms)
    elif args.int4_prefill:
        sweep_int4_prefill(ms)
    elif args.int4_gemm:
        sweep_int4_gemm(ms)
    else:
        (sweep if args.sweep else check_and_time)(formats, ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
