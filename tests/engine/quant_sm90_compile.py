"""Compiles the quant kernels for compute capability 9.0 (an H200) without a GPU: Triton's whole pipeline, down to a
cubin through its bundled ptxas. Run by test_quant_kernels.py in a process without TRITON_INTERPRET; prints one
`compiled ...` line a kernel variant and exits non-zero on the first failure."""

import re
from dataclasses import replace

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from tritonllm.engine.embedded.attention import decode_kernels, kv_store
from tritonllm.engine.embedded.network import fused_ops
from tritonllm.engine.embedded.quant import fp8_kernel, fp8_matmul_kernel, int4_gemm, int4_mma
from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode
from tritonllm.engine.embedded.quant import weight_only_kernel as wo
from tritonllm.engine.embedded.quant.weight_only_kernel import Variant

TARGET = GPUTarget("cuda", 90, 32)

WEIGHT_ONLY = [  # bits, dtype, variant, group size
    (4, "bf16", Variant(block_m=1, block_n=32, block_k=128, split_k=2, use_dot=False), 128),
    (4, "bf16", Variant(block_m=16, block_n=64, block_k=256), 128),  # whole groups a tile
    (4, "fp16", Variant(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3), 96),  # gathered
    (8, "fp32", Variant(block_m=4, block_n=32, block_k=64, split_k=3, use_dot=False), 4096),
]


def compile_for_sm90(kernel, pointers: dict, constexprs: dict, **options):
    """Scalars not named are int32. Returns the compiled kernel."""
    names = kernel.arg_names
    signature = {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}
    fixed = {(names.index(n),): value for n, value in constexprs.items()}
    return compile(ASTSource(fn=kernel, signature=signature, constexprs=fixed), target=TARGET, options=options)


def weight_only(bits: int, dtype: str, variant: Variant, group_size: int) -> None:
    pointers = {name: f"*{dtype}" for name in ("x", "scale", "bias")}
    pointers |= {"w": "*u8" if bits == 4 else "*i8", "zero": "*u8"}
    pointers["out"] = "*fp32" if variant.split_k > 1 else f"*{dtype}"
    scales = wo.scale_layout(group_size, variant.block_k)
    constexprs = dict(BITS=bits, GROUP_SIZE=group_size, SCALES=scales, HAS_BIAS=True, SPLIT_K=variant.split_k)
    constexprs |= dict(USE_DOT=variant.use_dot, UPCAST=False, IEEE=dtype == "fp32")
    constexprs |= dict(BLOCK_M=variant.block_m, BLOCK_N=variant.block_n, BLOCK_K=variant.block_k)
    options = dict(num_warps=variant.num_warps, num_stages=variant.num_stages)
    compile_for_sm90(wo._weight_only_matmul_kernel, pointers, constexprs, **options)
    dequantize = dict(BITS=bits, GROUP_SIZE=group_size, SCALES=scales, BLOCK_N=32, BLOCK_K=variant.block_k)
    compile_for_sm90(wo._dequantize_kernel, pointers | {"out": f"*{dtype}"}, dequantize, num_warps=4)
    print("compiled weight-only", bits, dtype, variant, group_size, flush=True)


