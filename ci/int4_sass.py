"""SASS instructions a weight of the int4 one-row GEMV's main loop, compiled for an H200 (sm90) on any machine:
Triton's pipeline with its bundled ptxas and nvdisasm, arguments specialised as a Llama-3.1-8B qkv_proj call
would be (pointers and multiples of 16 marked divisible by 16). No GPU is needed; a GPU run says what the counts
are worth. Usage: env -u TRITON_INTERPRET .venv/bin/python ci/int4_sass.py [--shapes 128x128x1 32x128x1 ...];
`--lanes 8x2 4x1 ...` counts lane GEMVs (ROWSxWARPS, prefetching) instead, with their registers a thread, and
`--epilogue` compiles them with a norm fold, gate_up's SiLU or qkv's rotation, as the engine's one-row calls run."""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode
from tritonllm.engine.embedded.quant import int4_mma

TARGET = GPUTarget("cuda", 90, 32)
N, K, GROUP = 6144, 4096, 128  # qkv_proj's N x K, the W4A16 group


def compile_specialised(kernel, pointers: dict, constexprs: dict, values: dict, warps: int, max_registers: int = 0):
    """kernel compiled for sm90 with the pointers and the values that are multiples of 16 marked divisible by 16
    (as Triton specialises a launch), the other scalars int32; max_registers caps registers a thread (0: none)."""
    names = kernel.arg_names
    signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs and (n in pointers or values.get(n, 1) % 16 == 0)
    }
    fixed = {(names.index(n),): value for n, value in constexprs.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=fixed, attrs=attrs)
    options = dict(num_warps=warps, num_stages=1) | (dict(maxnreg=max_registers) if max_registers else {})
    return compile(source, target=TARGET, options=options)


FOLDED = ("x", "scale", "bias", "out", "fold_residual", "fold_weight", "fold_h")
EPILOGUES = {"plain": {}, "fold-in": dict(FOLD_IN=True), "fold-out": dict(FOLD_OUT=True)}
EPILOGUES["gated"] = dict(FOLD_IN=True, GATED=True)  # gate_up at one row with fusion.SILU_IN_GATE_UP
EPILOGUES["rotary"] = dict(FOLD_IN=True, ROTARY=True)  # qkv at one row with fusion.ROTARY_IN_QKV (a bf16 cache)
ROTARY_POINTERS = {"rot_cos": "*bf16", "rot_sin": "*bf16", "rot_slots": "*i64", "rot_k_cache": "*bf16"}
ROTARY_POINTERS |= {"rot_v_cache": "*bf16", "rot_k_inv": "fp32", "rot_v_inv": "fp32"}


