"""Deferred FP8 scales (quant/fusion.py's defer_fp8_scales): an FP8 o_proj or down_proj whose output only the next
fused RMSNorm reads returns its unscaled product in fp32, and the norm applies the row and column scales before
its residual add. Here the marking, the hand-over through fp8_linear (torch._scaled_mm replaced by its definition
on CPU, so the two paths must agree exactly), the norm's arithmetic, and on CUDA (TRITONLLM_TEST_DEVICE=cuda)
the real GEMMs and the engine's greedy output against the undeferred path."""

import os

import pytest
import torch

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.loader import load_model
from tritonllm.engine.embedded.network import fused_ops
from tritonllm.engine.embedded.network.layers import use_fused_kernels
from tritonllm.engine.embedded.quant import fusion, kernels
from tritonllm.engine.embedded.quant.linear import QuantLinear
from tritonllm.engine.types import SamplingParams

DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), seed=0, arch="llama")


def fused_model(tiny, quant_config={"quant_algo": "FP8"}, fused=True):
    model, _ = load_model(tiny, torch.float32, "cpu", quant_config=quant_config)
    if fused:
        use_fused_kernels(model)
    return model


def deferring(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, QuantLinear) and m.defer_scales]


def test_o_proj_and_down_proj_before_fused_norms_defer(tiny, monkeypatch):
    model = fused_model(tiny)
    assert fusion.defer_fp8_scales(model, CPU, lora_enabled=False) == 0  # no FP8 matmuls here
    monkeypatch.setattr(fusion, "fp8_supported", lambda device: True)
    layers = len(list(model.decoder_layers))
    assert fusion.defer_fp8_scales(model, CPU, lora_enabled=False) == 2 * layers
    names = deferring(model)
    assert all(n.endswith(("self_attn.o_proj", "mlp.down_proj")) for n in names) and len(names) == 2 * layers


@pytest.mark.parametrize("case", ["lora", "captured layers", "unfused norms", "weight-only", "switched off"])
def test_nothing_defers_where_another_reader_could_see_the_unscaled_product(tiny, monkeypatch, case):
    monkeypatch.setattr(fusion, "fp8_supported", lambda device: True)
    quant = {"quant_algo": "W8A16"} if case == "weight-only" else {"quant_algo": "FP8"}
    model = fused_model(tiny, quant, fused=case != "unfused norms")
    if case == "captured layers":
        model.capture_layers = (0,)  # EAGLE-3 reads layer outputs itself
    if case == "switched off":
        monkeypatch.setattr(fusion, "DEFER_SCALES", False)
    assert fusion.defer_fp8_scales(model, CPU, lora_enabled=case == "lora") == 0 and not deferring(model)


def _scaled_mm_reference(a, b, scale_a, scale_b, out_dtype, bias=None, use_fast_accum=False):
    """torch._scaled_mm's definition (fp32 product, times scale_a then scale_b, rounded once)."""
    out = (a.to(torch.float32) @ b.to(torch.float32)) * scale_a * scale_b
    return out.to(out_dtype)