def int4_decode_kernel(
    dtype: str,
    split_k: int,
    use_asm: bool,
    use_dot: bool,
    words: bool = False,
    block_n: int = 32,
    block_k: int = 128,
    x_vector: bool = False,
    pdl: bool = False,
    prefetch: bool | None = None,
    lanes: bool = False,
    fold_in: bool = False,
    fold_out: bool = False,
    gated: bool = False,
    kv_cache: str = "",
) -> None:
    """kv_cache: the KV caches' type where qkv's rotation folds in (qkv_rotary.py), "" where it does not."""
    pointers = {name: f"*{dtype}" for name in ("x", "scale", "bias", "out", "fold_residual", "fold_weight", "fold_h")}
    pointers |= {"w": "*i32" if words else "*u8", "zero": "*u8", "workspace": "*fp32", "counters": "*i32"}
    pointers |= {name: "*fp32" for name in ("scale_sums", "fold_sums", "fold_stale")} | {"scale_eps": "fp32"}
    constexprs = dict(GROUP_SIZE=128, HAS_BIAS=True, SPLIT_K=split_k, USE_ASM=use_asm, FP16=dtype == "fp16")
    constexprs |= dict(FOLD_IN=fold_in, FOLD_OUT=fold_out, GATED=gated)
    constexprs |= dict(ROTARY=bool(kv_cache), HEADS=32, KV_HEADS=8, HEAD_DIM=128, QUANTIZE_KV=kv_cache == "fp8e4nv")
    if kv_cache:
        pointers |= {"rot_cos": f"*{dtype}", "rot_sin": f"*{dtype}", "rot_slots": "*i64"}
        pointers |= {
            "rot_k_cache": f"*{kv_cache}",
            "rot_v_cache": f"*{kv_cache}",
            "rot_k_inv": "fp32",
            "rot_v_inv": "fp32",
        }
    prefetch = not (use_dot or words) if prefetch is None else prefetch
    constexprs |= dict(UPCAST=False, USE_DOT=use_dot, PREFETCH=prefetch, WORDS=words)
    constexprs |= dict(INTERPRETED=False, BLOCK_M=16 if use_dot else 1, BLOCK_N=block_n, BLOCK_K=block_k)
    constexprs |= dict(X_VECTOR=x_vector, PDL=pdl, LANES=lanes)
    for even_k in (False, True):  # K masked in each step, or a multiple of the step
        constexprs["EVEN_K"] = even_k
        options = dict(num_warps=4, num_stages=3) | (dict(launch_pdl=True) if pdl else {})
        ptx = compile_for_sm90(int4_decode._int4_decode_kernel, pointers, constexprs, **options).asm["ptx"]
        if split_k > 1:
            assert_counts_after_barrier(ptx)
        if pdl:
            assert_loads_weights_first(ptx, "ld.global")
            assert "griddepcontrol.launch_dependents" in ptx[: ptx.index("griddepcontrol.wait")]
        if fold_out:  # the slots' adds: after the wait (their readers' reads come after theirs)
            assert "atom.global" in ptx and "atom.global" not in ptx[: ptx.index("griddepcontrol.wait")]
    shape = f"split {split_k} asm {use_asm} dot {use_dot} words {words} {block_n} x {block_k} x vector {x_vector}"
    shape += f" pdl {pdl} prefetch {prefetch} lanes {lanes} fold in {fold_in} out {fold_out} gated {gated}"
    shape += f" rotary {kv_cache or False}"
    print("compiled the int4 decode kernel", dtype, shape, flush=True)


def assert_loads_weights_first(ptx: str, load: str) -> None:
    """Launched with PDL, a GEMV requests its first weights (`load`) before it waits for the kernels before it,
    and stores nothing before the wait."""
    wait = ptx.index("griddepcontrol.wait")
    assert load in ptx[:wait] and "st.global" not in ptx[:wait], "PDL: loads and stores misplaced"


def assert_counts_after_barrier(ptx: str) -> None:
    """A split-K program's one counting thread increments the tile counter only after a barrier that follows the
    fences: every warp's workspace adds come before the count. (Triton 3.9 puts a barrier before a scalar atomic
    of its own; the GPU machine's 3.6 does not, and there only the kernels' own barrier passes: run this script
    with Triton 3.6's wheel first on PYTHONPATH to check it there.)"""
    count = ptx.index("atom.global.gpu.acq_rel")
    fence = ptx.rindex("fence.acq_rel.gpu", 0, count)
    assert "bar.sync" in ptx[fence:count], "split K: the counter is incremented before the program's warps meet"


