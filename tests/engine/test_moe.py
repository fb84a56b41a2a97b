"""Mixtures of experts (Mixtral, Qwen3-MoE, Qwen2-MoE) against Hugging Face transformers: the tiny models greedy in
fp32, token for token, alone, in one batch, in chunks and over reused prefixes; the fused Triton experts against the
portable loop on random inputs (through Triton's interpreter on CPU); LoRA on attention, speculative and guided
decoding on a mixture; and what a mixture cannot do, refused by name."""

import json
import os
import re

import pytest
import torch
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import TINY_SLIDING_WINDOW, build_tiny_model
from tritonllm.commands.main import main
from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.embedded.loader import ModelLoadError
from tritonllm.engine.embedded.network import fused_moe
from tritonllm.engine.embedded.network.model_config import ModelConfig
from tritonllm.engine.embedded.network.moe import (
    MoeForCausalLM,
    SparseMoeBlock,
    experts_dense,
    experts_portable,
    route,
)
from tritonllm.engine.types import GuidedDecodingParams, InvalidRequestError, LoRARequest, SamplingParams

from .test_engine_parity import PROMPTS, assert_all_blocks_free, greedy, hf_greedy, make_engine
from .test_sliding_window import run_all, with_config

MOE_ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe"]
MAX_NEW = 24


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe(request, tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), seed=1, arch=request.param)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = hf_greedy(model_dir, prompt_ids, MAX_NEW, tokenizer.eos_token_id)
    return model_dir, tokenizer, prompt_ids, expected


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("mixtral"), seed=2, arch="mixtral")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    return model_dir, tokenizer, prompt_ids, hf_greedy(model_dir, prompt_ids, MAX_NEW, tokenizer.eos_token_id)


# ---- the network, against transformers ----


def test_the_loader_builds_the_mixture_and_its_sparse_layers(moe):
    model_dir, *_ = moe
    engine = make_engine(model_dir)
    try:
        model = engine.core.model
        assert isinstance(model, MoeForCausalLM)
        blocks = [layer.mlp for layer in model.decoder_layers]
        sparse = [isinstance(block, SparseMoeBlock) for block in blocks]
        assert sparse == ([True, False] if engine.core.model_config.model_type == "qwen2_moe" else [True, True])
        assert (blocks[0].shared_expert is not None) == (engine.core.model_config.model_type == "qwen2_moe")
    finally:
        engine.shutdown()


def test_alone_and_batched_match_hf(moe):
    model_dir, tokenizer, prompt_ids, expected = moe
    assert len({tuple(out) for out in expected}) == len(expected)  # varied outputs: the check can fail
    engine = make_engine(model_dir)
    try:
        alone = [engine.generate(ids, greedy(tokenizer, MAX_NEW)).outputs[0].token_ids for ids in prompt_ids]
        assert alone == expected
        assert run_all(engine, tokenizer, prompt_ids, MAX_NEW) == expected
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_chunked_prefill_and_prefix_reuse_match_hf(moe):
    model_dir, tokenizer, prompt_ids, expected = moe
    kv = {"tokens_per_block": 8, "max_tokens": 4096, "enable_block_reuse": True}
    engine = make_engine(model_dir, enable_chunked_prefill=True, max_num_tokens=8, kv_cache_config=kv)
    try:
        assert run_all(engine, tokenizer, prompt_ids, MAX_NEW) == expected
        handles = [engine.generate_async(ids, greedy(tokenizer, MAX_NEW)) for ids in prompt_ids]
        second = [h.result() for h in handles]
        assert [o.outputs[0].token_ids for o in second] == expected
        assert sum(o.outputs[0].request_perf_metrics.kv_cache_reused_blocks for o in second) > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_mixtral_with_a_sliding_window_matches_hf(mixtral, tmp_path):
    """Mixtral's `sliding_window` (null in the tiny model) set to TINY_SLIDING_WINDOW: every layer slides, prompts
    longer than the window, as transformers does it."""
    model_dir, tokenizer, prompt_ids, full = mixtral
    windowed = with_config(model_dir, tmp_path / "windowed", sliding_window=TINY_SLIDING_WINDOW)
    expected = hf_greedy(windowed, prompt_ids, MAX_NEW, tokenizer.eos_token_id)
    assert expected != full and max(len(ids) for ids in prompt_ids) > 2 * TINY_SLIDING_WINDOW
    engine = make_engine(windowed)
    try:
        assert engine.core.attention_windows == (TINY_SLIDING_WINDOW,) * 2
        assert run_all(engine, tokenizer, prompt_ids, MAX_NEW) == expected
    finally:
        engine.shutdown()


def test_fused_experts_in_the_model_keep_hf_greedy_output(mixtral):
    """The sparse blocks switched to the Triton kernels (the interpreter on CPU), the rest as it is."""
    model_dir, tokenizer, prompt_ids, expected = mixtral
    engine = make_engine(model_dir)
    try:
        for module in engine.core.model.modules():
            if isinstance(module, SparseMoeBlock):
                module.fused = True
        assert run_all(engine, tokenizer, prompt_ids[2:3], MAX_NEW) == expected[2:3]
    finally:
        engine.shutdown()


