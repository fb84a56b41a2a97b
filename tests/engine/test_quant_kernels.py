"""The quantized matmuls (quant/kernels.py) against dequantize-then-matmul on random inputs: the Triton W4A16 and
W8A16 kernels in each program shape (GEMV, tl.dot, split-K) and the dequantize kernel, at odd M, N past a block,
group sizes 32 / 64 / 128 and per channel, zero points other than 8, with and without bias; the FP8 activation
quantizer on CPU and torch._scaled_mm on CUDA only. The kernels run on TRITONLLM_TEST_DEVICE: compiled on CUDA,
in Triton's interpreter on CPU (tiny shapes: it is slow)."""

import itertools
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tritonllm.engine.embedded import gpu_fence
from tritonllm.engine.embedded.quant import fp8_kernel, int4_words, kernels
from tritonllm.engine.embedded.quant import fp8_matmul_kernel as fp8_mm
from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode
from tritonllm.engine.embedded.quant import weight_only_kernel as wo
from tritonllm.engine.embedded.quant.formats import dequantize_int4, dequantize_int8, pack_int4
from tritonllm.engine.embedded.quant.linear import QuantLinear
from tritonllm.engine.embedded.quant.weight_only_kernel import Variant

DEVICE = torch.device(os.environ.get("TRITONLLM_TEST_DEVICE", "cpu"))
CUDA = DEVICE.type == "cuda"
ON_H100 = CUDA and "H100" in torch.cuda.get_device_name(DEVICE)
cuda_only = pytest.mark.skipif(
    not CUDA, reason="torch._scaled_mm and the compiled kernels need TRITONLLM_TEST_DEVICE=cuda"
)

if not CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(wo._weight_only_matmul_kernel, InterpretedFunction):
        pytest.skip("the Triton kernels were compiled without TRITON_INTERPRET=1", allow_module_level=True)


# ---- the reference: quant/formats.py's dequantizers (tested on their own in test_quant_formats.py) ----


def reference(x, dense_weight, bias):
    """The product in fp32 of x and the weight as dequantized into x's dtype."""
    return F.linear(x.float(), dense_weight.float(), None if bias is None else bias.float())


# ---- random quantized weights ----