def int4_mma_kernel(dtype: str, split_k: int, tiles: int, warps: int, use_asm: bool, pdl: bool) -> None:
    """The tensor-core GEMV (int4_mma.py): its PTX compiles (mma.sync on sm90); split K counts after a barrier;
    launched with PDL, the first step's words are requested before the wait and nothing is stored before it."""
    pointers = {name: f"*{dtype}" for name in ("x", "scale", "bias", "out")}
    pointers |= {"w": "*i32", "zero": "*u8", "workspace": "*fp32", "counters": "*i32"}
    constexprs = dict(GROUP_SIZE=128, HAS_BIAS=True, SPLIT_K=split_k, TILES=tiles, WARPS=warps, FP16=dtype == "fp16")
    constexprs |= dict(USE_ASM=use_asm, PDL=pdl, INTERPRETED=False)
    options = dict(num_warps=warps, num_stages=1) | (dict(launch_pdl=True) if pdl else {})
    ptx = compile_for_sm90(int4_mma.int4_mma_kernel, pointers, constexprs, **options).asm["ptx"]
    assert ("mma.sync.aligned.m16n8k16" in ptx) == use_asm
    if split_k > 1:
        assert_counts_after_barrier(ptx)
    if pdl:
        assert_loads_weights_first(ptx, "ld.global.nc")
    print("compiled the tensor-core int4 GEMV", dtype, f"split {split_k} tiles {tiles} warps {warps}", flush=True)


def int4_gemm_kernel(dtype: str, tiles: int4_gemm.GemmTiles) -> None:
    """The many-row W4A16 kernel: its dequantized weight tile must reach wgmma as the register operand A (a list of
    registers, where a shared-memory operand is a descriptor), else the tile makes a round trip through memory."""
    pointers = {name: f"*{dtype}" for name in ("x", "scale", "bias", "out")} | {"w": "*u8", "zero": "*u8"}
    pointers |= {"workspace": "*fp32", "counters": "*i32"}
    constexprs = dict(GROUP_SIZE=128, HAS_BIAS=True, FP16=dtype == "fp16", UPCAST=False)
    constexprs |= dict(SPLIT_K=tiles.split_k, INTERPRETED=False)
    constexprs |= dict(BLOCK_N=tiles.block_n, BLOCK_M=tiles.block_m, BLOCK_K=tiles.block_k)
    options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    ptx = compile_for_sm90(int4_gemm._int4_gemm_kernel, pointers, constexprs, **options).asm["ptx"]
    mmas = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert mmas and all(re.search(r"\}, \{%r\d+(,%r\d+)*\}, %rd\d+", line) for line in mmas), mmas[:1]
    if tiles.split_k > 1:
        assert_counts_after_barrier(ptx)
    print("compiled the int4 GEMM", dtype, tiles, flush=True)


def assert_waits_first(ptx: str, wait: bool) -> None:
    """Launched with PDL (wait), a small kernel waits for the kernels before it ahead of any global load or store."""
    if not wait:
        assert "griddepcontrol.wait" not in ptx
        return
    first_access = min(ptx.index(op) for op in ("ld.global", "st.global") if op in ptx)
    assert ptx.index("griddepcontrol.wait") < first_access, "PDL: a global access before the wait"


def small_kernels_with_pdl() -> None:
    """RoPE, the KV store, the two in one launch (into a bf16 and an FP8 cache) and decode attention's split
    (merging its splits itself or not) and merge, launched with PDL (pdl.SMALL_KERNELS): each waits for the
    kernels before it ahead of any global access. (One `compiled` line: test_quant_kernels.py counts them.)"""
    wait = dict(RELEASE=True, WAIT=True)
    rotary = dict(HALF=64, HALF_P=64, BLOCK_H=4, ROUND_BF16=False) | wait
    kernels = [(fused_ops._rotary_kernel, {"x": "*bf16", "cos": "*bf16", "sin": "*bf16"}, rotary, 4)]
    store = dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, QUANTIZE=False) | wait
    pointers = {"k": "*bf16", "v": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "slot_mapping": "*i64"}
    pointers |= {"k_inv_scale": "fp32", "v_inv_scale": "fp32"}
    kernels.append((kv_store._store_kv_kernel, pointers, store, 1))
    pointers = pointers | {"q": "*bf16", "cos": "*bf16", "sin": "*bf16"}
    rotate_store = dict(HALF=64, HALF_P=64, BLOCK_H=16, QUANTIZE=False, ROUND_BF16=False) | wait
    kernels.append((kv_store._rotate_store_kv_kernel, pointers, rotate_store, 4))
    fp8_caches = {"k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv"}
    kernels.append((kv_store._rotate_store_kv_kernel, pointers | fp8_caches, rotate_store | dict(QUANTIZE=True), 4))
    split = dict(GROUP=4, GROUP_P=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=16)
    split |= dict(WINDOWED=False, SOFTCAP=False, UPCAST=False, IEEE=False, FP16_TILES=False, MERGE_HERE=False) | wait
    merging = dict(MERGE_HERE=True)
    pointers = {n: "*bf16" for n in ("q", "k_cache", "v_cache", "out")} | {"block_tables": "*i32", "seq_lens": "*i32"}
    pointers |= {"part_out": "*fp32", "part_lse": "*fp32"}
    pointers |= {n: "fp32" for n in ("scale_log2", "v_scale", "cap_log2", "scale_over_cap")}
    kernels.append((decode_kernels._decode_split_kernel, pointers, split, 4))
    kernels.append((decode_kernels._decode_split_kernel, pointers | {"arrivals": "*i32"}, split | merging, 4))
    merge = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, NUM_SPLITS=16, SPLITS_P=16, WINDOWED=False) | wait
    partials = {"part_out": "*fp32", "part_lse": "*fp32", "out": "*bf16", "seq_lens": "*i32"}
    kernels.append((decode_kernels._decode_merge_kernel, partials, merge, 4))
    for kernel, pointers, constexprs, warps in kernels:
        ptx = compile_for_sm90(kernel, pointers, constexprs, num_warps=warps, launch_pdl=True).asm["ptx"]
        assert_waits_first(ptx, True)
        if constexprs.get("MERGE_HERE"):  # the splits' counter: after every thread's fence and a barrier
            assert_counts_after_barrier(ptx)
            assert "ld.global.cg" in ptx[ptx.index("atom.global.gpu.acq_rel") :], "the merge reads partials via L1"
    print("compiled RoPE, the KV store, both in one and decode attention (two merges) launched with PDL", flush=True)


