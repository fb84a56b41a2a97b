"""The persistent lane GEMV (quant/int4_persistent.py): fewer programs than row blocks, each taking several, gives
the lane GEMV's bits for every epilogue (plain, a bias, a folded norm's input, the norm's producer half, gate_up's
SiLU, qkv's rotation and KV store), K a whole number of steps or not, N a whole number of blocks or not; a tiny
W4A16 model's folded one-token steps through them; and what DecodeVariant refuses. The kernels run on
TRITONLLM_TEST_DEVICE: compiled on CUDA, in Triton's interpreter on CPU (both with three programs a launch, the
model's with two)."""

import os
from dataclasses import replace

import pytest
import torch

from tritonllm.engine.embedded.quant import fusion, int4_persistent, kernels, norm_fold
from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode
from tritonllm.engine.embedded.quant.linear import QuantLinear

from .test_gate_up_runs import _reordered, one_row_case
from .test_norm_fold import _fold, _one_row_forward, _one_token_steps, _w4a16, tiny  # noqa: F401
from .test_qkv_rotary import GROUP, HEAD_DIM, HEADS, KV_HEADS, _caches, _rotation, _store
from .test_quant_kernels import random_int4, random_x

DEVICE = torch.device(os.environ.get("TRITONLLM_TEST_DEVICE", "cpu"))
INTERPRETED_OR_CUDA = DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not INTERPRETED_OR_CUDA, reason="Triton kernels: CUDA or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def one_sm(monkeypatch):
    """A GPU of one SM, so that on CUDA too a launch has fewer programs than blocks."""
    monkeypatch.setattr(int4_persistent, "sm_count", lambda device: 1)


def _pair(rows: int) -> tuple:
    """A lane GEMV of `rows` rows a program and one warp (K steps of 1,024), and the same in three persistent
    programs (an SM's, on one SM)."""
    lanes = kernels.lane_gemv(rows, 1)
    return lanes, replace(lanes, persistent=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(200, 3072), (192, 2560)], ids=["N ragged", "K ragged"])
@pytest.mark.parametrize("folded", [False, True], ids=["plain x", "folded x"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_persistent_programs_give_the_lane_gemvs_bits(dtype, n, k, folded, with_bias):
    qweight, scale, zero, bias, x, fold = one_row_case(n, k, 128, dtype, n, folded, with_bias)
    lanes, persistent = _pair(8)
    expected = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, 128, lanes, fold)
    got = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, 128, persistent, fold)
    assert got.shape == expected.shape == (1, n)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_persistent_programs_begin_a_folded_norm_as_the_lane_gemv(dtype):
    n, k = 200, 2048
    qweight, scale, zero, _, x, _ = one_row_case(n, k, 128, dtype, 3, False, False)
    generator = torch.Generator().manual_seed(13)
    residual = torch.randn(1, n, generator=generator).to(dtype).to(DEVICE)
    weight = (torch.rand(n, generator=generator) + 0.5).to(dtype).to(DEVICE)
    results = []
    for variant in _pair(8):
        slots = torch.full((2, norm_fold.SLOTS), 7.0, device=DEVICE)
        slots[1].zero_()
        folding = _fold(residual, weight, slots)
        hg = int4_decode.int4_decode_matmul(x, qweight, scale, zero, None, 128, variant, folding=folding)
        results.append((hg, folding.h_out, slots))
    (hg, h, slots), (want_hg, want_h, want_slots) = results[1], results[0]
    assert torch.equal(hg, want_hg) and torch.equal(h, want_h)
    assert not slots[0].any()  # the stale slots zeroed
    # the same squares, added into other slots (a slot a program) in another order
    torch.testing.assert_close(slots[1].sum(), want_slots[1].sum(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_persistent_programs_apply_gate_ups_silu_as_the_lane_gemv(dtype):
    n, k, rows = 2 * 96, 2048, 8
    qweight, scale, zero, bias, x, fold = one_row_case(n, k, 128, dtype, 5, True, True)
    weights = _reordered(qweight, scale, zero, bias, rows // 2)
    got = [
        int4_decode.int4_decode_matmul(x, *weights[:3], weights[3], 128, variant, fold, gate_up_runs=rows // 2)
        for variant in _pair(rows)
    ]
    assert got[0].shape == (1, n // 2)
    assert torch.equal(got[1], got[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_persistent_programs_rotate_and_store_as_the_lane_gemv(dtype):
    n = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qweight, scale, zero, bias, x, fold = one_row_case(n, 2048, GROUP, dtype, 7, True, True)
    cos, sin = _rotation()
    outputs = []
    for variant in _pair(8):
        caches = _caches(dtype)
        got = int4_decode.int4_decode_matmul(
            x, qweight, scale, zero, bias, GROUP, variant, fold, rotary=_store(caches, cos, sin)
        )
        outputs.append((got, caches))
    (got, caches), (expected, expected_caches) = outputs[1], outputs[0]
    assert torch.equal(got, expected)
    for have, want in zip(caches, expected_caches):
        assert torch.equal(have, want)


def test_persistent_is_a_lane_gemvs_without_split_k():
    with pytest.raises(ValueError, match="persistent is a lane GEMV's without split K"):
        replace(kernels.lane_gemv(8, 1, split_k=2), persistent=1)
    with pytest.raises(ValueError, match="persistent is a lane GEMV's"):
        replace(kernels.word_gemv(8, 1024, 1), persistent=2)
    assert int4_decode.folds(replace(kernels.lane_gemv(8, 2), persistent=2))
    qweight, scale, zero = random_int4(64, 1024, 128, seed=2)
    with pytest.raises(ValueError, match="persistent programs take one row of x, not 2"):
        int4_decode.int4_decode_matmul(random_x(2, 1024), qweight, scale, zero, None, 128, _pair(8)[1])


def test_a_folded_w4a16_models_one_token_steps_are_alike_through_persistent_programs(tiny, monkeypatch):  # noqa: F811
    """A tiny W4A16 model with its norms folded, one-token steps through the one-row kernels: with every
    projection's shape made persistent (kernels.default_lane_gemv's, which the tiny shapes take), the hidden states
    are those of the lane GEMVs within rounding: the norms' sums of squares add into other slots, in another order
    (~1 ulp in 1 / rms), which the int4 kernels' cancelling sums magnify (~1e-5 relative here)."""
    models = []
    for _ in range(2):
        model = _w4a16(tiny)
        assert fusion.install_norm_folds(model, DEVICE) == 3
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.forward = _one_row_forward(module)
        models.append(model)
    tokens = [5, 9, 5]
    expected = _one_token_steps(models[0], tokens)
    lanes, launches = kernels.default_lane_gemv, []
    monkeypatch.setattr(kernels, "default_lane_gemv", lambda n, k: replace(lanes(n, k), split_k=1, persistent=2))
    counted = int4_persistent.persistent_gemv
    monkeypatch.setattr(int4_persistent, "persistent_gemv", lambda *a, **k: launches.append(1) or counted(*a, **k))
    got = _one_token_steps(models[1], tokens)
    assert len(launches) == 3 * 2 * 4  # steps x layers x projections
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-3)
