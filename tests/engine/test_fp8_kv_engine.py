"""The engine with an FP8 KV cache (kv_cache_config.dtype: fp8) on a tiny model, on CPU through the portable path:
the config's switch and its errors, the cache's element type and block count in a fixed byte budget, logits
close to the unquantized cache's over chunked prefill and decode, every block freed after aborts, and per-layer
k/v scales read from checkpoint tensors (and used: absurd ones wreck the output)."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import ConfigError, EngineConfig, kv_cache_fp8
from tritonllm.engine.embedded import device as device_module
from tritonllm.engine.embedded.attention.fp8_cache import dequantize, quantize
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.engine_core import EngineCore
from tritonllm.engine.embedded.loader import ModelLoadError, load_model
from tritonllm.engine.embedded.network import llama
from tritonllm.engine.types import SamplingParams

FP8 = torch.float8_e4m3fn
BLOCK = 4
# Relative (norm) error of the logits with an FP8 cache against the unquantized cache's (measured: 0.14).
UNQUANTIZED_TOLERANCE = 0.25


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3)


def config(model_dir, kv_dtype="auto", dtype="float32", **extra):
    kv = {"tokens_per_block": BLOCK, "dtype": kv_dtype, "max_tokens": 1024, **extra.pop("kv", {})}
    args = {"model": str(model_dir), "dtype": dtype, "device": "cpu", "kv_cache_config": kv, **extra}
    return EngineConfig.from_dict(args)


def test_kv_cache_dtype_is_checked_and_quant_config_turns_fp8_on():
    with pytest.raises(ConfigError, match=r"kv_cache_config\.dtype must be one of \('auto', 'fp8'\), got 'int8'"):
        EngineConfig.from_dict({"model": "m", "kv_cache_config": {"dtype": "int8"}})
    assert kv_cache_fp8(EngineConfig.from_dict({"model": "m", "kv_cache_config": {"dtype": "fp8"}}))
    assert not kv_cache_fp8(EngineConfig(model="m"))
    quantized = EngineConfig.from_dict({"model": "m", "quant_config": {"kv_cache_quant_algo": "FP8"}})
    assert kv_cache_fp8(quantized)
    weights_only = EngineConfig.from_dict({"model": "m", "quant_config": {"quant_algo": "W8A16"}})
    assert not kv_cache_fp8(weights_only)


def test_kernels_on_gpus_without_float8_conversions_are_refused_by_name(monkeypatch):
    """Triton's float8 e4m3 conversions need compute capability 8.9; the portable path runs on older GPUs."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    fp8 = EngineConfig.from_dict({"model": "m", "kv_cache_config": {"dtype": "fp8"}})
    cuda = torch.device("cuda")
    with pytest.raises(ConfigError, match=r"kv_cache_config.dtype='fp8' with the Triton .* 8.9 or newer.* is 8.0"):
        device_module.resolve_kv_cache_dtype(fp8, torch.bfloat16, cuda, "TRITON")
    assert device_module.resolve_kv_cache_dtype(fp8, torch.bfloat16, cuda, "VANILLA") == FP8
    assert (
        device_module.resolve_kv_cache_dtype(EngineConfig(model="m"), torch.bfloat16, cuda, "TRITON") == torch.bfloat16
    )


@pytest.mark.parametrize("dtype, ratio", [("float32", 4), ("bfloat16", 2)])
def test_an_fp8_cache_holds_more_blocks_in_the_same_bytes(tiny, monkeypatch, dtype, ratio):
    """Sized by free memory (no max_tokens): the same bytes hold 4x the blocks of an fp32 cache, 2x a bf16 one."""
    monkeypatch.setattr(device_module, "available_memory_bytes", lambda device: 2**20)
    blocks = {}
    for kv_dtype in ("auto", "fp8"):
        core = EngineCore(config(tiny, kv_dtype, dtype, kv={"max_tokens": None}, max_batch_size=256))
        caches = core.runner.kv_caches
        assert all(c.dtype == (FP8 if kv_dtype == "fp8" else getattr(torch, dtype)) for pair in caches for c in pair)
        blocks[kv_dtype] = core.block_manager.num_blocks
        cache_bytes = sum(c.numel() * c.element_size() for pair in caches for c in pair)
        assert cache_bytes <= 0.9 * 2**20
    assert blocks["fp8"] == pytest.approx(ratio * blocks["auto"], abs=ratio)


