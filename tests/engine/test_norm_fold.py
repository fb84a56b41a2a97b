"""RMSNorms folded into one-row int4 GEMVs (quant/norm_fold.py): the producer's epilogue (the residual add, h * g,
the sum of squares into the ring's slots, the stale slots zeroed), the reader's 1 / rms, the whole hand-over
against the unfolded norm, and a W4A16 model's one-token steps with and without folds (quant/fusion.py installs
them). The kernels run on TRITONLLM_TEST_DEVICE: compiled on CUDA, in Triton's interpreter on CPU."""

import os

import pytest
import torch

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.loader import load_model
from tritonllm.engine.embedded.network.layers import RMSNorm, use_fused_kernels
from tritonllm.engine.embedded.quant import fusion, kernels, norm_fold
from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode
from tritonllm.engine.embedded.quant.formats import dequantize_int4
from tritonllm.engine.embedded.quant.linear import QuantLinear
from tritonllm.engine.types import SamplingParams

from .test_quant_kernels import random_int4, random_x

DEVICE = torch.device(os.environ.get("TRITONLLM_TEST_DEVICE", "cpu"))
EPS = 1e-5


def _norm_reference(y, residual, weight, eps=EPS):
    """layers.RMSNorm with a residual, unfused: (normed, h) in y's dtype."""
    norm = RMSNorm(weight.shape[0], eps).to(y.device)
    norm.weight.data = weight.clone()
    return norm(y, residual=residual)


def _problem(n, k, group_size, dtype, seed):
    qweight, scale, zero = random_int4(n, k, group_size, dtype, seed=seed)
    generator = torch.Generator().manual_seed(seed + 10)
    residual = torch.randn(1, n, generator=generator).to(dtype).to(DEVICE)
    weight = (torch.rand(n, generator=generator) + 0.5).to(dtype).to(DEVICE)
    return qweight, scale, zero, residual, weight