@pytest.mark.parametrize("rows", [1, 5, kernels.DEFER_MAX_ROWS + 1])
def test_the_deferred_product_through_the_norm_equals_the_scaled_one(monkeypatch, rows):
    monkeypatch.setattr(kernels, "fp8_supported", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_reference)
    gen = torch.Generator().manual_seed(rows)
    n, k = 64, 96
    weight = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn).to(DEVICE)
    weight_scale = (torch.rand(n, generator=gen) + 0.01).to(DEVICE)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(rows, n, generator=gen).to(torch.bfloat16).to(DEVICE)
    norm_weight = (torch.randn(n, generator=gen) * 0.3 + 1).to(torch.bfloat16).to(DEVICE)
    deferred = kernels.fp8_linear(x, weight, weight_scale, None, defer_scales=True)
    scaled = kernels.fp8_linear(x, weight, weight_scale, None)
    if rows > kernels.DEFER_MAX_ROWS:  # past decode sizes the projection scales its output itself
        assert fused_ops.fp8_pending_of(deferred) is None and torch.equal(deferred, scaled)
        return
    assert deferred.dtype == torch.float32 and fused_ops.fp8_pending_of(deferred) is not None
    assert scaled.dtype == torch.bfloat16 and fused_ops.fp8_pending_of(scaled) is None
    got = fused_ops.rms_norm(deferred, norm_weight, 1e-5, residual)
    want = fused_ops.rms_norm(scaled, norm_weight, 1e-5, residual)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    rows_got = fused_ops.rms_norm(deferred, norm_weight, 1e-5, residual, fp8_rows=True)[0]
    assert torch.equal(
        fused_ops.fp8_rows_of(rows_got)[1],
        fused_ops.rms_norm(scaled, norm_weight, 1e-5, residual, fp8_rows=True)[0].fp8_rows[1],
    )


def test_deferral_needs_a_2d_input_without_bias(monkeypatch):
    monkeypatch.setattr(kernels, "fp8_supported", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_reference)
    weight, scale = torch.ones(32, 64).to(torch.float8_e4m3fn).to(DEVICE), torch.ones(32, device=DEVICE)
    x = torch.randn(2, 3, 64, device=DEVICE)
    assert fused_ops.fp8_pending_of(kernels.fp8_linear(x, weight, scale, None, defer_scales=True)) is None
    bias = torch.zeros(32, device=DEVICE)
    assert fused_ops.fp8_pending_of(kernels.fp8_linear(x[0], weight, scale, bias, defer_scales=True)) is None
    assert fused_ops.fp8_pending_of(kernels.fp8_linear(x[0], weight, scale, None, defer_scales=True)) is not None


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 matmuls need a GPU with FP8 tensor cores")
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_cuda_the_deferred_gemm_through_the_norm_is_within_rounding_of_the_scaled_one(rows):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    n, k = 4096, 14336
    weight = (torch.randn(n, k, generator=gen, device="cuda") * 40).to(torch.float8_e4m3fn)
    weight_scale = torch.rand(n, generator=gen, device="cuda") * 1e-3 + 1e-4
    x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
    residual = torch.randn(rows, n, generator=gen, device="cuda").to(torch.bfloat16)
    norm_weight = torch.ones(n, device="cuda", dtype=torch.bfloat16)
    got = fused_ops.rms_norm(
        kernels.fp8_linear(x, weight, weight_scale, None, defer_scales=True), norm_weight, 1e-5, residual
    )
    want = fused_ops.rms_norm(kernels.fp8_linear(x, weight, weight_scale, None), norm_weight, 1e-5, residual)
    for a, b in zip(got, want):  # the two GEMMs add in different orders: rounding apart (of the sums' size, where
        # a sum near zero keeps its addends' rounding)
        assert (a.float() - b.float()).abs().max() <= 2**-6 * b.float().abs().max()


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 matmuls need a GPU with FP8 tensor cores")
def test_cuda_the_engine_decodes_alike_with_and_without_deferred_scales(tiny, monkeypatch):
    config = {"model": str(tiny), "dtype": "bfloat16", "device": "cuda", "quant_config": {"quant_algo": "FP8"}}
    prompts = [[1, 5, 9, 14, 3], [7, 7, 2], list(range(2, 40))]
    outputs = []
    for deferred in (True, False):
        monkeypatch.setattr(fusion, "DEFER_SCALES", deferred)
        engine = EmbeddedEngine(EngineConfig.from_dict(config))
        try:
            assert bool(deferring(engine.core.model)) == deferred
            params = SamplingParams(max_tokens=8, end_id=-1)
            outputs.append([engine.generate(p, params).outputs[0].token_ids for p in prompts])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]  # the products differ by rounding only; a tiny model's greedy picks hold
