"""SiLU in gate_up's one-row int4 GEMV (quant/gate_up_runs.py): the rows' run order, the SiLU launch and the unfused
split reading outputs in that order, the GEMV's activated output against the unfused pair bit for bit (plain,
with a folded norm's input, with a bias), and a W4A16 model's one-token steps with and without it
(fusion.install_gate_up_runs). The kernels run on TRITONLLM_TEST_DEVICE: compiled on CUDA, in Triton's
interpreter on CPU."""

import os

import pytest
import torch

from tritonllm.engine.embedded.network import fused_ops
from tritonllm.engine.embedded.network.layers import ACTIVATED, split_gate_up
from tritonllm.engine.embedded.quant import fusion, gate_up_runs, kernels, norm_fold
from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode
from tritonllm.engine.embedded.quant.linear import QuantLinear

from .test_norm_fold import (  # noqa: F401
    _layer_without_attention,
    _one_row_forward,
    _one_token_steps,
    _w4a16,
    tiny,
    w4a16_greedy_tokens_on_cuda,
)
from .test_quant_kernels import random_bias, random_int4, random_x

DEVICE = torch.device(os.environ.get("TRITONLLM_TEST_DEVICE", "cpu"))


def test_run_order_alternates_gate_and_up_runs():
    assert gate_up_runs.run_order(6, 2).tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    with pytest.raises(ValueError, match="do not split into runs of 4"):
        gate_up_runs.run_order(6, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_silu_launch_and_the_unfused_split_read_run_order(dtype):
    gate_up = random_x(3, 2 * 48, dtype)
    in_runs = gate_up[:, gate_up_runs.run_order(48, 4).to(DEVICE)]
    gate, up = split_gate_up(in_runs, 48, 4)
    assert torch.equal(torch.cat([gate, up], -1), gate_up)
    if DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        expected = fused_ops.silu_and_mul(gate_up)
        torch.testing.assert_close(fused_ops.silu_and_mul(in_runs, runs=4), expected, rtol=0, atol=0)
        assert not torch.equal(fused_ops.silu_and_mul(in_runs), expected)  # read as halves: wrong
        with pytest.raises(ValueError, match="runs of 5"):
            fused_ops.silu_and_mul(in_runs, runs=5)


def one_row_case(n, k, group_size, dtype, seed, folded, with_bias):
    """An int4 weight [n, k] (qweight, scale, zero), a bias or None, one row x and a folded norm's input or None."""
    qweight, scale, zero = random_int4(n, k, group_size, dtype, seed=seed)
    bias = random_bias(n, dtype) if with_bias else None
    sums = torch.rand(norm_fold.SLOTS, generator=torch.Generator().manual_seed(4)).to(DEVICE) * 9
    fold = norm_fold.FoldedInput(sums, 1e-5) if folded else None
    return qweight, scale, zero, bias, random_x(1, k, dtype), fold


def _reordered(qweight, scale, zero, bias, runs):
    order = gate_up_runs.run_order(qweight.shape[0] // 2, runs).to(DEVICE)
    return qweight[order], scale[order], zero[order], None if bias is None else bias[order]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("folded", [False, True], ids=["plain x", "folded x"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("rows", [4, 8], ids=["runs of 2", "runs of 4"])
def test_the_one_row_gemv_applies_the_silu_as_the_unfused_pair(dtype, folded, with_bias, rows):
    n, k, group_size = 2 * 48, 1024, 128
    qweight, scale, zero, bias, x, fold = one_row_case(n, k, group_size, dtype, rows, folded, with_bias)
    variant = kernels.lane_gemv(rows, 1)
    product = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, group_size, variant, fold)
    expected = fused_ops.silu_and_mul(product)
    runs = rows // 2
    weights = _reordered(qweight, scale, zero, bias, runs)
    got = int4_decode.int4_decode_matmul(x, *weights[:3], weights[3], group_size, variant, fold, gate_up_runs=runs)
    assert got.shape == (1, n // 2)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    unordered = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, group_size, variant, fold, None, runs)
    assert not torch.equal(unordered, expected)  # the rows not in runs: other products pair up


def test_the_silu_is_refused_where_runs_and_programs_differ():
    qweight, scale, zero = random_int4(96, 1024, 128, seed=1)
    x = random_x(1, 1024)
    with pytest.raises(ValueError, match="runs of 2 through programs of 8 rows"):
        int4_decode.int4_decode_matmul(x, qweight, scale, zero, None, 128, kernels.lane_gemv(8, 1), gate_up_runs=2)
    with pytest.raises(ValueError, match="without split K"):
        split = kernels.lane_gemv(8, 1, split_k=2)
        int4_decode.int4_decode_matmul(x, qweight, scale, zero, None, 128, split, gate_up_runs=4)
    assert kernels.int4_gate_up_runs(qweight[:90], 128, torch.float32) == 0  # 90 rows: no whole programs


# ---- a model's steps ------------------------------------------------------------------------------------------


def test_a_w4a16_model_takes_runs_in_every_gate_up_or_none(tiny):  # noqa: F811
    model = _w4a16(tiny)
    gate_ups = [layer.mlp.gate_up_proj for layer in model.decoder_layers]
    before = [p.qweight.clone() for p in gate_ups]
    assert fusion.install_gate_up_runs(model) == 2
    assert all(p.gate_up_runs == 2 for p in gate_ups)
    assert not any(torch.equal(p.qweight, b) for p, b in zip(gate_ups, before))
    with pytest.raises(ValueError, match="already in run order"):
        fusion.reorder_gate_up(gate_ups[0], 2)
    other = _w4a16(tiny)
    other.decoder_layers[1].mlp.gate_up_proj.register_forward_hook(lambda *args: None)  # e.g. a TP all-reduce
    assert fusion.install_gate_up_runs(other) == 0
    assert all(layer.mlp.gate_up_proj.gate_up_runs == 0 for layer in other.decoder_layers)


def test_one_token_steps_with_the_silu_in_gate_up_equal_those_without(tiny):  # noqa: F811
    """Folded norms both, the one-row kernel everywhere: the same hidden states bit for bit (each row's product
    does not depend on the program it is in, and the SiLU rounds as the unfused launch does); gate_up's outputs
    come out activated."""
    plain, runs = _w4a16(tiny), _w4a16(tiny)
    for model in (plain, runs):
        assert fusion.install_norm_folds(model, DEVICE) == 3
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.forward = _one_row_forward(module)
    assert fusion.install_gate_up_runs(runs) == 2
    activated = []
    runs.decoder_layers[0].mlp.gate_up_proj.register_forward_hook(
        lambda module, args, out: activated.append(getattr(out, ACTIVATED, False))
    )
    tokens = [5, 9]  # two steps (the interpreter's one-row launches are slow); test_norm_fold takes the third
    for want, have in zip(_one_token_steps(plain, tokens), _one_token_steps(runs, tokens)):
        torch.testing.assert_close(have, want, rtol=0, atol=0)
    assert activated == [True] * 2


def test_several_rows_read_the_runs_through_the_silu_launch(tiny):  # noqa: F811
    """A prompt's rows (no one-row kernel): gate_up's product in run order, the fused SiLU launch reading it so;
    the same hidden states as the model in halves, and the unfused split too."""
    plain, runs = _w4a16(tiny), _w4a16(tiny)
    assert fusion.install_gate_up_runs(runs) == 2
    tokens = torch.tensor([5, 9, 5, 14], device=DEVICE)

    def forward(model):
        hidden, residual = model.embed(tokens), None
        for layer in model.decoder_layers:
            hidden, residual = _layer_without_attention(layer, hidden, residual)
        return model.norm(hidden, residual=residual)[0]

    expected = forward(plain)
    torch.testing.assert_close(forward(runs), expected, rtol=0, atol=0)
    for layer in runs.decoder_layers:
        layer.mlp.fused = False  # torch's SiLU over layers.split_gate_up
    torch.testing.assert_close(forward(runs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine folds norms on CUDA only")
def test_cuda_the_engine_decodes_alike_with_and_without_the_launch_cuts(tiny, monkeypatch):  # noqa: F811
    """One request at a time (one-row decode steps, in CUDA graphs; prompts through the SiLU launch reading
    runs): the same greedy tokens with fusion.SILU_IN_GATE_UP, decode_kernels.MERGE_IN_LAST_SPLIT and
    triton_backend.ROTATE_WHILE_STORING all on as all off."""
    from tritonllm.engine.embedded.attention import decode_kernels, triton_backend

    outputs = []
    for on in (True, False):
        monkeypatch.setattr(fusion, "SILU_IN_GATE_UP", on)
        monkeypatch.setattr(decode_kernels, "MERGE_IN_LAST_SPLIT", on)
        monkeypatch.setattr(triton_backend, "ROTATE_WHILE_STORING", on)

        def check(model, on=on):
            assert (model.decoder_layers[0].mlp.gate_up_proj.gate_up_runs > 0) == on

        outputs.append(w4a16_greedy_tokens_on_cuda(tiny, check))
    assert outputs[0] == outputs[1]