# ---- the experts: fused kernels against the portable loop ----


def random_experts(tokens, hidden, inter, experts, top_k, dtype=torch.float32, seed=0):
    """Random inputs of one sparse block, on TRITONLLM_TEST_DEVICE (the kernel runs compiled on CUDA, interpreted on
    the CPU)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=generator) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=generator)
    weights, ids = route(logits, top_k, renormalize=True)
    device = torch.device(os.environ.get("TRITONLLM_TEST_DEVICE", "cpu"))
    return tuple(t.to(device) for t in (x, gate_up, down, weights, ids))


@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k",
    [(1, 32, 48, 4, 2), (7, 64, 40, 8, 2), (37, 48, 32, 8, 3), (5, 32, 16, 4, 4)],
)
def test_fused_experts_equal_the_portable_loop(tokens, hidden, inter, experts, top_k):
    x, gate_up, down, weights, ids = random_experts(tokens, hidden, inter, experts, top_k)
    expected = experts_portable(x, gate_up, down, weights, ids)
    got = fused_moe.fused_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(experts_dense(x, gate_up, down, weights, ids), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "tiles",
    [
        fused_moe.MoeTiles(32, fused_moe.Launch(16, 32), fused_moe.Launch(16, 16, 3, num_warps=2, num_stages=2)),
        fused_moe.MoeTiles(16, fused_moe.Launch(32, 16), fused_moe.Launch(32, 32, split_k=2)),
    ],
)
def test_every_launch_shape_computes_the_same(tiles):
    """The tile table may pick any shape: a K split of the down projection (parts added atomically) and other
    blocks give the loop's sums (up to the order of fp32 additions)."""
    x, gate_up, down, weights, ids = random_experts(11, 40, 72, 5, 2)
    expected = experts_portable(x, gate_up, down, weights, ids)
    got = fused_moe.fused_experts(x, gate_up, down, weights, ids, tiles)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_tile_table_covers_every_pair_count_and_never_splits_on_cpu():
    previous = 0
    for limit, _ in fused_moe.TILE_TABLE:
        assert limit > previous
        previous = limit
    for pairs in (1, 2, 16, 256, 257, 4096, 10**6):
        assert fused_moe.tiles_for(pairs, torch.device("cpu")).down.split_k == 1
        assert fused_moe.tiles_for(pairs, torch.device("cuda")).block_m >= 16
        wide = fused_moe.tiles_for(pairs, torch.device("cuda"), torch.float32)
        assert wide.block_m <= 64 and wide.gate_up == wide.down == fused_moe.Launch()  # fits shared memory in fp32


def test_fused_experts_in_bfloat16_are_close():
    x, gate_up, down, weights, ids = random_experts(9, 32, 48, 4, 2, dtype=torch.bfloat16)
    expected = experts_portable(x.float(), gate_up.float(), down.float(), weights, ids)
    got = fused_moe.fused_experts(x, gate_up, down, weights.to(torch.bfloat16), ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=1e-2, rtol=1e-2)


def test_alignment_gives_each_tile_one_expert_and_every_pair_once():
    ids = torch.tensor([[3, 0], [0, 1], [3, 0], [1, 3], [0, 2]])
    sorted_pairs, tile_experts, num_padded = fused_moe.align_by_expert(ids, 5, 4)
    flat = ids.flatten()
    real = sorted_pairs[sorted_pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    used = int(num_padded)
    assert used == 4 + 4 + 4 + 4  # experts 0 (4 pairs), 1 (2), 2 (1), 3 (3), each padded to 4; 4 gets none
    for tile in range(used // 4):
        rows = sorted_pairs[tile * 4 : tile * 4 + 4]
        rows = rows[rows < flat.numel()]
        assert set(flat[rows].tolist()) == {int(tile_experts[tile])}


def test_router_renormalises_the_top_k_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.softmax(logits, -1)[:, :2])
    renormalised, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(renormalised.sum(-1), torch.ones(1))


# ---- config.json ----


def raw_moe(**changes):
    raw = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        num_experts=8,
        num_experts_per_tok=2,
    )
    return {**raw, **changes}


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = ModelConfig.from_dict(raw_moe(decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True))
    assert config.moe is not None
    assert config.moe.sparse_layers == (False, True, False, False)
    assert (config.moe.num_experts, config.moe.top_k, config.moe.expert_intermediate_size) == (8, 2, 32)
    assert config.moe.norm_topk_prob and config.qk_norm
    mixtral = ModelConfig.from_dict(
        raw_moe(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4)
    )
    assert mixtral.moe is not None and mixtral.moe.norm_topk_prob and mixtral.moe.expert_intermediate_size == 128


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"num_experts": None}, "num_experts"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"mlp_only_layers": "0"}, "mlp_only_layers"),
        ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "num_local_experts"),
        ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}, "shared_expert_intermediate_size"),
        (
            {
                "architectures": ["Qwen2MoeForCausalLM"],
                "shared_expert_intermediate_size": 8,
                "use_sliding_window": True,
            },
            "use_sliding_window",
        ),
    ],
)
def test_bad_moe_settings_are_refused_naming_the_key(changes, key):
    with pytest.raises(ModelLoadError, match=key):
        ModelConfig.from_dict(raw_moe(**changes))


