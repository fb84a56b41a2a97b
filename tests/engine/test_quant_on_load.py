"""Quantization on load of an unquantized checkpoint (model.yaml's quant_config), and of dummy weights.

Two checks per algorithm. Exact: the quantized model's logits equal those of the unquantized model given the
dequantized weights (formats.py's dequantizers), to 1e-4 for the weight-only W8A16 / W4A16. Quality: its logits
stay within a relative L2 distance of the unquantized model's. The tiny random models are built to spread their
logits widely and amplify error (measured over llama, qwen3, phi3, mixtral and two seeds: W8A16 0.02-0.03, FP8
0.10-0.22, W4A16 group 32 0.27-0.51), so the bounds are those measurements with headroom, not what a trained
model shows."""

import pytest
import torch

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.loader import load_model
from tritonllm.engine.embedded.network.model_config import ModelLoadError
from tritonllm.engine.embedded.quant.formats import dequantize_fp8, dequantize_int4, dequantize_int8
from tritonllm.engine.embedded.quant.linear import QuantLinear
from tritonllm.engine.types import SamplingParams

from .test_model_code import PROMPT, empty_caches, prefill
from .test_quant_checkpoints import greedy

RELATIVE_BOUND = {"FP8": 0.3, "FP8_PER_CHANNEL_PER_TOKEN": 0.3, "W8A16": 0.06, "W4A16": 0.6}
KINDS = {"FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8", "W8A16": "int8", "W4A16": "int4"}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), seed=0, arch=request.param)


def quant_config(algo: str) -> dict:
    return {"quant_algo": algo, "group_size": 32}  # 128 divides none of the tiny model's 64 / 160 columns


def dequantized(module: QuantLinear) -> torch.Tensor:
    if module.kind == "fp8":
        return dequantize_fp8(module.weight, module.weight_scale)
    if module.kind == "int8":
        return dequantize_int8(module.weight, module.weight_scale, module.group_size)
    return dequantize_int4(module.qweight, module.weight_scale, module.weight_zero, module.group_size)


def with_dequantized_weights(dense_model, quantized_model):
    """`dense_model` given the dequantized weight of each of `quantized_model`'s quantized projections."""
    for name, module in quantized_model.named_modules():
        if isinstance(module, QuantLinear):
            target = dense_model.get_submodule(name)
            target.weight.data.copy_(dequantized(module))
            target.pack_for_cpu()  # the fp32 CPU path matmuls a prepacked copy
    return dense_model


@pytest.mark.parametrize("algo", list(KINDS))
def test_quantized_on_load(tiny, algo):
    reference, config = load_model(tiny, torch.float32, "cpu")
    model, _ = load_model(tiny, torch.float32, "cpu", quant_config=quant_config(algo))
    modules = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(modules) == 4 * config.num_layers and {m.kind for m in modules} == {KINDS[algo]}
    assert not isinstance(model.lm_head, QuantLinear)  # None when tied to the embedding (qwen3)
    logits, _ = prefill(model, config, PROMPT)
    expected, _ = prefill(reference, config, PROMPT)
    assert ((logits - expected).norm() / expected.norm()) < RELATIVE_BOUND[algo]
    if KINDS[algo] != "fp8":  # fp8 quantizes activations too: no dense twin computes the same
        twin, _ = prefill(with_dequantized_weights(reference, model), config, PROMPT)
        torch.testing.assert_close(logits, twin, atol=1e-4, rtol=1e-4)


def test_w4a16_in_bfloat16_keeps_its_scales_in_the_model_dtype(tiny):
    model, config = load_model(tiny, torch.bfloat16, "cpu", quant_config=quant_config("W4A16"))
    module = model.layers[0].self_attn.qkv_proj
    assert module.weight_scale.dtype == torch.bfloat16 and module.qweight.dtype == torch.uint8
    fp32, _ = load_model(tiny, torch.float32, "cpu", quant_config=quant_config("W4A16"))
    caches = [(k.bfloat16(), v.bfloat16()) for k, v in empty_caches(config, 6)]
    logits, _ = prefill(model, config, PROMPT, caches)
    expected, _ = prefill(fp32, config, PROMPT)
    assert logits.dtype == torch.float32 and ((logits - expected).norm() / expected.norm()) < 0.1


def test_exclude_modules_keeps_those_projections_dense(tiny):
    config = {**quant_config("W8A16"), "exclude_modules": ["*.mlp.down_proj"]}
    model, _ = load_model(tiny, torch.float32, "cpu", quant_config=config)
    assert not isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear)
    with pytest.raises(ModelLoadError, match="q_proj is left unquantized but is fused with quantized parts"):
        load_model(tiny, torch.float32, "cpu", quant_config={**config, "exclude_modules": ["*q_proj"]})


def test_a_group_size_that_does_not_divide_the_columns_is_an_error(tiny):
    with pytest.raises(ModelLoadError, match="group_size=128 does not divide the 64 input columns of model.layers.0"):
        load_model(tiny, torch.float32, "cpu", quant_config={"quant_algo": "W4A16"})


@pytest.mark.parametrize("algo", ["FP8", "W8A16", "W4A16"])
def test_dummy_weights_are_quantized_too(tiny, algo):
    first, config = load_model(tiny, torch.float32, "cpu", "dummy", quant_config(algo))
    second, _ = load_model(tiny, torch.float32, "cpu", "dummy", quant_config(algo))
    modules = [m for m in first.modules() if isinstance(m, QuantLinear)]
    assert len(modules) == 4 * config.num_layers
    assert all(bool(m.weight_scale.abs().min() > 0) for m in modules)  # every row filled and quantized
    logits, _ = prefill(first, config, PROMPT)
    again, _ = prefill(second, config, PROMPT)
    assert torch.isfinite(logits).all() and torch.equal(logits, again)  # seeded: the same model twice


def test_the_engine_generates_with_quant_config(tiny):
    model, config = load_model(tiny, torch.float32, "cpu", quant_config=quant_config("W4A16"))
    expected = greedy(model, config, PROMPT[:6], 8)
    engine = EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(tiny),
                "dtype": "float32",
                "device": "cpu",
                "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 512},
                "quant_config": quant_config("W4A16"),
            }
        )
    )
    try:
        out = engine.generate(PROMPT[:6], SamplingParams(max_tokens=8, end_id=-1))
        assert out.outputs[0].token_ids == expected
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "spec",
    [
        {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2},
        {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": "SELF"},
    ],
    ids=["ngram", "draft_target"],
)
@pytest.mark.parametrize("algo", ["W4A16", "FP8"])
def test_speculation_over_quantized_weights_is_plain_greedy(tiny, algo, spec):
    """Drafts verified by the quantized target: the output is the quantized model's own greedy output, and every
    block comes back. The draft model (here the same checkpoint) loads unquantized: quant_config is the target's,
    so some of its drafts are rejected."""
    spec = {k: (str(tiny) if v == "SELF" else v) for k, v in spec.items()}
    prompt = PROMPT[:6] * 3  # repeats give the n-gram drafter something to propose
    model, config = load_model(tiny, torch.float32, "cpu", quant_config=quant_config(algo))
    expected = greedy(model, config, prompt, 12)
    args = {
        "model": str(tiny),
        "dtype": "float32",
        "device": "cpu",
        "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 1024},
        "quant_config": quant_config(algo),
        "speculative_config": spec,
    }
    engine = EmbeddedEngine(EngineConfig.from_dict(args))
    try:
        out = engine.generate(prompt, SamplingParams(max_tokens=12, end_id=-1))
        assert out.outputs[0].token_ids == expected
        stats = engine.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()
