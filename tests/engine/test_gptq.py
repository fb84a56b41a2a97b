"""GPTQ's math (checkpoints/gptq.py) on random layers with correlated inputs: the output error against
round-to-nearest on the same grid, and every value on the grid quantization on load uses."""

import pytest
import torch

from tritonllm.checkpoints.gptq import Grid, HessianSum, gptq_quantize
from tritonllm.engine.embedded.quant.formats import FP8_DTYPE, dequantize_fp8, dequantize_int4, pack_int4
from tritonllm.engine.embedded.quant.quantize import quantize_fp8, quantize_int4

ROWS, COLS, SAMPLES = 48, 256, 1024


def correlated_inputs(seed: int) -> torch.Tensor:
    """Inputs whose columns share a few strong directions, as a transformer's activations do: where GPTQ's error
    spreading pays off."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.randn(16, COLS, generator=generator)
    mix = torch.randn(SAMPLES, 16, generator=generator)
    return mix @ basis + 0.1 * torch.randn(SAMPLES, COLS, generator=generator)


def layer(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = correlated_inputs(seed)
    weight = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed + 1)) * 0.05
    hessian = HessianSum(COLS, torch.device("cpu"))
    for part in x.split(300):  # in batches, as calibration feeds it
        hessian.add(part)
    return x, weight, hessian.hessian()


def output_error(x, weight, dense) -> float:
    return float(torch.linalg.norm(x @ weight.t() - x @ dense.t()))


def test_the_hessian_is_two_x_transpose_x_over_n():
    x = correlated_inputs(0)
    hessian = HessianSum(COLS, torch.device("cpu"))
    hessian.add(x[:100].reshape(4, 25, COLS))
    hessian.add(x[100:])
    torch.testing.assert_close(hessian.hessian(), 2 * x.t() @ x / SAMPLES, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 128, COLS])
def test_int4_gptq_beats_round_to_nearest_on_the_same_grid(symmetric, group_size, act_order):
    x, weight, hessian = layer(seed=group_size)
    grid = Grid("int4", group_size, symmetric, torch.float32)
    result = gptq_quantize(weight, hessian, grid, act_order=act_order)
    packed, scale, zero = quantize_int4(weight, group_size, torch.float32, symmetric=symmetric)
    rtn = dequantize_int4(packed, scale, zero, group_size)
    assert output_error(x, weight, result.dense) < 0.7 * output_error(x, weight, rtn)
    # On the grid: integer levels 0..15 that dequantize (the engine's reference) to exactly the dense result.
    assert result.values.dtype == torch.uint8 and int(result.values.max()) <= 15
    engine = dequantize_int4(pack_int4(result.values), result.scale, result.zero, group_size)
    torch.testing.assert_close(engine, result.dense, atol=0, rtol=0)
    if symmetric:
        assert bool((result.zero == 8).all())


def test_int4_group_parameters_come_from_the_updated_weights():
    """The first group's scales are the plain weights' (nothing was updated yet); a later group's differ from
    round-to-nearest's, since earlier columns' errors moved its weights first."""
    x, weight, hessian = layer(seed=3)
    result = gptq_quantize(weight, hessian, Grid("int4", 32, False, torch.float32), block_size=64)
    _, scale, zero = quantize_int4(weight, 32, torch.float32)
    torch.testing.assert_close(result.scale[:, 0], scale[:, 0], atol=0, rtol=0)
    assert torch.equal(result.zero[:, 0], zero[:, 0])
    assert not torch.equal(result.scale[:, 3], scale[:, 3])  # a group inside a block, after its first column
    assert not torch.equal(result.scale[:, 2], scale[:, 2])  # a group starting a block


def test_fp8_gptq_beats_round_to_nearest_with_the_same_row_scales():
    x, weight, hessian = layer(seed=5)
    result = gptq_quantize(weight, hessian, Grid("fp8"))
    values, scale = quantize_fp8(weight)
    torch.testing.assert_close(result.scale, scale, atol=0, rtol=0)
    assert result.values.dtype == FP8_DTYPE
    torch.testing.assert_close(dequantize_fp8(result.values, result.scale), result.dense, atol=0, rtol=0)
    assert output_error(x, weight, result.dense) < 0.9 * output_error(x, weight, dequantize_fp8(values, scale))


def test_act_order_keeps_round_to_nearest_group_parameters_and_the_column_order():
    """Static groups: act-order's scales and zero points are round-to-nearest's, and each stored value is that of
    its own input column (a weight that needs no rounding comes back unchanged, wherever the order put it)."""
    x, weight, hessian = layer(seed=11)
    _, scale, zero = quantize_int4(weight, 32, torch.float32)
    on_grid = dequantize_int4(*quantize_int4(weight, 32, torch.float32), 32)
    result = gptq_quantize(on_grid, hessian, Grid("int4", 32, False, torch.float32), act_order=True)
    torch.testing.assert_close(result.dense, on_grid, atol=1e-6, rtol=0)
    result = gptq_quantize(weight, hessian, Grid("int4", 32, False, torch.float32), act_order=True)
    torch.testing.assert_close(result.scale, scale, atol=0, rtol=0)
    assert torch.equal(result.zero, zero)


def test_a_column_no_input_reaches_is_quantized_to_zero():
    x, weight, _ = layer(seed=7)
    x[:, 5] = 0.0
    hessian = HessianSum(COLS, torch.device("cpu"))
    hessian.add(x)
    result = gptq_quantize(weight, hessian.hessian(), Grid("int4", 32, False, torch.float32))
    assert bool((result.dense[:, 5] == 0).all())


def test_a_group_size_that_does_not_divide_the_columns_is_an_error_naming_it():
    _, weight, hessian = layer(seed=9)
    with pytest.raises(ValueError, match="group_size 48 does not divide the 256 input columns"):
        gptq_quantize(weight, hessian, Grid("int4", 48))