def test_moe_parallelism_is_accepted_at_one_and_refused_above(mixtral):
    model_dir, *_ = mixtral
    config = EngineConfig.from_dict({"model": str(model_dir), "moe_expert_parallel_size": 1})
    assert config.embedded_unsupported() == []
    for key in ("moe_expert_parallel_size", "moe_tensor_parallel_size"):
        assert any(key in problem for problem in EngineConfig.from_dict({"model": "m", key: 2}).embedded_unsupported())
        with pytest.raises(InvalidRequestError, match=key):
            make_engine(model_dir, **{key: 2})
    with pytest.raises(ConfigError, match="moe_tensor_parallel_size"):
        EngineConfig.from_dict({"model": "m", "moe_tensor_parallel_size": 0})


def test_tensorrt_llm_gets_the_moe_parallelism_only_when_set(monkeypatch):
    from tritonllm.engine import trtllm_args

    from .test_trtllm_adapter import load_fake

    fake = load_fake(monkeypatch)
    unset = trtllm_args.llm_kwargs(EngineConfig.from_dict({"model": "m", "engine": "tensorrt_llm"}), fake)
    assert "moe_expert_parallel_size" not in unset and "moe_tensor_parallel_size" not in unset
    config = EngineConfig.from_dict(
        {"model": "m", "engine": "tensorrt_llm", "moe_expert_parallel_size": 2, "moe_tensor_parallel_size": 1}
    )
    kwargs = trtllm_args.llm_kwargs(config, fake)
    assert (kwargs["moe_expert_parallel_size"], kwargs["moe_tensor_parallel_size"]) == (2, 1)


def test_tiny_command_writes_the_mixtures(tmp_path, capsys):
    for arch in ("mixtral", "qwen3_moe"):
        assert main(["model", "tiny", "--arch", arch, "--out", str(tmp_path / arch)]) == 0
        assert ModelConfig.from_dict(json.loads((tmp_path / arch / "config.json").read_text())).moe is not None


# ---- LoRA, speculative and guided decoding on a mixture ----


def test_lora_on_attention_matches_peft_and_on_experts_is_refused(mixtral, tmp_path):
    pytest.importorskip("peft")
    from ..lora.conftest import make_peft_adapter, merged_greedy

    model_dir, tokenizer, prompt_ids, base = mixtral
    adapter = make_peft_adapter(model_dir, tmp_path / "adapter", ["q_proj", "v_proj", "o_proj"], rank=4, seed=1)
    expected = merged_greedy(model_dir, adapter, prompt_ids[1:3], MAX_NEW, tokenizer.eos_token_id)
    assert expected != base[1:3]
    engine = make_engine(model_dir, enable_lora=True)
    try:
        assert "gate_proj" not in engine.core.lora.settings.lora_target_modules  # the default: attention only
        lora = LoRARequest("adapter", 7, str(adapter))
        got = [engine.generate(ids, greedy(tokenizer, MAX_NEW), lora).outputs[0].token_ids for ids in prompt_ids[1:3]]
        assert got == expected
    finally:
        engine.shutdown()
    for targets in (["attn_q", "mlp_h_to_4h"], ["down_proj"]):
        with pytest.raises(InvalidRequestError, match="lora_target_modules.*expert weights"):
            make_engine(model_dir, lora_config={"lora_target_modules": targets})


def test_lookahead_drafts_keep_hf_greedy_output(mixtral):
    model_dir, tokenizer, prompt_ids, expected = mixtral
    spec = {"decoding_type": "Lookahead", "max_window_size": 3, "max_ngram_size": 3, "max_verification_set_size": 3}
    engine = make_engine(model_dir, speculative_config=spec)
    try:
        assert run_all(engine, tokenizer, prompt_ids[1:4], MAX_NEW) == expected[1:4]
    finally:
        engine.shutdown()


def test_ngram_drafts_keep_hf_greedy_output(moe):
    model_dir, tokenizer, prompt_ids, expected = moe
    spec = {"decoding_type": "NGram", "max_draft_len": 3, "max_matching_ngram_size": 2}
    engine = make_engine(model_dir, speculative_config=spec)
    try:
        assert run_all(engine, tokenizer, prompt_ids[2:4], MAX_NEW) == expected[2:4]
    finally:
        engine.shutdown()


def test_guided_output_follows_its_regex(mixtral):
    model_dir, tokenizer, prompt_ids, _ = mixtral
    pattern = r"(red|green|blue)-[0-9]{2,4}\."
    engine = make_engine(model_dir, guided_decoding_backend="xgrammar")
    try:
        params = SamplingParams(max_tokens=32, guided_decoding=GuidedDecodingParams(regex=pattern))
        output = engine.generate(prompt_ids[2], params).outputs[0]
        assert output.finish_reason == "stop"
        assert re.fullmatch(pattern, tokenizer.decode(output.token_ids, skip_special_tokens=True))
    finally:
        engine.shutdown()
