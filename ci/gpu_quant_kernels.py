"""The quantized matmuls (quant/kernels.py) on one GPU, on Llama-3.1-8B's projections in bf16: each checked against
F.linear of the dequantized weight (fp8 also against its emulated product) and timed against the bf16 F.linear at
several M. `--sweep` times the kernel's program shapes (quant/weight_only_kernel.Variant) and the large-M
strategies instead, so that one GPU call picks the defaults of kernels.choose_variant. The int4 kernels' sweeps
(gpu_int4_sweeps.py), the FP8 ones (gpu_fp8_sweeps.py) and greedy sampling's kernel are options of this command.
JSON lines on stdout.

Times are CUDA-graph replays (decode runs in graphs; eager launches would time the host), over enough copies of
each weight to overflow the 50 MB L2, so they are memory-bound where they should be; the median of repeats.
Run by `bash ci/gpu_session.sh quant-kernels`, `quant-sweep` and others; CI never runs it (no GPU there)."""

from __future__ import annotations

import argparse
import itertools
import sys

import gpu_fp8_sweeps
import gpu_int4_sweeps
import torch
import torch.nn.functional as F
from gpu_quant_common import (
    DEVICE,
    DTYPE,
    MS,
    SHAPES,
    bf16_us,
    call_default,
    call_variant,
    copies,
    emit,
    errors,
    quantized,
    timed_us,
)

from tritonllm.engine.embedded.quant import fp8_kernel, kernels
from tritonllm.engine.embedded.quant.weight_only_kernel import Variant


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


def decode_family(args: argparse.Namespace) -> str:
    """--sweep-decode's variants (gpu_int4_sweeps.decode_variants) from --lanes, --mma and --words."""
    if args.lanes:
        return "lanes+mma" if args.mma else "lanes"
    return "mma" if args.mma else "words" if args.words else "default"


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
        gpu_int4_sweeps.race_check()
    elif args.ncu_once:
        gpu_int4_sweeps.ncu_once()
    elif args.fp8_rows:
        gpu_fp8_sweeps.time_fp8_rows(ms)
    elif args.sweep_decode:
        gpu_int4_sweeps.sweep_decode(ms, decode_family(args))
    elif args.scale_layouts:
        gpu_int4_sweeps.scale_layouts(ms)
    elif args.sweep_fp8:
        gpu_fp8_sweeps.sweep_fp8(ms)
    elif args.greedy:
        time_greedy(ms)
    elif args.int4_prefill:
        gpu_int4_sweeps.sweep_int4_prefill(ms)
    elif args.int4_gemm:
        gpu_int4_sweeps.sweep_int4_gemm(ms)
    else:
        (sweep if args.sweep else check_and_time)(formats, ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