def _logits(model_dir, kv_dtype, prompt):
    """Context logits (chunked prefill: later chunks read the cache) and greedy decode's tokens and logits."""
    engine = EmbeddedEngine(
        config(model_dir, kv_dtype, max_num_tokens=8, enable_chunked_prefill=True, max_batch_size=4)
    )
    try:
        params = SamplingParams(
            max_tokens=12, ignore_eos=True, return_context_logits=True, return_generation_logits=True
        )
        out = engine.generate(prompt, params)
        return out.context_logits, out.outputs[0].token_ids, out.outputs[0].generation_logits
    finally:
        engine.shutdown()


def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def _round_kv_on_the_way_in(monkeypatch):
    """Every layer's attention sees its K/V rounded as an FP8 cache rounds them, over a full-precision cache."""
    real = llama.paged_attention

    def rounded(
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta,
        scale,
        window=None,
        softcap=None,
        k_scale=1.0,
        v_scale=1.0,
        rotary=None,
        stored=False,
    ):
        assert rotary is None  # (the rotation before the store would come after this rounding)
        assert not stored  # (nor may a projection have stored them)
        k = dequantize(quantize(k, k_scale), k_scale, k.dtype)
        v = dequantize(quantize(v, v_scale), v_scale, v.dtype)
        return real(q, k, v, k_cache, v_cache, meta, scale, window, softcap)

    monkeypatch.setattr(llama, "paged_attention", rounded)


def test_the_engine_with_an_fp8_cache_equals_one_over_rounded_values(tiny, monkeypatch):
    """The whole engine (chunked prefill whose later chunks read the cache, then decode) with an FP8 cache computes
    what it computes over an fp32 cache holding the same rounded K/V: only the storage differs."""
    prompt = list(range(5, 35))
    context, tokens, generation = _logits(tiny, "fp8", prompt)
    _round_kv_on_the_way_in(monkeypatch)
    ref_context, ref_tokens, ref_generation = _logits(tiny, "auto", prompt)
    assert tokens == ref_tokens
    assert _relative(context, ref_context) < 1e-5
    assert _relative(generation, ref_generation) < 1e-5


def test_logits_stay_near_the_unquantized_cache(tiny):
    """Against the unquantized cache, rounding K/V to 3 mantissa bits costs this tiny random model (sharp
    attention: its scores spread ~16 wide) about 14% of the logits' norm and flips about a fifth of the prompt
    positions' top token; allowed: 25% and two fifths. (SmolLM2-135M, measured once on CPU: 7% and none flipped;
    too slow to load for CI.)"""
    prompt = list(range(5, 35))
    context, _, _ = _logits(tiny, "fp8", prompt)
    ref_context, _, _ = _logits(tiny, "auto", prompt)
    assert 0 < _relative(context, ref_context) < UNQUANTIZED_TOLERANCE
    assert (context.argmax(-1) == ref_context.argmax(-1)).float().mean() >= 0.6