def random_int4(n, k, group_size, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    scale = (torch.rand(n, k // group_size, generator=generator) * 0.02 + 0.005).to(dtype)
    zero = torch.randint(0, 16, (n, k // group_size), generator=generator, dtype=torch.uint8)
    assert (zero != 8).any()
    return pack_int4(values).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)


def random_int8(n, k, group_size, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    scale = (torch.rand(n, k // group_size, generator=generator) * 0.002 + 0.0005).to(dtype)
    return weight.to(DEVICE), scale.to(DEVICE)


def random_x(m, k, dtype=torch.float32, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def random_bias(n, dtype=torch.float32, seed=2):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


GEMV = Variant(block_m=4, block_n=16, block_k=64, use_dot=False)  # groups of 32: two a tile
GEMV_SPLIT = Variant(block_m=1, block_n=32, block_k=32, split_k=3, use_dot=False)
DOT = Variant(block_m=16, block_n=32, block_k=32)
DOT_SPLIT = Variant(block_m=16, block_n=16, block_k=64, split_k=2)  # two groups of 32 a tile
DOT_SMALL_K = Variant(block_m=16, block_n=16, block_k=16)  # a group spans several tiles


# ---- W4A16 ----


@pytest.mark.parametrize(
    "m, n, k, group_size, variant, with_bias",
    [
        (1, 40, 128, 128, GEMV_SPLIT, True),
        (3, 40, 128, 32, GEMV, False),
        (5, 24, 192, 64, GEMV, True),
        (1, 40, 96, 96, DOT, False),  # per channel
        (2, 40, 96, 96, GEMV, True),  # per channel, groups and tiles not nested: a scale gathered a weight
        (7, 40, 128, 32, DOT_SPLIT, True),
        (17, 48, 128, 64, DOT, True),
        (19, 24, 96, 32, DOT_SMALL_K, False),
        (2, 40, 160, 32, DOT_SMALL_K, True),  # K not a multiple of the split slices
    ],
)
def test_int4_kernel_equals_dequantize_then_matmul(m, n, k, group_size, variant, with_bias):
    qweight, scale, zero = random_int4(n, k, group_size)
    x, bias = random_x(m, k), random_bias(n) if with_bias else None
    expected = reference(x, dequantize_int4(qweight, scale, zero, group_size), bias)
    got = wo.weight_only_matmul(x, qweight, scale, zero, bias, group_size, 4, variant)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# The decode kernel (int4_decode_kernel.py): magic-number nibbles, even and odd columns apart, zero and scale
# once a group; split K reduced inside the launch. The interpreter runs its arithmetic path (no PTX), CUDA the asm.
DECODE = int4_decode.DecodeVariant(block_n=16, block_k=64)
DECODE_SPLIT = int4_decode.DecodeVariant(block_n=16, block_k=32, split_k=3)  # K = 160: slices of 64, 64, 32
DECODE_WIDE = int4_decode.DecodeVariant(block_n=32, block_k=128, split_k=2)
DECODE_GEMV = int4_decode.DecodeVariant(block_m=1, block_n=16, block_k=64, use_dot=False)
DECODE_GEMV_SPLIT = int4_decode.DecodeVariant(block_m=4, block_n=16, block_k=32, split_k=3, use_dot=False)
DECODE_PREFETCH = int4_decode.DecodeVariant(block_m=1, block_n=16, block_k=32, split_k=2, use_dot=False, prefetch=True)
DECODE_WORDS = int4_decode.DecodeVariant(block_m=1, block_n=16, block_k=64, use_dot=False, words=True)
DECODE_WORDS_SPLIT = int4_decode.DecodeVariant(block_m=1, block_n=16, block_k=32, split_k=3, use_dot=False, words=True)
# K steps of several scale groups, eight columns a program: 3 K tiles in slices of 2 and 1
DECODE_WORDS_GROUPS = int4_decode.DecodeVariant(
    block_m=1, block_n=8, block_k=128, split_k=2, num_warps=2, use_dot=False, words=True
)
DECODE_WORDS_X_VECTOR = replace(DECODE_WORDS_GROUPS, x_vector=True)  # x read as one vector a step
# Each lane's sums apart until the end (int4_lanes.py): 1,024 columns a warp a step
DECODE_LANES = int4_decode.DecodeVariant(
    block_m=1, block_n=4, block_k=1024, num_warps=1, use_dot=False, words=True, lanes=True, prefetch=True
)
DECODE_LANES_SPLIT = replace(DECODE_LANES, block_n=8, block_k=2048, num_warps=2, split_k=2, prefetch=False)
# On tensor cores (int4_mma.py): 16 or 32 rows a warp, 128 columns a step; here its interpreter path
DECODE_MMA = kernels.mma_gemv(1, 1, pdl=False)
DECODE_MMA_SPLIT = kernels.mma_gemv(2, 2, split_k=3)


def skip_where_cuda_refuses(x, group_size, variant):
    """The tensor-core GEMV takes 16-bit x only (int4_decode.supports; kernels.py never gives it fp32 x): on CUDA
    these fp32 products skip it (test_int4_gemv_on_tensor_cores_on_cuda runs it in bf16 and fp16)."""
    if CUDA and not int4_decode.supports(x.dtype, group_size, variant):
        pytest.skip(f"int4_decode.supports refuses {x.dtype} x for {variant}")


@pytest.mark.parametrize(
    "m, n, k, group_size, variant, with_bias",
    [
        (1, 40, 128, 64, DECODE, True),  # 40 columns: a partial column block
        (3, 48, 160, 32, DECODE_SPLIT, False),
        (1, 24, 160, 32, DECODE_SPLIT, True),
        (16, 64, 256, 128, DECODE_WIDE, True),
        (20, 16, 256, 256, DECODE_WIDE, False),  # two row blocks: past SPLIT_ROWS, so no split
        (1, 40, 128, 64, DECODE_GEMV, True),
        (3, 48, 160, 32, DECODE_GEMV_SPLIT, True),  # rows past M in the row block
        (6, 24, 160, 32, DECODE_GEMV_SPLIT, False),  # two row blocks, split
        (1, 40, 160, 32, DECODE_PREFETCH, True),  # slices of 3 and 2 steps: the prefetch past a slice is masked
        (1, 40, 128, 64, DECODE_WORDS, True),
        (1, 24, 160, 32, DECODE_WORDS_SPLIT, False),
        (1, 20, 384, 32, DECODE_WORDS_GROUPS, True),  # four groups a step, 20 columns: a partial block of 8
        (1, 40, 256, 64, DECODE_WORDS_GROUPS, False),
        (1, 20, 384, 32, DECODE_WORDS_X_VECTOR, True),
        (1, 24, 160, 32, replace(DECODE_WORDS_SPLIT, x_vector=True), False),  # a step past K: masked
        (1, 6, 3072, 128, DECODE_LANES, True),  # three steps, the prefetch past the last one masked; 6 of 8 rows
        (1, 8, 1536, 32, DECODE_LANES, False),  # K not a whole step: a masked half step
        (1, 20, 4096, 64, DECODE_LANES_SPLIT, True),  # two slices of a step, a partial block of 8
        (1, 16, 2560, 128, DECODE_LANES_SPLIT, False),  # slices of a step and a quarter step
        (1, 16, 256, 128, DECODE_MMA, True),
        (1, 20, 384, 384, DECODE_MMA, False),  # per channel, a partial tile of 16 rows
        (1, 72, 640, 128, DECODE_MMA_SPLIT, True),  # slices of 2, 2 and 1 steps, a partial second program
        (1, 40, 256, 256, DECODE_MMA_SPLIT, False),  # two slices of one step
    ],
)
def test_int4_decode_kernel_equals_dequantize_then_matmul(m, n, k, group_size, variant, with_bias):
    qweight, scale, zero = random_int4(n, k, group_size)
    x, bias = random_x(m, k), random_bias(n) if with_bias else None
    skip_where_cuda_refuses(x, group_size, variant)
    expected = reference(x, dequantize_int4(qweight, scale, zero, group_size), bias)
    # The word GEMV's fp32 sums hold 128 times x (16 x for odd nibbles) and take it out again: a few units of
    # 2^-24 of 128 * 16 * sum |x| a group, ~1e-4 here, growing with K (~5e-4 at K = 2,560, both word GEMVs).
    atol = max(2e-4, 3e-4 * k / 1024) if variant.words else 1e-4
    for _ in range(2):  # the second launch finds the split workspace and counters zeroed by the first
        got = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, group_size, variant)
        torch.testing.assert_close(got, expected, atol=atol, rtol=1e-4)
    key = (x.device, int4_decode.SPLIT_ROWS, n)
    workspace, counters = gpu_fence._buffers.get(key, (torch.zeros(1), torch.zeros(1)))
    assert not workspace.any() and not counters.any()


def group_major(scale, zero):
    """Scales and zero points stored [groups, N], viewed as [N, groups] (QuantLinear's int4 layout)."""
    by_group = scale.t().contiguous().t(), zero.t().contiguous().t()
    assert by_group[0].stride() == (1, scale.shape[0]) and torch.equal(by_group[1], zero)
    return by_group


@pytest.mark.parametrize(
    "m, n, k, group_size, variant",
    [
        (3, 48, 160, 32, DECODE_SPLIT),
        (3, 48, 160, 32, DECODE_GEMV_SPLIT),
        (1, 16, 4096, 64, DECODE_LANES_SPLIT),  # whole blocks of 8 rows: their scales read as one vector
        (1, 20, 4096, 64, DECODE_LANES_SPLIT),  # a partial block: rows past N clamped
        (1, 20, 384, 32, DECODE_WORDS_GROUPS),
        (1, 72, 640, 128, DECODE_MMA_SPLIT),
    ],
)
def test_int4_decode_kernel_reads_group_major_scales_and_zeros(m, n, k, group_size, variant):
    """The same product from group-major scales and zeros as from row-major ones, in each GEMV."""
    qweight, scale, zero = random_int4(n, k, group_size)
    x = random_x(m, k)
    skip_where_cuda_refuses(x, group_size, variant)
    expected = int4_decode.int4_decode_matmul(x, qweight, scale, zero, None, group_size, variant)
    got = int4_decode.int4_decode_matmul(x, qweight, *group_major(scale, zero), None, group_size, variant)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["dequantize", "tiled", "int4_gemm"])
def test_the_weight_only_paths_read_group_major_scales_and_zeros(strategy, monkeypatch):
    """int4_linear's other paths (the general kernel at 2 rows, the large-M strategy at 24) and the dequantize
    kernel with QuantLinear's layout: the products and weight of row-major scales and zeros."""
    monkeypatch.setattr(kernels, "LARGE_M_STRATEGY", strategy)
    qweight, scale, zero = random_int4(40, 128, 32)
    by_group = group_major(scale, zero)
    for m in (2, 24):
        x = random_x(m, 128)
        expected = kernels.weight_only_triton(x, qweight, scale, zero, None, 32, bits=4)
        got = kernels.weight_only_triton(x, qweight, *by_group, None, 32, bits=4)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for block_k in (32, 64, 16):  # one group a tile, two, and a group across tiles
        expected = wo.dequantize(qweight, scale, zero, 32, 4, torch.float32, block_n=16, block_k=block_k)
        got = wo.dequantize(qweight, *by_group, 32, 4, torch.float32, block_n=16, block_k=block_k)
        assert torch.equal(got, expected)


def test_quant_linear_stores_int4_scales_and_zeros_group_major():
    """QuantLinear's layout, and its one-row product (a lane GEMV on CUDA) the same as with row-major copies."""
    layer = QuantLinear(2048, 48, bias=False, kind="int4", group_size=64, static_input=False)
    layer.allocate(torch.bfloat16, DEVICE)
    assert layer.weight_scale.shape == layer.weight_zero.shape == (48, 32)
    assert layer.weight_scale.stride() == layer.weight_zero.stride() == (1, 48)
    assert (layer.weight_zero == 8).all()
    dense = torch.randn(48, 2048, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    layer.store_rows(0, dense.to(torch.bfloat16))
    x = random_x(1, 2048, torch.bfloat16)
    qweight, scale, zero = layer.qweight, layer.weight_scale, layer.weight_zero
    row_major = kernels.int4_linear(x, qweight, scale.contiguous(), zero.contiguous(), None, 64)
    torch.testing.assert_close(layer(x), row_major)
    # the reference's weight rounded to bf16 (the kernel's is not) moves outputs of ~45 by ~0.1 at this K
    expected = reference(x, dequantize_int4(qweight, scale, zero, 64), None).to(torch.bfloat16)
    torch.testing.assert_close(layer(x), expected, atol=0.25, rtol=2e-2)


def test_int4_decode_kernel_splits_only_what_its_counters_cover(monkeypatch):
    """More output tiles than the workspace has counters: one slice, not counters written past their end."""
    monkeypatch.setattr(int4_decode, "_MAX_TILES", 2)
    monkeypatch.setattr(gpu_fence, "_buffers", {})
    qweight, scale, zero = random_int4(48, 128, 64)
    x = random_x(1, 128)
    got = int4_decode.int4_decode_matmul(x, qweight, scale, zero, None, 64, DECODE_PREFETCH)  # 3 tiles, split 2
    torch.testing.assert_close(got, reference(x, dequantize_int4(qweight, scale, zero, 64), None), atol=1e-4, rtol=1e-4)
    assert (x.device, int4_decode.SPLIT_ROWS, 48) not in gpu_fence._buffers


def test_int4_decode_kernel_needs_groups_its_steps_fit_in():
    assert int4_decode.supports(torch.bfloat16, 128, DECODE_WIDE)
    assert not int4_decode.supports(torch.bfloat16, 64, DECODE_WIDE)
    assert not int4_decode.supports(torch.int8, 128, DECODE_WIDE)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        int4_decode.DecodeVariant(block_n=8)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        int4_decode.DecodeVariant(block_m=4)
    assert int4_decode.DecodeVariant(block_m=1, use_dot=False).block_m == 1


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_asm", [True, False])
def test_int4_word_gemv_on_cuda(dtype, use_asm):
    """The one-row GEMV over int32 words: its PTX (two shifts, a PRMT and eight LOP3s a word) and the arithmetic
    path give the product of the dequantized weight, split K launched again and again; the next step's words
    prefetched, registers capped and launched with PDL (pdl.py) or not."""
    qweight, scale, zero = random_int4(4096, 1024, 128, dtype=dtype)
    x, bias = random_x(1, 1024, dtype), random_bias(4096, dtype)
    expected = reference(x, dequantize_int4(qweight, scale, zero, 128), bias)
    shapes = ((128, 128, 1, 1), (64, 64, 4, 2), (256, 128, 8, 4), (16, 1024, 1, 4), (8, 512, 2, 1), (32, 256, 4, 2))
    options = ((False, False, 0, False), (True, False, 0, True), (False, True, 96, True), (True, True, 64, False))
    for (block_n, block_k, split, warps), (x_vector, prefetch, registers, pdl) in itertools.product(shapes, options):
        variant = int4_decode.DecodeVariant(
            block_m=1,
            block_n=block_n,
            block_k=block_k,
            split_k=split,
            num_warps=warps,
            num_stages=1,
            use_asm=use_asm,
            use_dot=False,
            words=True,
            x_vector=x_vector,
            prefetch=prefetch,
            max_registers=registers,
            pdl=pdl,
        )
        for _ in range(10):
            got = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, 128, variant)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_asm", [True, False])
def test_int4_word_gemv_with_lanes_on_cuda(dtype, use_asm):
    """The lane GEMV (int4_lanes.py): its PTX and arithmetic paths give the product of the dequantized weight,
    at 4 to 16 rows a program and 1 to 4 warps, split K, prefetched and launched with PDL or not, K a whole
    number of steps (4,096) or not (3,584), and again and again."""
    for k, shapes in ((4096, ((4, 1, 1), (8, 2, 2), (16, 1, 4), (8, 4, 1))), (3584, ((4, 2, 1), (4, 4, 3)))):
        qweight, scale, zero = random_int4(2048, k, 128, dtype=dtype)
        x, bias = random_x(1, k, dtype), random_bias(2048, dtype)
        # weights dequantized in fp32: rounded to 16 bits they alone move some products by ~0.05 at this K
        expected = reference(x, dequantize_int4(qweight, scale.float(), zero, 128), bias)
        for (rows, warps, split), (prefetch, pdl) in itertools.product(shapes, ((False, False), (True, True))):
            variant = kernels.lane_gemv(rows, warps, split_k=split, prefetch=prefetch, pdl=pdl)
            variant = replace(variant, use_asm=use_asm)
            for _ in range(5):
                got = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, 128, variant)
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@cuda_only
@pytest.mark.parametrize("dtype, use_asm", [(torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)])
def test_int4_gemv_on_tensor_cores_on_cuda(dtype, use_asm):
    """The tensor-core GEMV (int4_mma.py): its PTX (each thread's own rows into mma.sync, whatever layout Triton
    gave its values) and its arithmetic path give the product of the dequantized weight, at 1 or 2 tiles a warp
    and 1 to 4 warps, K split or not, N not a whole program, groups of 128 and per channel, registers capped or
    not, launched with PDL or not, and again and again."""
    for n, k, group in ((2048, 4096, 128), (1000, 1536, 128), (520, 1024, 1024)):
        qweight, scale, zero = random_int4(n, k, group, dtype=dtype)
        x, bias = random_x(1, k, dtype), random_bias(n, dtype)
        # weights dequantized in fp32: rounded to 16 bits they alone move some products by ~0.05 at this K
        expected = reference(x, dequantize_int4(qweight, scale.float(), zero, group), bias)
        shapes = ((1, 1, 1), (2, 1, 4), (1, 4, 3), (2, 2, 8))
        for (tiles, warps, split), (pdl, registers) in itertools.product(shapes, ((False, 0), (True, 168))):
            variant = kernels.mma_gemv(tiles, warps, split_k=split, pdl=pdl)
            variant = replace(variant, use_asm=use_asm, max_registers=registers)
            for _ in range(5):
                got = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, group, variant)
                assert got.dtype == dtype
                torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@cuda_only
@pytest.mark.parametrize("prefetch, mma", [(False, False), (True, False), (True, True)])
def test_a_word_gemv_launched_with_pdl_reads_what_the_norm_before_it_wrote(prefetch, mma):
    """In a CUDA graph, the norm releases its dependents at once and the GEMV (PDL) reads its weights before
    waiting: every replay on new inputs must give exactly what the same GEMV launched without PDL gives on the
    norm's new output, and so must a second GEMV (PDL) right after the first. (Against a dense reference, the
    bf16-rounded weights alone differ by ~0.1 at K = 4,096: too coarse to see a GEMV that read some stale x.)"""
    from tritonllm.engine.embedded.network.fused_ops import rms_norm

    bf16 = torch.bfloat16
    first_w = random_int4(4096, 1024, 128, dtype=bf16)
    second_w = random_int4(1024, 4096, 128, dtype=bf16, seed=5)
    shape = dict(block_m=1, block_n=16, block_k=512, num_warps=4, num_stages=1, use_dot=False, words=True)
    with_pdl, without = (int4_decode.DecodeVariant(**shape, prefetch=prefetch, pdl=pdl) for pdl in (True, False))
    if mma:  # the tensor-core GEMV (int4_mma.py), its words and x asked for two steps ahead
        with_pdl, without = (kernels.mma_gemv(2, 2, split_k=4, pdl=pdl) for pdl in (True, False))
    hidden, norm_weight = random_x(1, 1024, bf16), torch.rand(1024, device=DEVICE, dtype=bf16) + 0.5

    def gemv(x, weight, variant):
        return int4_decode.int4_decode_matmul(x, *weight, None, 128, variant)

    def chain():
        normed = rms_norm(hidden, norm_weight, 1e-5)
        first = gemv(normed, first_w, with_pdl)
        return normed, first, gemv(first, second_w, with_pdl)

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, first, second = chain()
    # split K's slices add into fp32 by atomics in any order: a bf16 product may then differ in its last bit
    rtol = 2**-7 if with_pdl.split_k > 1 else 0
    for seed in range(20):
        hidden.copy_(random_x(1, 1024, bf16, seed=seed + 10))
        graph.replay()
        torch.testing.assert_close(normed, rms_norm(hidden, norm_weight, 1e-5), atol=0, rtol=0)
        torch.testing.assert_close(first, gemv(normed, first_w, without), atol=0, rtol=rtol)
        torch.testing.assert_close(second, gemv(first, second_w, without), atol=0, rtol=rtol)


def test_the_word_gemv_reads_bytes_that_do_not_start_on_a_word():
    """Packed bytes one byte into their storage cannot be viewed as int32: the byte GEMV takes the call."""
    qweight, scale, zero = random_int4(24, 128, 64)
    shifted = torch.empty(qweight.numel() + 1, dtype=torch.uint8, device=qweight.device)[1:].view(qweight.shape)
    shifted.copy_(qweight)
    assert not int4_words.int32_viewable(shifted) and int4_words.int32_viewable(qweight)
    x = random_x(1, 128)
    expected = reference(x, dequantize_int4(qweight, scale, zero, 64), None)
    for variant in (DECODE_WORDS, DECODE_WORDS_GROUPS):  # the byte GEMV's steps stay inside a group of 64
        got = int4_decode.int4_decode_matmul(x, shifted, scale, zero, None, 64, variant)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_tensor_core_gemv_hands_what_it_cannot_read_to_a_lane_gemv(monkeypatch):
    """int4_mma.py reads x and the weights' rows in 16-byte loads, one row of x: two rows, or x starting off 16
    bytes, go to a lane GEMV of the same warps (and get the same product)."""
    qweight, scale, zero = random_int4(40, 256, 128)
    x = random_x(2, 256)
    expected = reference(x, dequantize_int4(qweight, scale, zero, 128), None)
    calls = []
    monkeypatch.setattr(int4_decode, "_mma_gemv", lambda *args: calls.append(args))
    got = int4_decode.int4_decode_matmul(x, qweight, scale, zero, None, 128, kernels.mma_gemv(1, 2))
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    shifted = torch.empty(257, device=DEVICE)[1:].view(1, 256)  # 4 bytes past a 16-byte boundary
    shifted.copy_(x[:1])
    got = int4_decode.int4_decode_matmul(shifted, qweight, scale, zero, None, 128, kernels.mma_gemv(1, 2))
    torch.testing.assert_close(got, expected[:1], atol=2e-4, rtol=1e-4)
    assert not calls
    int4_decode.int4_decode_matmul(x[:1], qweight, scale, zero, None, 128, kernels.mma_gemv(1, 2))
    assert len(calls) == 1


def test_a_tensor_core_gemv_shape_is_checked():
    with pytest.raises(ValueError, match="mma reads 128 columns a step .* block_n 32 or 64 for 2 warps"):
        replace(kernels.mma_gemv(1, 2), block_n=128)
    with pytest.raises(ValueError, match="mma is the word GEMV's"):
        int4_decode.DecodeVariant(mma=True)
    assert not int4_decode.supports(torch.bfloat16, 64, kernels.mma_gemv(1, 1))  # a step spans two groups
    assert not int4_decode.supports(torch.float32, 128, kernels.mma_gemv(1, 1))  # the mma's B is 16-bit
    assert int4_decode.supports(torch.float16, 256, kernels.mma_gemv(2, 1))


def test_the_word_gemv_is_the_one_row_gemv(monkeypatch):
    with pytest.raises(ValueError, match="words is the one-row GEMV"):
        int4_decode.DecodeVariant(block_m=16, words=True)
    assert kernels.choose_decode_variant(1, 4096, 14336).lanes  # Llama-3.1-8B's down_proj: the table's
    assert not kernels.choose_decode_variant(2, 4096, 14336).words
    # not in the table: a lane GEMV of 4 rows, split in two (224 programs, fewer than two an SM), or where its
    # lanes' 32 columns do not fit the groups, the byte GEMV
    assert kernels.choose_decode_variant(1, 896, 4864) == kernels.lane_gemv(4, 2, split_k=2)
    assert kernels.choose_decode_variant(1, 8192, 896) == kernels.lane_gemv(4, 1)
    assert not kernels.choose_decode_variant(1, 896, 4864, group_size=48).words
    monkeypatch.setitem(kernels.one_row_table(), (896, 4864), DECODE_WORDS_GROUPS)
    assert kernels.choose_decode_variant(1, 896, 4864) is DECODE_WORDS_GROUPS
    for (n, k), variant in (kernels.ONE_ROW_SHAPES | kernels.ONE_ROW_SHAPES_H100).items():  # each applies at 128
        assert int4_decode.supports(torch.bfloat16, 128, variant), (n, k, variant)
    assert kernels.one_row_table() is (kernels.ONE_ROW_SHAPES_H100 if ON_H100 else kernels.ONE_ROW_SHAPES)
    assert int4_decode.supports(torch.bfloat16, 32, DECODE_WORDS_GROUPS)  # whole groups a step: words only
    assert not int4_decode.supports(torch.bfloat16, 32, replace(DECODE_WORDS_GROUPS, words=False, block_n=16))
    assert not int4_decode.supports(torch.bfloat16, 96, DECODE_WORDS_GROUPS)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        int4_decode.DecodeVariant(block_m=1, block_n=8, use_dot=False)
    with pytest.raises(ValueError, match="x_vector is the word GEMV's"):
        int4_decode.DecodeVariant(block_m=1, use_dot=False, x_vector=True)
    with pytest.raises(ValueError, match="lanes reads 1,024 columns a warp a step: block_k 2048 for 2 warps"):
        replace(kernels.lane_gemv(4, 2), block_k=1024)
    assert not int4_decode.supports(torch.bfloat16, 16, kernels.lane_gemv(4, 1))  # a lane's 32 columns, 2 groups


def run_word_asm(word: int, asm: str) -> list[float]:
    """The word GEMV's PTX (_WORD_ASM, _WORD_ASM_2048) run instruction by instruction on one 32-bit word: its eight
    outputs as fp32."""
    import re
    import struct

    regs = {"$8": word}
    for line in asm.splitlines():
        match = re.match(r"\s*(shl\.b32|shr\.u32|prmt\.b32|lop3\.b32)\s+([$\w]+),\s*(.+);", line)
        if not match:
            continue
        op, dest, operands = match.group(1), match.group(2), [a.strip() for a in match.group(3).split(",")]
        value = [regs[a] if a in regs else int(a, 0) for a in operands]
        if op == "shl.b32":
            regs[dest] = (value[0] << value[1]) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[dest] = value[0] >> value[1]
        elif op == "prmt.b32":  # result byte i = byte (selector nibble i) of the eight bytes b:a
            pool = value[0] | (value[1] << 32)
            regs[dest] = sum(((pool >> (8 * ((value[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        else:
            assert value[3] == 0xEA  # (a & b) | c
            regs[dest] = (value[0] & value[1]) | value[2]
    return [struct.unpack("<f", struct.pack("<I", regs[f"${i}"]))[0] for i in range(8)]


@pytest.mark.parametrize("odd_2048", [False, True])
def test_the_word_gemvs_ptx_makes_the_values_of_its_arithmetic_path(odd_2048):
    """The PTX runs on CUDA only: here its instructions are replayed on every nibble in every position and must
    give what the interpreter's arithmetic (_word_value) gives: 128 + q, and for the odd nibbles 128 + q / 16
    (the word GEMV's) or 2048 + q (the lane GEMV's)."""
    asm = (int4_words._WORD_ASM_2048 if odd_2048 else int4_words._WORD_ASM).value
    for q in range(16):
        for position in range(8):
            for others in (0, 0x77777777, 0xFFFFFFFF):
                word = (others & ~(0xF << (4 * position))) | (q << (4 * position))
                got = run_word_asm(word, asm)[position]
                odd = 2048 + q if odd_2048 else 128 + q / 16
                assert got == (odd if position % 2 else 128 + q), (q, position, others)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_asm", [True, False])
@pytest.mark.parametrize("use_dot", [True, False])
def test_int4_decode_kernel_in_16_bits_on_cuda(dtype, use_asm, use_dot):
    """The magic numbers of each 16-bit type, through the PTX routine and the plain bit operations; split K
    launched again and again. 16 x 32 dot tiles on two warps give two threads some same elements: before the
    barrier between reading and zeroing the workspace, 8 rows of them came out with slices missing (an H200
    race check, 2026-12-02)."""
    qweight, scale, zero = random_int4(4096, 512, 128, dtype=dtype)
    x, bias = random_x(8, 512, dtype), random_bias(4096, dtype)
    expected = reference(x, dequantize_int4(qweight, scale, zero, 128), bias)
    for split, warps in ((1, 4), (2, 2), (4, 4)):
        variant = int4_decode.DecodeVariant(
            block_m=16 if use_dot else 1,
            block_n=32,
            block_k=128,
            split_k=split,
            num_warps=warps,
            use_asm=use_asm,
            use_dot=use_dot,
            prefetch=not use_dot,
        )
        for _ in range(20):
            got = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, 128, variant)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("variant", [GEMV, DOT_SPLIT])
def test_int4_kernel_in_bfloat16_is_close(variant):
    qweight, scale, zero = random_int4(40, 128, 32, dtype=torch.bfloat16)
    x, bias = random_x(3, 128, torch.bfloat16), random_bias(40, torch.bfloat16)
    expected = reference(x, dequantize_int4(qweight, scale, zero, 32), bias)
    got = wo.weight_only_matmul(x, qweight, scale, zero, bias, 32, 4, variant)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


# ---- W8A16 ----


@pytest.mark.parametrize(
    "m, n, k, group_size, variant, with_bias",
    [
        (1, 40, 128, 128, GEMV_SPLIT, True),
        (3, 24, 128, 64, GEMV, False),
        (9, 40, 96, 96, DOT_SPLIT, True),  # per channel
        (2, 24, 96, 96, DOT, False),
        (17, 40, 128, 32, DOT_SMALL_K, True),
        (4, 40, 128, 32, GEMV, True),
    ],
)
def test_int8_kernel_equals_dequantize_then_matmul(m, n, k, group_size, variant, with_bias):
    weight, scale = random_int8(n, k, group_size)
    x, bias = random_x(m, k), random_bias(n) if with_bias else None
    expected = reference(x, dequantize_int8(weight, scale, group_size), bias)
    got = wo.weight_only_matmul(x, weight, scale, None, bias, group_size, 8, variant)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


# ---- the dequantize kernel (the large-M path) and the public functions ----


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, 96), (4, 128), (8, 64)])
def test_the_dequantize_kernel_writes_the_reference_weight(bits, group_size):
    if bits == 4:
        qweight, scale, zero = random_int4(40, 384, group_size, dtype=torch.bfloat16)
        expected = dequantize_int4(qweight, scale, zero, group_size)
        got = wo.dequantize(qweight, scale, zero, group_size, 4, torch.bfloat16, block_n=16, block_k=64)
    else:
        weight, scale = random_int8(40, 384, group_size, dtype=torch.bfloat16)
        expected = dequantize_int8(weight, scale, group_size)
        got = wo.dequantize(weight, scale, None, group_size, 8, torch.bfloat16, block_n=16, block_k=64)
    assert got.dtype == torch.bfloat16
    if CUDA:
        assert torch.equal(got, expected)  # one rounding of an exact product, as the reference rounds
    else:  # the interpreter rounds to bfloat16 its own way: within one step
        torch.testing.assert_close(got, expected, atol=0, rtol=2**-7)


@pytest.mark.parametrize("strategy", ["dequantize", "tiled", "int4_gemm"])
@pytest.mark.parametrize("m", [1, 6, 23])
def test_int4_and_int8_linear_take_any_leading_shape(m, strategy, monkeypatch):
    """2 m rows: a GEMV (2), a 16-row dot split along K (12) and the large-M strategy (46) on the Triton path."""
    monkeypatch.setattr(kernels, "LARGE_M_STRATEGY", strategy)
    qweight, scale, zero = random_int4(40, 128, 64)
    weight, scale8 = random_int8(40, 128, 64)
    x, bias = random_x(m * 2, 128).reshape(2, m, 128), random_bias(40)
    expected4 = reference(x, dequantize_int4(qweight, scale, zero, 64), bias)
    expected8 = reference(x, dequantize_int8(weight, scale8, 64), None)
    for got4, got8 in (
        (kernels.int4_linear(x, qweight, scale, zero, bias, 64), kernels.int8_linear(x, weight, scale8, None, 64)),
        (  # the Triton path itself, on CPU too
            kernels.weight_only_triton(x, qweight, scale, zero, bias, 64, bits=4),
            kernels.weight_only_triton(x, weight, scale8, None, None, 64, bits=8),
        ),
    ):
        assert got4.shape == got8.shape == (2, m, 40)
        torch.testing.assert_close(got4, expected4, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got8, expected8, atol=1e-4, rtol=1e-4)


def test_no_rows_give_no_rows():
    qweight, scale, zero = random_int4(40, 64, 32)
    weight, scale8 = random_fp8(32, 64)
    empty = random_x(0, 64)
    assert wo.weight_only_matmul(empty, qweight, scale, zero, None, 32, 4, GEMV).shape == (0, 40)
    assert kernels.int4_linear(empty, qweight, scale, zero, None, 32).shape == (0, 40)
    assert kernels.fp8_linear(empty.reshape(0, 0, 64), weight, scale8, None).shape == (0, 0, 32)
    assert fp8_kernel.quantize_rows(empty)[0].shape == (0, 64)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 17, 64, 256, 2048])
def test_the_chosen_variants_are_valid_and_fill_the_gpu_at_decode(m):
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        variant = kernels.choose_variant(m, n, k)
        assert variant.block_m >= min(m, 16) or m > kernels.SMALL_M
        if m <= kernels.SMALL_M:
            assert -(-n // variant.block_n) * variant.split_k >= kernels.NUM_SMS


def test_bad_quantized_inputs_are_refused_by_name():
    qweight, scale, zero = random_int4(8, 64, 32)
    x = random_x(2, 64)
    with pytest.raises(ValueError, match="group_size must divide"):
        kernels.int4_linear(x, qweight, scale, zero, None, 48)
    with pytest.raises(ValueError, match="weight_scale must be \\[8, 2\\]"):
        kernels.int4_linear(x, qweight, scale[:, :1], zero, None, 32)
    with pytest.raises(ValueError, match="weight_zero must be uint8"):
        kernels.int4_linear(x, qweight, scale, zero.to(torch.int32), None, 32)
    with pytest.raises(ValueError, match="takes 64"):
        kernels.int4_linear(random_x(2, 32), qweight, scale, zero, None, 32)
    with pytest.raises(ValueError, match="int8 weight must be 2-D torch.int8"):
        kernels.int8_linear(x, qweight, scale, None, 32)
    with pytest.raises(ValueError, match="bias must be \\[8\\]"):
        kernels.int4_linear(x, qweight, scale, zero, random_bias(9), 32)
    with pytest.raises(ValueError, match="in x's dtype torch.float32, got torch.bfloat16"):
        kernels.int4_linear(x, qweight, scale, zero, random_bias(8, torch.bfloat16), 32)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        Variant(block_m=1, block_n=24, block_k=32, use_dot=False)


# ---- compiled for an H200 without one: what the interpreter does not check (constexpr globals, layouts, PTX) ----


def test_the_kernels_compile_for_sm90():
    """quant_sm90_compile.py runs Triton's whole pipeline down to a cubin (its bundled ptxas) for compute
    capability 9.0, in a process of its own: here the kernels are the interpreter's."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("quant_sm90_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("compiled") == 31, done.stdout


def test_the_sass_counter_compiles_the_one_row_kernel_as_calls_do():
    """ci/int4_sass.py (what GPU sessions read instruction and register counts from) keeps up with the kernel's
    arguments: it had failed unnoticed once the norm folds added some."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).parents[2] / "ci" / "int4_sass.py"
    command = [sys.executable, str(script), "--lanes", "4x1", "--epilogue", "gated"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"lanes 4x1 gated: \d+\.\d+ instructions a weight .*REG:\d+", done.stdout), done.stdout


# ---- FP8 ----


def random_fp8(n, k, seed=3):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, generator=generator) * 1e-3 + 1e-4
    return weight.to(DEVICE), scale.to(DEVICE)


def test_per_token_quantization_scales_each_rows_absmax_to_448():
    x = random_x(5, 64) * torch.tensor([1.0, 10.0, 0.01, 0.0, 3.0], device=DEVICE)[:, None]
    x_q, scale = kernels.quantize_per_token(x)
    assert x_q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1) and scale.dtype == torch.float32
    peaks = x_q.float().abs().amax(dim=1)
    assert torch.equal(peaks[[0, 1, 2, 4]], torch.full((4,), 448.0, device=DEVICE))
    assert not x_q[3].float().any() and torch.isfinite(scale).all() and (scale > 0).all()
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (the smallest ones within a subnormal step)
    error = (x_q.float() * scale - x).abs()
    assert (error <= x.abs() / 16 + scale * 2.0**-9).all()


def test_a_static_input_scale_is_used_on_every_row_and_clamps():
    x = torch.tensor([[1.0, -2.0, 1000.0], [0.5, 0.0, -1000.0]], device=DEVICE)
    x_q, scale = kernels.quantize_per_token(x, torch.tensor(0.5, device=DEVICE))
    assert torch.equal(scale, torch.full((2, 1), 0.5, device=DEVICE))
    assert x_q.float().tolist() == [[2.0, -4.0, 448.0], [1.0, 0.0, -448.0]]


@pytest.mark.parametrize("m, k, static", [(1, 48, False), (5, 300, False), (3, 5000, False), (4, 300, True)])
def test_the_triton_activation_quantizer_equals_the_torch_one(m, k, static):
    """k = 5000: two passes of 4096 columns; x in bf16 as a model would send it; one row all zeros."""
    x = (random_x(m, k) * 4).to(torch.bfloat16)
    x[0] = 0
    input_scale = torch.tensor(0.01, device=DEVICE) if static else None
    expected_q, expected_scale = kernels.quantize_per_token(x, input_scale)
    got_q, got_scale = fp8_kernel.quantize_rows(x, input_scale)
    assert got_q.dtype == torch.float8_e4m3fn and got_q.is_contiguous() and got_scale.shape == (m, 1)
    torch.testing.assert_close(got_scale, expected_scale, atol=0, rtol=1e-6)
    got, expected = got_q.float(), expected_q.float()
    if not CUDA:  # the interpreter's fp8 cast is not the hardware's: it drops the carry of a value rounded up to a
        # power of two (124.6 -> 64, not 128) and rounds ties away from zero; forgive exactly those
        dropped = (got * 2 == expected) & (torch.frexp(expected).mantissa.abs() == 0.5)
        quotient = (x.float() / expected_scale).clamp(-448, 448)
        tie = (quotient - (got + expected) / 2).abs() <= 1e-6 * quotient.abs()
        got = torch.where((got != expected) & (dropped | tie), expected, got)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "m, n, k, tiles",
    [(5, 40, 256, fp8_mm.Fp8Tiles(16, 32, 64, group_m=2)), (33, 64, 200, fp8_mm.Fp8Tiles(16, 16, 32, group_m=3))],
)
def test_the_triton_fp8_matmul_equals_the_scaled_product(m, n, k, tiles):
    """Row-wise scales on both sides and a bias; K = 200 leaves a partial K step, 33 rows a partial band."""
    if CUDA and not kernels.fp8_supported(DEVICE):
        pytest.skip("no FP8 tensor cores on this GPU")
    a_q, b_q = random_fp8(m, k, seed=4)[0], random_fp8(n, k, seed=5)[0]
    a_scale = torch.rand(m, 1, generator=torch.Generator().manual_seed(6)).to(DEVICE) * 1e-2
    b_scale = torch.rand(n, generator=torch.Generator().manual_seed(7)).to(DEVICE) * 1e-2
    bias = random_bias(n)
    expected = (a_q.float() @ b_q.float().T) * a_scale * b_scale[None, :] + bias
    out_dtype = torch.bfloat16 if CUDA else torch.float32
    got = fp8_mm.fp8_matmul(a_q, a_scale, b_q, b_scale, bias.to(out_dtype), out_dtype, tiles)
    assert got.shape == (m, n) and got.dtype == out_dtype
    torch.testing.assert_close(got.float(), expected, atol=2e-2 if CUDA else 1e-5, rtol=1e-2 if CUDA else 1e-5)


def test_fp8_linear_without_fp8_tensor_cores_is_dequantize_then_matmul():
    """Activations quantized per token as on the GPU, then the dequantized product in fp32."""
    if kernels.fp8_supported(DEVICE):
        pytest.skip("this device has FP8 tensor cores: the CUDA test below covers it")
    weight, scale = random_fp8(40, 64)
    x, bias = random_x(3, 64).reshape(1, 3, 64), random_bias(40)
    x_q, x_scale = kernels.quantize_per_token(x.reshape(3, 64))
    rounded = (x_q.float() * x_scale).reshape(1, 3, 64)
    expected = (F.linear(rounded, weight.float() * scale[:, None]) + bias.float()).to(x.dtype)
    torch.testing.assert_close(kernels.fp8_linear(x, weight, scale, bias), expected)
    assert not kernels.fp8_supported(torch.device("cpu"))


def test_bad_fp8_inputs_are_refused_by_name():
    weight, scale = random_fp8(16, 32)
    x = random_x(2, 32)
    with pytest.raises(ValueError, match="weight_scale must be \\[16\\]"):
        kernels.fp8_linear(x, weight, scale[:, None].expand(16, 2), None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kernels.fp8_linear(x, weight.float(), scale, None)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.fp8_linear(random_x(2, 16), weight.t().contiguous().t()[:, :16], scale, None)
    with pytest.raises(ValueError, match="input_scale must hold one value"):
        kernels.fp8_linear(x, weight, scale, None, torch.ones(2, device=DEVICE))


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_scaled_mm_equals_the_emulated_product(dtype, static):
    if not kernels.fp8_supported(DEVICE):
        pytest.skip("no FP8 tensor cores on this GPU")
    weight, scale = random_fp8(96, 128)
    x, bias = random_x(37, 128, dtype), random_bias(96, dtype)
    input_scale = torch.tensor(x.float().abs().max().item() / 300, device=DEVICE) if static else None
    x_q, x_scale = kernels.quantize_per_token(x, input_scale)
    expected = F.linear(x_q.float() * x_scale, weight.float() * scale[:, None], bias.float())
    got = kernels.fp8_linear(x, weight, scale, bias, input_scale)
    assert got.dtype == dtype and got.shape == (37, 96)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


@cuda_only
@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
def test_the_quantized_linears_replay_in_a_cuda_graph(fmt):
    """Decode runs in CUDA graphs: captured once (split-K's zeroed buffer, the activation quantizer and all), replayed
    on new inputs."""
    if fmt == "fp8" and not kernels.fp8_supported(DEVICE):
        pytest.skip("no FP8 tensor cores on this GPU")
    if fmt == "int4":
        qweight, scale, zero = random_int4(4096, 256, 128, dtype=torch.bfloat16)

        def linear(x):
            return kernels.int4_linear(x, qweight, scale, zero, None, 128)
    elif fmt == "int8":
        weight, scale = random_int8(4096, 256, 256, dtype=torch.bfloat16)

        def linear(x):
            return kernels.int8_linear(x, weight, scale, None, 256)
    else:
        weight8, scale8 = random_fp8(4096, 256)

        def linear(x):
            return kernels.fp8_linear(x, weight8, scale8, None)

    static_x = random_x(1, 256, torch.bfloat16)
    linear(static_x)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = linear(static_x)
    outputs = []
    for seed in (5, 6):
        static_x.copy_(random_x(1, 256, torch.bfloat16, seed=seed))
        graph.replay()
        torch.testing.assert_close(static_out, linear(static_x), atol=1e-3, rtol=1e-2)  # split-K adds in any order
        outputs.append(static_out.clone())
    assert not torch.equal(outputs[0], outputs[1])