def compiled(words: bool, block_n: int, block_k: int, warps: int, split: int, lanes=False, epilogue="plain", cap=0):
    """The one-row kernel specialised as a call would be; `epilogue` names its norm folds or gated SiLU, `cap` a
    cap on registers a thread (DecodeVariant.max_registers)."""
    kernel = int4_decode._int4_decode_kernel
    pointers = {name: "*bf16" for name in FOLDED}
    pointers |= {"w": "*i32" if words else "*u8", "zero": "*u8", "workspace": "*fp32", "counters": "*i32"}
    pointers |= {name: "*fp32" for name in ("scale_sums", "fold_sums", "fold_stale")} | {"scale_eps": "fp32"}
    constexprs = dict(GROUP_SIZE=GROUP, HAS_BIAS=False, SPLIT_K=split, USE_ASM=True, FP16=False, UPCAST=False)
    constexprs |= dict(FOLD_IN=False, FOLD_OUT=False, GATED=False, ROTARY=False) | EPILOGUES[epilogue]
    constexprs |= dict(HEADS=32, KV_HEADS=8, HEAD_DIM=128, QUANTIZE_KV=False)  # Llama-3.1-8B's attention
    if constexprs["ROTARY"]:
        pointers |= ROTARY_POINTERS
    constexprs |= dict(
        USE_DOT=False,
        PREFETCH=lanes,
        WORDS=words,
        LANES=lanes,
        EVEN_K=K % block_k == 0,
        X_VECTOR=False,
        PDL=False,
        INTERPRETED=False,
        BLOCK_M=1,
    )
    constexprs |= dict(BLOCK_N=block_n, BLOCK_K=block_k)
    values = dict(N=N, K=K, k_per_split=K // split, stride_xm=K, stride_w=K // (8 if words else 2))
    constexprs |= dict(stride_s=1, stride_z=1, EVEN_N=N % block_n == 0)  # group-major scales (QuantLinear's): a
    values |= dict(stride_sg=N, stride_zg=N, stride_om=N)  # row stride of 1 is specialised as Triton's launch does
    return compile_specialised(kernel, pointers, constexprs, values, warps, cap)


def compiled_mma(tiles: int, warps: int, split: int):
    """A tensor-core GEMV (int4_mma.py) of `tiles` 16-row tiles a warp, specialised as compiled() is."""
    kernel = int4_mma.int4_mma_kernel
    pointers = {name: "*bf16" for name in ("x", "scale", "bias", "out")}
    pointers |= {"w": "*i32", "zero": "*u8", "workspace": "*fp32", "counters": "*i32"}
    constexprs = dict(GROUP_SIZE=GROUP, HAS_BIAS=False, SPLIT_K=split, TILES=tiles, WARPS=warps, FP16=False)
    constexprs |= dict(USE_ASM=True, PDL=False, INTERPRETED=False)
    values = dict(N=N, K=K, k_per_split=K // split, stride_w=K // 8, stride_s=K // GROUP, stride_sg=1)
    values |= dict(stride_z=K // GROUP, stride_zg=1)
    return compile_specialised(kernel, pointers, constexprs, values, warps)


def sass(words: bool, block_n: int, block_k: int, warps: int, split: int) -> str:
    return compiled(words, block_n, block_k, warps, split).asm["sass"]


def registers(kernel) -> str:
    """Registers a thread (and bytes of stack, where it spills), from the cubin (cuobjdump beside ptxas)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    return " ".join(re.findall(r"REG:\d+|STACK:\d+", usage))


def loop_opcodes(text: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body: the K loop."""
    lines, labels, body = text.splitlines(), {}, (0, 0)
    for index, line in enumerate(lines):
        if match := re.match(r"^\.?(LBB\w+):", line.strip()):
            labels[match.group(1)] = index
        if (match := re.search(r"BRA `?\(?\.?(LBB\w+)", line)) and labels.get(match.group(1), index) < index:
            if index - labels[match.group(1)] > body[1] - body[0]:
                body = (labels[match.group(1)], index)
    counts: collections.Counter = collections.Counter()
    for line in lines[body[0] : body[1] + 1]:
        fields = line.split("\t")
        if len(fields) >= 2 and fields[1].strip():
            tokens = fields[1].split()
            counts[(tokens[1] if tokens[0].startswith("@") else tokens[0]).split(".")[0]] += 1
    return counts


def per_weight(text: str, per_thread: float) -> str:
    """The K loop's instructions a weight (per_thread: weights a thread handles in one step), and its six
    commonest opcodes'."""
    counts = loop_opcodes(text)
    top = ", ".join(f"{op} {n / per_thread:.2f}" for op, n in counts.most_common(6))
    return f"{sum(counts.values()) / per_thread:.2f} instructions a weight ({top})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes",
        nargs="*",
        default=["32x128x1", "64x128x1", "128x128x1", "256x128x2"],
        help="BLOCK_NxBLOCK_KxWARPS program shapes, each compiled as bytes and as words",
    )
    parser.add_argument("--split", type=int, default=16, help="split K")
    parser.add_argument("--lanes", nargs="*", default=None, help="ROWSxWARPS lane GEMVs, counted instead")
    parser.add_argument(
        "--epilogue",
        choices=sorted(EPILOGUES),
        default="plain",
        help="the lane GEMVs' epilogue (norm folds, SiLU, RoPE and KV store)",
    )
    parser.add_argument("--mma", nargs="*", default=None, help="TILESxWARPS tensor-core GEMVs, counted instead")
    parser.add_argument("--max-registers", type=int, default=0, help="with --lanes: a cap on registers a thread")
    args = parser.parse_args()
    for shape in args.mma or []:
        tiles, warps = (int(part) for part in shape.split("x"))
        kernel = compiled_mma(tiles, warps, 1)
        per_thread = tiles * 2 * 32 * 2  # four words of two rows a tile, a lane, a step; two steps a loop
        print(f"mma {shape}: {per_weight(kernel.asm['sass'], per_thread)}, {registers(kernel)}", flush=True)
    if args.mma is not None:
        return
    for shape in args.lanes or []:
        rows, warps = (int(part) for part in shape.split("x"))
        kernel = compiled(True, rows, 1024 * warps, warps, 1, True, args.epilogue, args.max_registers)
        per_thread = rows * 32  # four words of each row a lane, a step
        label = f"lanes {shape} {args.epilogue}" + (f" cap {args.max_registers}" if args.max_registers else "")
        print(f"{label}: {per_weight(kernel.asm['sass'], per_thread)}, {registers(kernel)}", flush=True)
    if args.lanes is not None:
        return
    for shape in args.shapes:
        block_n, block_k, warps = (int(part) for part in shape.split("x"))
        for words in (False, True):
            per_thread = block_n * block_k / (32 * warps)  # weights a thread handles in one K step
            counted = per_weight(sass(words, block_n, block_k, warps, args.split), per_thread)
            print(f"{shape} {'words' if words else 'bytes'}: {counted}", flush=True)


if __name__ == "__main__":
    main()