def _fold(residual, weight, slots):
    fold = norm_fold.NormFold(weight, EPS, slots[1], slots[0])
    return fold.output(residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k, group_size", [(48, 64, 32), (40, 96, 32)])
def test_the_producer_adds_the_residual_and_begins_the_norm(dtype, n, k, group_size):
    qweight, scale, zero, residual, weight = _problem(n, k, group_size, dtype, seed=n)
    x = random_x(1, k, dtype)
    slots = torch.full((2, norm_fold.SLOTS), 7.0, device=DEVICE)
    slots[1].zero_()
    folding = _fold(residual, weight, slots)
    hg = kernels.int4_one_row(x, qweight, scale, zero, None, group_size, folding=folding)
    y = kernels.int4_one_row(x, qweight, scale, zero, None, group_size)  # the same GEMV, unfolded
    h = (y.float() + residual.float()).to(dtype)
    torch.testing.assert_close(folding.h_out, h, rtol=0, atol=0)
    torch.testing.assert_close(hg, (h.float() * weight.float()).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(slots[1].sum(), h.float().pow(2).sum(), rtol=1e-5, atol=1e-5)
    assert (slots[1] != 0).sum() > 1  # the programs' adds spread over the slots
    assert not slots[0].any()  # the previous fold's slots zeroed for their next producer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reader_scales_its_product_by_one_over_the_rms(dtype):
    n, k, group_size = 40, 64, 32
    qweight, scale, zero = random_int4(n, k, group_size, dtype, seed=3)
    x = random_x(1, k, dtype)
    sums = torch.rand(norm_fold.SLOTS, generator=torch.Generator().manual_seed(4)).to(DEVICE) * 9
    folded = norm_fold.FoldedInput(sums, EPS)
    got = kernels.int4_one_row(x, qweight, scale, zero, None, group_size, folded_input=folded)
    dense = dequantize_int4(qweight, scale.float(), zero, group_size)
    expected = (x.float() @ dense.T) * torch.rsqrt(sums.sum() / k + EPS)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_producer_then_reader_equal_the_unfolded_norm_between_them(dtype):
    """o_proj -> norm -> gate_up: folded, the reader's output is the unfolded chain's within the normed input's
    rounding (the norm rounds h / rms then * g; the fold rounds h * g)."""
    k, n, n_out, group_size = 96, 64, 48, 32
    qweight, scale, zero, residual, weight = _problem(n, k, group_size, dtype, seed=5)
    q2, s2, z2 = random_int4(n_out, n, group_size, dtype, seed=6)
    x = random_x(1, k, dtype)
    slots = torch.zeros((2, norm_fold.SLOTS), device=DEVICE)
    folding = _fold(residual, weight, slots)
    hg = kernels.int4_one_row(x, qweight, scale, zero, None, group_size, folding=folding)
    got = kernels.int4_one_row(hg, q2, s2, z2, None, group_size, folded_input=norm_fold.FoldedInput(slots[1], EPS))

    y = kernels.int4_one_row(x, qweight, scale, zero, None, group_size)
    normed, h = _norm_reference(y, residual, weight)
    expected = kernels.int4_one_row(normed, q2, s2, z2, None, group_size)
    torch.testing.assert_close(folding.h_out, h, rtol=0, atol=0)
    # fp32: the kernel's magic-value sums lose a few bits (int4_decode_kernel.py), more for h * g's magnitudes
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    unfolded = norm_fold.unfold(hg, norm_fold.FoldedInput(slots[1], EPS))  # for a reader that cannot scale
    torch.testing.assert_close(unfolded, normed, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "variant",
    [
        kernels.word_gemv(16, 128, 1),  # the word GEMV: the residual read after its loop
        int4_decode.DecodeVariant(block_m=1, block_n=32, block_k=32, num_warps=1, use_dot=False),  # bytes
    ],
    ids=["words", "bytes"],
)
def test_the_other_one_row_gemvs_fold_alike(variant):
    n, k, group_size = 40, 128, 32
    qweight, scale, zero, residual, weight = _problem(n, k, group_size, torch.float32, seed=8)
    x = random_x(1, k)
    slots = torch.zeros((2, norm_fold.SLOTS), device=DEVICE)
    folding = _fold(residual, weight, slots)
    hg = int4_decode.int4_decode_matmul(x, qweight, scale, zero, None, group_size, variant, folding=folding)
    y = int4_decode.int4_decode_matmul(x, qweight, scale, zero, None, group_size, variant)
    h = y + residual
    torch.testing.assert_close(folding.h_out, h, rtol=0, atol=0)
    torch.testing.assert_close(hg, h * weight, rtol=0, atol=0)
    torch.testing.assert_close(slots[1].sum(), h.pow(2).sum(), rtol=1e-5, atol=1e-5)


def test_a_fold_refuses_a_split_or_several_rows():
    qweight, scale, zero, residual, weight = _problem(48, 64, 32, torch.float32, seed=7)
    folding = _fold(residual, weight, torch.zeros((2, norm_fold.SLOTS), device=DEVICE))
    with pytest.raises(ValueError, match="takes one row of x, got 2"):
        kernels.int4_one_row(random_x(2, 64), qweight, scale, zero, None, 32, folding=folding)
    split = kernels.lane_gemv(4, 1, split_k=2)
    with pytest.raises(ValueError, match="folds into one row's GEMV without split K"):
        int4_decode.int4_decode_matmul(random_x(1, 64), qweight, scale, zero, None, 32, split, folding=folding)
    with pytest.raises(ValueError, match="two folds at least"):
        norm_fold.ring(1, DEVICE)


# ---- a model's steps ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), seed=0, arch="llama")


def _w4a16(tiny):
    model, _ = load_model(tiny, torch.float32, str(DEVICE), quant_config={"quant_algo": "W4A16", "group_size": 32})
    use_fused_kernels(model)
    return model


def _one_token_steps(model, tokens):
    """Hidden states of one-token forwards at positions 0, 1, ... (no cache reads: each step is its own)."""
    outputs = []
    for token in tokens:
        hidden = model.embed(torch.tensor([token], device=DEVICE))
        residual = None
        for layer in model.decoder_layers:
            hidden, residual = _layer_without_attention(layer, hidden, residual)
        outputs.append(model.norm(hidden, residual=residual)[0])
    return outputs


def _layer_without_attention(layer, delta, residual):
    """LlamaDecoderLayer.deferred with attention's core replaced by its input (the folds sit in the projections
    and norms around it): qkv_proj's q slice stands in for attention's output."""
    attention = layer.self_attn

    def attend(hidden, *args, residual=None, **kwargs):
        q = attention.qkv_proj(hidden)[..., : attention.o_proj.in_features].contiguous()
        return attention.o_proj(q) if residual is None else attention.o_proj(q, residual=residual)

    original = attention.forward
    attention.forward = attend
    try:
        return layer.deferred(delta, residual, None, None, None, None)
    finally:
        attention.forward = original


def test_a_w4a16_model_folds_every_norm_between_its_int4_projections_or_none(tiny, monkeypatch):
    model = _w4a16(tiny)
    assert fusion.FOLD_NORMS
    assert fusion.fold_int4_norms(model, torch.device("cpu"), lora_enabled=False) == 0  # CUDA's only
    cuda = torch.device("cuda")  # (fold_int4_norms only reads its type; install_norm_folds below takes DEVICE)
    assert fusion.fold_int4_norms(model, cuda, lora_enabled=True) == 0
    monkeypatch.setattr(fusion, "FOLD_NORMS", False)
    assert fusion.fold_int4_norms(model, cuda, lora_enabled=False) == 0
    assert fusion.install_norm_folds(model, DEVICE) == 3  # two layers: o_proj, down_proj, o_proj
    names = [name for name, m in model.named_modules() if isinstance(m, QuantLinear) and m.norm_fold is not None]
    assert names == ["layers.0.self_attn.o_proj", "layers.0.mlp.down_proj", "layers.1.self_attn.o_proj"]
    unquantized, _ = load_model(tiny, torch.float32, str(DEVICE))
    assert fusion.install_norm_folds(unquantized, DEVICE) == 0


def test_folded_one_token_steps_match_unfolded_ones_step_after_step(tiny):
    """Three one-token steps through both models: the same hidden states within rounding, the third as the first
    (same token), so the ring's slots were zeroed between steps."""
    plain, folded = _w4a16(tiny), _w4a16(tiny)
    assert fusion.install_norm_folds(folded, DEVICE) == 3
    for model in (plain, folded):  # both take the one-row kernel, so only the folds differ
        for module in model.modules():
            if isinstance(module, QuantLinear):
                module.forward = _one_row_forward(module)
    tokens = [5, 9, 5]
    expected, got = _one_token_steps(plain, tokens), _one_token_steps(folded, tokens)
    for want, have in zip(expected, got):  # (each ~8e-4 off exact fp32 products at |8|: the kernel's own sums)
        torch.testing.assert_close(have, want, rtol=1e-3, atol=2e-3)
    torch.testing.assert_close(got[2], got[0], rtol=0, atol=0)
    last = list(folded.decoder_layers)[-1].self_attn.o_proj.norm_fold
    assert last.sums.any() and not last.stale.any()  # the folds ran: the last one's sum is still there


def _one_row_forward(module):
    original = module.forward

    def forward(x, residual=None):
        if norm_fold.folded_input_of(x) is not None or (residual is not None and module.norm_fold is not None):
            return original(x, residual=residual)
        assert module.qweight is not None and module.weight_zero is not None
        return kernels.int4_one_row(
            x, module.qweight, module.weight_scale, module.weight_zero, module.bias, module.group_size
        )

    return forward


def w4a16_greedy_tokens_on_cuda(tiny, check_model) -> list[list[int]]:
    """Greedy tokens of three prompts, one request at a time (one-row decode steps, in CUDA graphs), from a W4A16
    engine over `tiny`; check_model(model) runs on its network first."""
    quant = {"quant_algo": "W4A16", "group_size": 32}
    config = {"model": str(tiny), "dtype": "float32", "device": "cuda", "quant_config": quant}
    prompts = [[1, 5, 9, 14, 3], [7, 7, 2], list(range(2, 40))]
    engine = EmbeddedEngine(EngineConfig.from_dict(config))
    try:
        check_model(engine.core.model)
        params = SamplingParams(max_tokens=12, end_id=-1)
        return [engine.generate(p, params).outputs[0].token_ids for p in prompts]
    finally:
        engine.shutdown()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine folds norms on CUDA only")
def test_cuda_the_engine_decodes_alike_with_and_without_folded_norms(tiny, monkeypatch):
    """One request at a time (one-row decode steps, in CUDA graphs): the same greedy tokens folded or not."""
    outputs = []
    for folded in (True, False):
        monkeypatch.setattr(fusion, "FOLD_NORMS", folded)

        def check(model, folded=folded):
            assert any(getattr(m, "norm_fold", None) is not None for m in model.modules()) == folded

        outputs.append(w4a16_greedy_tokens_on_cuda(tiny, check))
    assert outputs[0] == outputs[1]
