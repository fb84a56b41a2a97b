"""The many-row W4A16 kernel (quant/int4_gemm.py) against dequantize-then-matmul on random inputs: rows and
columns past a tile, several tiles along both, group sizes 32 to 128 and per channel, zero points other than 8,
group-major scales, bias; in Triton's interpreter on CPU (fp32) and compiled in bf16 / fp16 on CUDA
(TRITONLLM_TEST_DEVICE=cuda)."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tritonllm.engine.embedded import gpu_fence
from tritonllm.engine.embedded.quant import int4_gemm, kernels
from tritonllm.engine.embedded.quant.formats import dequantize_int4
from tritonllm.engine.embedded.quant.int4_gemm import GemmTiles

from .test_quant_kernels import CUDA, DEVICE, random_int4, random_x

if not CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(int4_gemm._int4_gemm_kernel, InterpretedFunction):
        pytest.skip("the Triton kernels were compiled without TRITON_INTERPRET=1", allow_module_level=True)

SMALL = GemmTiles(block_n=16, block_m=16, block_k=32)  # the interpreter's: tiny tiles, many of them
WIDE = GemmTiles(block_n=32, block_m=16, block_k=64)


def expected(x, qweight, scale, zero, bias, group_size):
    """fp32 product of x and the weight dequantized into x's dtype (the portable path's weight)."""
    dense = dequantize_int4(qweight, scale, zero, group_size)
    return F.linear(x.float(), dense.float(), None if bias is None else bias.float())


@pytest.mark.skipif(CUDA, reason="the interpreter's fp32 path")
@pytest.mark.parametrize(
    "m, n, k, group_size, tiles, with_bias",
    [
        (17, 40, 128, 32, SMALL, False),  # rows and columns past a tile, four groups of one step each
        (33, 48, 256, 128, SMALL, True),  # a group of four steps, bias
        (20, 70, 128, 128, WIDE, False),  # per channel (one group), two steps a group
        (5, 16, 64, 64, WIDE, True),  # fewer rows than a tile
    ],
)
def test_the_int4_gemm_equals_dequantize_then_matmul(m, n, k, group_size, tiles, with_bias):
    qweight, scale, zero = random_int4(n, k, group_size, torch.float32)
    x = random_x(m, k, torch.float32)
    bias = torch.randn(n).to(DEVICE) if with_bias else None
    got = int4_gemm.int4_gemm(x, qweight, scale, zero, bias, group_size, tiles)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected(x, qweight, scale, zero, bias, group_size), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_a_split_k_int4_gemm_sums_its_slices_and_leaves_its_workspace_zero(split_k):
    """K (four steps) in slices: 2; 3, which makes two of two steps (no slice empty); 8, one a step. The tile's last
    slice takes the sum out of the workspace; a second launch finds workspace and counters zero again."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    qweight, scale, zero = random_int4(40, 256, 64, dtype)
    x, bias = random_x(20, 256, dtype), torch.randn(40).to(dtype).to(DEVICE)
    tiles = GemmTiles(block_n=16, block_m=16, block_k=64, split_k=split_k)
    want = expected(x, qweight, scale, zero, bias, 64)
    for _ in range(2):
        got = int4_gemm.int4_gemm(x, qweight, scale, zero, bias, 64, tiles)
        torch.testing.assert_close(got.float(), want, atol=2e-2 if CUDA else 1e-4, rtol=1e-2 if CUDA else 1e-4)
    workspace, counters = gpu_fence._buffers[(x.device, int4_gemm.MAX_ROWS, 40)]
    assert not workspace.any() and not counters.any()


@pytest.mark.skipif(CUDA, reason="the interpreter's fp32 path")
def test_the_int4_gemm_reads_group_major_scales_and_zeros():
    qweight, scale, zero = random_int4(24, 128, 32, torch.float32)
    moved_scale, moved_zero = scale.t().contiguous().t(), zero.t().contiguous().t()
    assert moved_scale.stride(0) == 1
    x = random_x(18, 128, torch.float32)
    got = int4_gemm.int4_gemm(x, qweight, moved_scale, moved_zero, None, 32, SMALL)
    torch.testing.assert_close(got, expected(x, qweight, scale, zero, None, 32), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not CUDA, reason="the 16-bit path is compiled: TRITONLLM_TEST_DEVICE=cuda")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "m, n, k, group_size, tiles",
    [
        (128, 6144, 4096, 128, int4_gemm.DEFAULT_TILES),  # a 128-token prompt through Llama-3.1-8B's qkv
        (40, 1000, 1024, 64, GemmTiles(block_n=64, block_m=64, block_k=64, num_warps=4, num_stages=3)),
        (300, 256, 512, 512, GemmTiles(block_n=128, block_m=64, block_k=128, num_warps=8, num_stages=3)),
        (128, 4096, 14336, 128, replace(int4_gemm.DEFAULT_TILES, split_k=4)),  # down_proj's, K in four slices
    ],
)
def test_the_int4_gemm_in_16_bits_on_cuda(dtype, m, n, k, group_size, tiles):
    """Each weight rounded once into the 16-bit type, as the reference: the sums differ only in their fp32 order
    and the output's rounding."""
    qweight, scale, zero = random_int4(n, k, group_size, dtype)
    x = random_x(m, k, dtype)
    bias = torch.randn(n).to(dtype).to(DEVICE)
    got = int4_gemm.int4_gemm(x, qweight, scale, zero, bias, group_size, tiles)
    want = expected(x, qweight, scale, zero, bias, group_size)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


def test_int4_linear_takes_the_int4_gemm_from_a_few_rows_to_max_rows(monkeypatch):
    """int4_linear's Triton path sends SMALL_M + 1 to MAX_ROWS rows through int4_gemm, and more rows, or groups no
    K step fits in, to the dequantize path."""
    calls = []
    original = int4_gemm.int4_gemm
    monkeypatch.setattr(int4_gemm, "int4_gemm", lambda *args: calls.append(args[0].shape[0]) or original(*args))
    monkeypatch.setattr(int4_gemm, "MAX_ROWS", 40)
    for rows, group_size, taken in ((kernels.SMALL_M + 1, 32, True), (40, 64, True), (41, 32, False), (20, 8, False)):
        calls.clear()
        qweight, scale, zero = random_int4(24, 64, group_size, torch.float32)
        x = random_x(rows, 64, torch.float32)
        got = kernels.weight_only_triton(x, qweight, scale, zero, None, group_size, bits=4)
        assert calls == ([rows] if taken else [])
        torch.testing.assert_close(got, expected(x, qweight, scale, zero, None, group_size), atol=1e-4, rtol=1e-4)


def test_the_tiles_follow_the_rows_and_the_group_size():
    assert int4_gemm.tiles_for(17, 128) == GemmTiles(block_n=64, block_m=64, block_k=128, num_warps=4, num_stages=3)
    assert int4_gemm.tiles_for(65, 128).block_m == 128
    assert [int4_gemm.tiles_for(128, g).block_k for g in (32, 64, 96, 576, 4096)] == [32, 64, 32, 64, 128]
    assert not int4_gemm.fits(8, int4_gemm.tiles_for(128, 8))


def test_gemm_tiles_are_checked():
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16, got 24"):
        GemmTiles(block_k=24)
    with pytest.raises(ValueError, match="block_m"):
        GemmTiles(block_m=8)
    with pytest.raises(ValueError, match="split_k must be >= 1, got 0"):
        GemmTiles(split_k=0)
    assert int4_gemm.fits(128, GemmTiles(block_k=64)) and not int4_gemm.fits(32, GemmTiles(block_k=64))
