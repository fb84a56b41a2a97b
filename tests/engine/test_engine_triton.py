"""The engine with `attn_backend: TRITON` (the paged kernels of attention/triton_kernels.py; on CPU through Triton's
interpreter, on CUDA compiled): greedy output equal to Hugging Face's in fp32 on the tiny models (MHA with head
16, GQA, Qwen3's head 24), whole prompts, chunked prefill and preemption; random traffic (prefix reuse, chunks,
preemption, aborts, beams) and speculative draft trees equal to the portable engine's answers, eagerly and in CUDA
graphs (on CPU, eager runs of the padded forward a graph would hold)."""

import pytest
import torch

from ..spec_decode.test_engine_spec import (  # noqa: F401
    SETTINGS,
    assert_all_blocks_free,
    medusa_dir,
    methods,
    model_dir,
    other_draft_dir,
)
from ..spec_decode.test_engine_spec import make_engine as make_spec_engine
from ..traffic import mismatches, random_traffic, send
from .test_engine_parity import greedy, make_engine, tiny  # noqa: F401 (fixture)

TRITON = {"attn_backend": "TRITON"}


@pytest.mark.parametrize("fused", [False, True])
def test_prompts_together_and_chunked_match_hf(tiny, monkeypatch, request, fused):  # noqa: F811
    """fused: the norms, rotary and gated activations as fused_ops kernels too (the default on CUDA; on CPU
    Llama's MHA and Qwen3's head norms and head size 24 suffice, the interpreter being slow)."""
    import torch

    from tritonllm.engine.embedded import engine_core

    if fused and "qwen2" in request.node.name and not torch.cuda.is_available():
        pytest.skip("fused kernels on CPU: Llama and Qwen3 cover them")
    monkeypatch.setattr(engine_core, "fused_kernels_wanted", lambda backend, device: fused)
    model_dir, tokenizer, prompt_ids, expected = tiny
    for overrides in ({}, {"enable_chunked_prefill": True, "max_num_tokens": 8}):
        engine = make_engine(model_dir, **TRITON, **overrides)
        try:
            assert engine.core.runner.kernels is not None
            assert engine.core.model.layers[0].mlp.fused is fused
            handles = [engine.generate_async(ids, greedy(tokenizer)) for ids in prompt_ids]
            assert [h.result().outputs[0].token_ids for h in handles] == expected
            engine.wait_idle()
        finally:
            engine.shutdown()


@pytest.fixture(scope="module")
def solo(model_dir):  # noqa: F811
    engine = make_spec_engine(model_dir, max_beam_width=2, cuda_graph_config=None, attn_backend="VANILLA")
    yield engine
    engine.shutdown()


# Few cases, short contexts: the interpreter runs each kernel program in Python.
@pytest.mark.parametrize(
    "method, setting, seed, graphs",
    [(None, "chunked_reuse", 41, False), (None, "preempting", 42, True), ("medusa", "preempting", 43, True)],
)
def test_traffic_and_draft_trees_keep_the_portable_answers(
    model_dir,
    other_draft_dir,
    medusa_dir,
    solo,  # noqa
    request,
    method,
    setting,
    seed,
    graphs,
):
    if graphs:
        request.getfixturevalue("graphs_on_this_device")
    spec = methods(model_dir, other_draft_dir, medusa_dir)[method] if method else None
    traffic = random_traffic(seed, count=16, vocab=400, beams=spec is None)
    engine = make_spec_engine(
        model_dir,
        spec,
        max_beam_width=1 if spec else 2,
        max_seq_len=128,
        **TRITON,
        **SETTINGS[setting],
        **({} if graphs else {"cuda_graph_config": None}),
    )
    try:
        results = send(engine, traffic)
        assert_all_blocks_free(engine)
        if graphs:
            assert engine.core.runner.graphs.replays > 0
    finally:
        engine.shutdown()
    assert mismatches(solo, traffic, results) == []


FP8_CACHE = {"dtype": "fp8"}


@pytest.fixture(scope="module")
def solo_fp8(model_dir):  # noqa: F811
    engine = make_spec_engine(
        model_dir,
        max_beam_width=2,
        cuda_graph_config=None,
        attn_backend="VANILLA",
        kv_cache_config={"tokens_per_block": 4, "max_tokens": 4096, **FP8_CACHE},
    )
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "method, setting, seed, graphs", [(None, "chunked_reuse", 51, False), ("medusa", "preempting", 52, True)]
)
def test_an_fp8_cache_gives_the_portable_answers_through_the_kernels(
    model_dir,  # noqa: F811
    other_draft_dir,  # noqa: F811
    medusa_dir,  # noqa: F811
    solo_fp8,
    request,
    monkeypatch,
    method,
    setting,
    seed,
    graphs,
):
    """kv_cache_config.dtype fp8: the kernels (store, prefill, decode, draft trees; in graphs too) answer what the
    portable path answers over its own FP8 cache, through prefix reuse, chunks, preemption, aborts and beams. On CPU
    the store is write_kv's: Triton's interpreter rounds to float8 wrongly where rounding carries into the exponent
    (test_fp8_kv_cache.py checks the store kernel on values it rounds right; ci/gpu_fp8_kv.py on any)."""
    if not torch.cuda.is_available():
        from tritonllm.engine.embedded.attention import triton_kernels, write_kv

        monkeypatch.setattr(triton_kernels, "store_kv", write_kv)
    if graphs:
        request.getfixturevalue("graphs_on_this_device")
    spec = methods(model_dir, other_draft_dir, medusa_dir)[method] if method else None
    traffic = random_traffic(seed, count=8, vocab=400, beams=spec is None)
    settings = dict(SETTINGS[setting])
    settings["kv_cache_config"] = {**settings["kv_cache_config"], **FP8_CACHE}
    engine = make_spec_engine(
        model_dir,
        spec,
        max_beam_width=1 if spec else 2,
        max_seq_len=128,
        **TRITON,
        **settings,
        **({} if graphs else {"cuda_graph_config": None}),
    )
    try:
        assert all(cache.dtype == torch.float8_e4m3fn for pair in engine.core.runner.kv_caches for cache in pair)
        results = send(engine, traffic)
        assert_all_blocks_free(engine)
        if graphs:
            assert engine.core.runner.graphs.replays > 0
    finally:
        engine.shutdown()
    assert mismatches(solo_fp8, traffic, results) == []


def test_attn_backend_is_checked_and_resolved_per_device(monkeypatch):
    import torch

    from tritonllm.engine.config import ConfigError, EngineConfig
    from tritonllm.engine.embedded.attention import resolve_backend

    assert EngineConfig.from_dict({"model": "m", "attn_backend": "triton"}).attn_backend == "TRITON"
    with pytest.raises(ConfigError, match="attn_backend must be one of"):
        EngineConfig.from_dict({"model": "m", "attn_backend": "fast"})
    with pytest.raises(ConfigError, match="load_format must be one of"):
        EngineConfig.from_dict({"model": "m", "load_format": "random"})
    assert any(
        "FLASHINFER" in p
        for p in EngineConfig.from_dict({"model": "m", "attn_backend": "FLASHINFER"}).embedded_unsupported()
    )
    assert resolve_backend("TRTLLM", torch.device("cpu")) == "VANILLA"  # the CPU's fastest is the portable path
    assert resolve_backend("VANILLA", torch.device("cuda")) == "VANILLA"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON.*CUDA device"):
        resolve_backend("TRITON", torch.device("cpu"))