def test_aborted_requests_free_every_block(tiny):
    engine = EmbeddedEngine(config(tiny, "fp8", max_batch_size=8))
    try:
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        handles = [engine.generate_async(list(range(3, 3 + 9 * i)), long) for i in range(1, 5)]
        finished = engine.generate(list(range(40, 60)), SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(finished.outputs[0].token_ids) == 6
        for handle in handles:
            handle.abort()
        stats = engine.wait_idle(timeout=60)
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()


def _with_tensors(model_dir, out_dir, extra):
    """A copy of the model folder whose safetensors also hold `extra`."""
    out_dir.mkdir()
    for path in model_dir.iterdir():
        if path.name != "model.safetensors":
            (out_dir / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    save_file({**tensors, **extra}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def test_kv_scales_are_read_from_each_exporters_tensor_names(tiny, tmp_path):
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),  # compressed-tensors
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([2.0]),  # older FP8 exports
        "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(4.0, dtype=torch.bfloat16),  # ModelOpt
    }
    model, _ = load_model(_with_tensors(tiny, tmp_path / "scaled", scales), torch.float32, "cpu")
    attention = [layer.self_attn for layer in model.layers]
    assert [(a.k_scale, a.v_scale) for a in attention] == [(0.5, 0.25), (2.0, 4.0)]
    model, _ = load_model(tiny, torch.float32, "cpu")
    assert all((layer.self_attn.k_scale, layer.self_attn.v_scale) == (1.0, 1.0) for layer in model.layers)


@pytest.mark.parametrize(
    "name, tensor, message",
    [
        ("model.layers.0.self_attn.k_scale", torch.ones(4), r"k_scale has shape \[4\]; KV cache scales must be one"),
        (
            "model.layers.0.self_attn.v_scale",
            torch.tensor(-1.0),
            "v_scale is -1.0; a KV cache scale must be a positive number",
        ),
        ("model.layers.9.self_attn.k_scale", torch.tensor(1.0), "unexpected tensor model.layers.9.self_attn.k_scale"),
    ],
)
def test_bad_kv_scales_are_refused_by_name(tiny, tmp_path, name, tensor, message):
    with pytest.raises(ModelLoadError, match=message):
        load_model(_with_tensors(tiny, tmp_path / "bad", {name: tensor}), torch.float32, "cpu")


def test_the_checkpoints_scales_are_applied(tiny, tmp_path):
    """Scales that keep values in range change little; a v_scale so small that every value clamps at 448 * scale
    wrecks the output, so the cache really is written and read with the checkpoint's scales."""
    prompt = list(range(5, 35))
    ref_context, _, _ = _logits(tiny, "auto", prompt)
    fine = {
        f"model.layers.{i}.self_attn.{kind}": torch.tensor(0.5) for i in range(2) for kind in ("k_scale", "v_scale")
    }
    context, _, _ = _logits(_with_tensors(tiny, tmp_path / "fine", fine), "fp8", prompt)
    assert _relative(context, ref_context) < UNQUANTIZED_TOLERANCE
    crushed = {f"model.layers.{i}.self_attn.v_scale": torch.tensor(1e-5) for i in range(2)}
    context, _, _ = _logits(_with_tensors(tiny, tmp_path / "crushed", crushed), "fp8", prompt)
    assert _relative(context, ref_context) > 2 * UNQUANTIZED_TOLERANCE


def _greedy_batch(engine, prompts):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    return [h.result().outputs[0].token_ids for h in [engine.generate_async(p, params) for p in prompts]]


def test_portable_cuda_graphs_over_an_fp8_cache_keep_the_eager_answers(tiny, request):
    """The portable backend's graphs build their masks in the model's dtype (an FP8 cache's cannot hold -inf).
    This module's engines run on the CPU, where graphs are emulated; real captures over an FP8 cache are
    ci/gpu_fp8_kv.py's "graph" check."""
    if os.environ.get("TRITONLLM_TEST_DEVICE", "cpu") == "cuda":
        pytest.skip("this module's engines run on the CPU; ci/gpu_fp8_kv.py captures real graphs")
    prompts = [list(range(3, 3 + n)) for n in (5, 11, 17)]
    eager = EmbeddedEngine(config(tiny, "fp8", cuda_graph_config=None, max_batch_size=4))
    try:
        expected = _greedy_batch(eager, prompts)
    finally:
        eager.shutdown()
    request.getfixturevalue("graphs_on_this_device")
    engine = EmbeddedEngine(config(tiny, "fp8", max_batch_size=4))
    try:
        assert _greedy_batch(engine, prompts) == expected
        assert engine.core.runner.graphs.replays > 0
    finally:
        engine.shutdown()
