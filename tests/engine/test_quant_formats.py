"""The internal quantized formats: reference dequantizers, int4 packing, round-to-nearest quantization, the
unpacking of AWQ / GPTQ / compressed-tensors words (against compressed-tensors' own packer) and the portable
kernels against dequantize-then-matmul."""

import pytest
import torch

from tritonllm.engine.embedded.quant import kernels
from tritonllm.engine.embedded.quant.formats import (
    FP8_DTYPE,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    unpack_int4,
)
from tritonllm.engine.embedded.quant.packing import AWQ_ORDER, unpack_awq, unpack_int32
from tritonllm.engine.embedded.quant.quantize import quantize_fp8, quantize_int4, quantize_int8

from .quant_checkpoints import pack_cols, pack_rows


def test_pack_int4_puts_even_columns_in_the_low_nibble():
    values = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(values).tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_int4(pack_int4(values)), values)


def test_dequantizers_follow_the_documented_formulas():
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(0, 16, (3, 8), generator=generator, dtype=torch.uint8)
    scale = torch.rand(3, 2, generator=generator) + 0.1
    zero = torch.randint(0, 16, (3, 2), generator=generator, dtype=torch.uint8)
    expected = (values.float() - zero.float().repeat_interleave(4, 1)) * scale.repeat_interleave(4, 1)
    torch.testing.assert_close(dequantize_int4(pack_int4(values), scale, zero, 4), expected)
    signed = torch.randint(-127, 128, (3, 8), generator=generator, dtype=torch.int8)
    torch.testing.assert_close(dequantize_int8(signed, scale, 4), signed.float() * scale.repeat_interleave(4, 1))
    fp8 = torch.randn(3, 8, generator=generator).to(FP8_DTYPE)
    row_scale = torch.rand(3, generator=generator)
    assert dequantize_fp8(fp8, row_scale).dtype == torch.float32
    torch.testing.assert_close(dequantize_fp8(fp8, row_scale), fp8.float() * row_scale[:, None])
    assert dequantize_fp8(fp8, row_scale, torch.bfloat16).dtype == torch.bfloat16
    assert dequantize_int8(signed, scale.to(torch.bfloat16), 4).dtype == torch.bfloat16


def test_a_scale_that_does_not_cover_the_columns_is_an_error():
    with pytest.raises(ValueError, match="8 columns does not match 3 scale groups of 4"):
        dequantize_int8(torch.zeros(2, 8, dtype=torch.int8), torch.ones(2, 3), 4)


@pytest.mark.parametrize(
    "kind, bound",
    # Worst relative error of a weight element against its row's (group's) largest magnitude: half a step (int4:
    # a step of the group's range over 15 levels, at most 2 / 15 of the magnitude, plus half a step the zero point's
    # rounding may shift the grid).
    [("fp8", 1 / 16), ("int8", 0.5 / 127 + 1e-6), ("int4", 2 / 15 + 1e-6)],
)
def test_round_to_nearest_stays_within_half_a_step(kind, bound):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    if kind == "fp8":
        dense = dequantize_fp8(*quantize_fp8(weight))
        reference = weight.abs()  # fp8 steps are relative to each value
    elif kind == "int8":
        dense = dequantize_int8(*quantize_int8(weight, 32, torch.float32), 32)
        reference = weight.reshape(16, 2, 32).abs().amax(-1).repeat_interleave(32, 1)
    else:
        qweight, scale, zero = quantize_int4(weight, 32, torch.float32)
        assert len(set(zero.flatten().tolist())) > 1  # asymmetric: each group its own zero point
        dense = dequantize_int4(qweight, scale, zero, 32)
        reference = weight.reshape(16, 2, 32).abs().amax(-1).repeat_interleave(32, 1)
    assert torch.all((dense - weight).abs() <= bound * reference + 1e-7)


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_int32_reads_compressed_tensors_packing(bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    offset = 1 << (bits - 1)
    signed = torch.randint(-offset, offset, (12, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.int8)
    along_cols = pack_to_int32(signed, bits, packed_dim=1)
    assert torch.equal(unpack_int32(along_cols, bits, dim=1), signed.to(torch.int32) + offset)
    rows = signed[:8]
    along_rows = pack_to_int32(rows, bits, packed_dim=0)
    assert torch.equal(unpack_int32(along_rows, bits, dim=0), rows.to(torch.int32) + offset)


def test_gptq_and_awq_words_unpack_to_their_values():
    values = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(2))
    assert torch.equal(unpack_int32(pack_rows(values, 4), 4, dim=0), values.to(torch.int32))
    assert torch.equal(unpack_int32(pack_cols(values, 4), 4, dim=1), values.to(torch.int32))
    awq = pack_cols(values, 4, AWQ_ORDER)
    assert not torch.equal(awq, pack_cols(values, 4))  # the order matters
    assert torch.equal(unpack_awq(awq), values.to(torch.int32))


def test_portable_kernels_equal_dequantize_then_matmul():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=generator)
    weight, bias = torch.randn(24, 64, generator=generator), torch.randn(24, generator=generator)
    w8, s8 = quantize_int8(weight, 32, torch.float32)
    torch.testing.assert_close(kernels.int8_linear(x, w8, s8, bias, 32), x @ dequantize_int8(w8, s8, 32).t() + bias)
    q4, s4, z4 = quantize_int4(weight, 32, torch.float32)
    expected = x @ dequantize_int4(q4, s4, z4, 32).t() + bias
    torch.testing.assert_close(kernels.int4_linear(x, q4, s4, z4, bias, 32), expected)
    f8, sf = quantize_fp8(weight)
    # Activations are quantized per token too: within fp8's relative step of the exact product.
    out = kernels.fp8_linear(x, f8, sf, bias)
    exact = x @ dequantize_fp8(f8, sf).t() + bias
    assert out.dtype == x.dtype
    assert (out - exact).abs().max() < 0.07 * exact.abs().max()
    assert not kernels.fp8_supported(torch.device("cpu"))