def fp8_matmul() -> None:
    pointers = {"a": "*fp8e4nv", "b": "*fp8e4nv", "a_scale": "*fp32", "b_scale": "*fp32", "bias": "*bf16"}
    constexprs = dict(HAS_BIAS=True, IEEE=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8)
    compile_for_sm90(fp8_matmul_kernel._fp8_matmul_kernel, pointers | {"out": "*bf16"}, constexprs, num_warps=4)
    print("compiled the FP8 matmul", flush=True)


def activation_quantizer(static: bool) -> None:
    pointers = {"x": "*bf16", "out": "*fp8e4nv", "scales": "*fp32", "static_scale": "*fp32"}
    for one_block in (False, True):
        constexprs = dict(STATIC=static, BLOCK=4096, ONE_BLOCK=one_block)
        compile_for_sm90(fp8_kernel._quantize_rows_kernel, pointers, constexprs, num_warps=4)
    print("compiled the activation quantizer, static", static, flush=True)


def fp8_rows() -> None:
    """The fused norm and SiLU writing FP8 rows, through fp8_kernel's shared rounding helpers."""
    norm = {n: "*bf16" for n in ("x", "residual", "weight", "out", "sum_out")}
    norm |= {"fp8_out": "*fp8e4nv", "fp8_scales": "*fp32", "eps": "fp32", "row_scales": "*fp32", "col_scales": "*fp32"}
    constexprs = dict(HAS_RESIDUAL=True, FP8_ROWS=True, SCALED=False, BLOCK=4096, ROUND_BF16=False)
    for release, wait in ((True, False), (True, True)):  # launched with PDL (pdl.SMALL_KERNELS) or not
        constexprs |= dict(RELEASE=release, WAIT=wait)
        options = dict(num_warps=8) | (dict(launch_pdl=True) if wait else {})
        ptx = compile_for_sm90(fused_ops._rms_norm_kernel, norm, constexprs, **options).asm["ptx"]
        assert_waits_first(ptx, wait)
    silu = {"gate_up": "*bf16", "out": "*bf16", "fp8_out": "*fp8e4nv", "fp8_scales": "*fp32"}
    compile_for_sm90(fused_ops._silu_and_mul_fp8_kernel, silu, dict(BLOCK=1024, ROUND_BF16=False), num_warps=8)
    silu = {"gate_up": "*bf16", "out": "*bf16", "block_amax": "*fp32"}
    for runs in (0, 4):  # halves, or gate_up_runs.py's runs
        constexprs = dict(BLOCK=1024, ROUND_BF16=False, AMAX=not runs, RUNS=runs, RELEASE=True, WAIT=True)
        kernel = fused_ops._silu_and_mul_kernel
        assert_waits_first(compile_for_sm90(kernel, silu, constexprs, num_warps=4, launch_pdl=True).asm["ptx"], True)
    blocks = {"x": "*bf16", "block_amax": "*fp32", "fp8_out": "*fp8e4nv", "fp8_scales": "*fp32"}
    compile_for_sm90(fused_ops._fp8_blocks_kernel, blocks, dict(BLOCK=2048, BLOCKS=16), num_warps=4)
    print("compiled the norm and SiLU with FP8 rows", flush=True)


def deferred_scales_norm() -> None:
    """The fused norm scaling an unscaled fp32 FP8 product (quant/kernels.fp8_linear's defer_scales) first."""
    norm = {n: "*bf16" for n in ("residual", "weight", "out", "sum_out")} | {"x": "*fp32", "eps": "fp32"}
    norm |= {"fp8_out": "*fp8e4nv", "fp8_scales": "*fp32", "row_scales": "*fp32", "col_scales": "*fp32"}
    constexprs = dict(HAS_RESIDUAL=True, FP8_ROWS=True, SCALED=True, BLOCK=4096, ROUND_BF16=False)
    constexprs |= dict(RELEASE=False, WAIT=False)
    compile_for_sm90(fused_ops._rms_norm_kernel, norm, constexprs, num_warps=8)
    print("compiled the norm applying deferred FP8 scales", flush=True)


if __name__ == "__main__":
    for case in WEIGHT_ONLY:
        weight_only(*case)
    for static in (False, True):
        activation_quantizer(static)
    for dtype, split_k, use_asm, use_dot, words in (
        ("bf16", 1, True, True, False),
        ("fp16", 4, True, False, False),
        ("bf16", 2, False, True, False),
        ("bf16", 16, True, False, True),
        ("fp16", 1, False, False, True),
    ):
        int4_decode_kernel(dtype, split_k, use_asm, use_dot, words)
    for x_vector in (False, True):  # four groups a K step
        int4_decode_kernel("bf16", 2, True, False, words=True, block_n=16, block_k=512, x_vector=x_vector)
    for prefetch in (False, True):  # launched with PDL: the first step's words read before the wait
        int4_decode_kernel("bf16", 1, True, False, words=True, block_n=16, block_k=1024, pdl=True, prefetch=prefetch)
    for dtype, split_k, prefetch in (("bf16", 1, True), ("fp16", 2, False)):  # the lane GEMV (4 warps)
        lane = dict(words=True, block_n=8, block_k=4096, pdl=True, prefetch=prefetch, lanes=True)
        int4_decode_kernel(dtype, split_k, True, False, **lane)
    for fold_in, fold_out in ((True, False), (False, True)):  # a folded norm's reader and producer (norm_fold.py)
        lane = dict(words=True, block_n=4, block_k=2048, pdl=True, prefetch=True, lanes=True)
        int4_decode_kernel("bf16", 1, True, False, **lane, fold_in=fold_in, fold_out=fold_out)
    lane = dict(words=True, block_n=8, block_k=2048, pdl=True, prefetch=True, lanes=True)
    int4_decode_kernel("bf16", 1, True, False, **lane, fold_in=True, gated=True)  # gate_up applying the SiLU
    for kv_cache in ("bf16", "fp8e4nv"):  # qkv rotating and storing keys and values (qkv_rotary.py)
        int4_decode_kernel("bf16", 1, True, False, **lane, fold_in=True, kv_cache=kv_cache)
    for dtype, split_k, tiles, warps, use_asm, pdl in (
        ("bf16", 4, 2, 2, True, True),
        ("fp16", 1, 1, 1, True, False),
        ("bf16", 2, 2, 1, False, False),
    ):
        int4_mma_kernel(dtype, split_k, tiles, warps, use_asm, pdl)
    for dtype, split_k in (("bf16", 1), ("fp16", 4)):
        int4_gemm_kernel(dtype, replace(int4_gemm.tiles_for(128, 128), split_k=split_k))
    fp8_matmul()
    fp8_rows()
    deferred_scales_norm()
    small_kernels_with_pdl()
