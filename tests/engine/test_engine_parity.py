"""The embedded engine against Hugging Face transformers on the same weights: greedy, fp32, token for token.

TRITONLLM_TEST_DEVICE=cuda runs both sides on the GPU (the CPU is the default)."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.types import SamplingParams

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, and then",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Caf\u00e9 cr\u00e8me et pain au chocolat: ",
    "In the beginning the engineers wrote a scheduler. It admitted requests as they arrived, filled a token "
    "budget every step, and when memory ran short it sent the newest request back to wait. Later they",
]
MAX_NEW = 24
DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")


def hf_greedy(model_dir, prompt_ids: list[list[int]], max_new: int, eos_id: int, **load) -> list[list[int]]:
    """`load`: from_pretrained's extra arguments (Gemma's attn_implementation="eager": SDPA cannot soft-cap)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **load).to(DEVICE).eval()
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            input_ids = torch.tensor([ids], device=DEVICE)
            generated = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=eos_id,
            )[0, len(ids) :].tolist()
            # The engine, like TensorRT-LLM, does not return the end token.
            outputs.append(generated[: generated.index(eos_id)] if eos_id in generated else generated)
    return outputs


def make_engine(model_dir, **overrides) -> EmbeddedEngine:
    args = {
        "model": str(model_dir),
        "dtype": "float32",
        "device": DEVICE,
        "max_batch_size": 8,
        "max_num_tokens": 512,
        "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 4096},
    }
    args.update(overrides)
    return EmbeddedEngine(EngineConfig.from_dict(args))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), seed=1, arch=request.param)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    expected = hf_greedy(model_dir, prompt_ids, MAX_NEW, tokenizer.eos_token_id)
    return model_dir, tokenizer, prompt_ids, expected


def greedy(tokenizer, max_tokens=MAX_NEW, **extra):
    return SamplingParams(max_tokens=max_tokens, end_id=tokenizer.eos_token_id, **extra)


def assert_all_blocks_free(engine):
    stats = engine.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_one_at_a_time_matches_hf(tiny):
    model_dir, tokenizer, prompt_ids, expected = tiny
    engine = make_engine(model_dir)
    try:
        got = [engine.generate(ids, greedy(tokenizer)).outputs[0].token_ids for ids in prompt_ids]
        assert got == expected
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_all_at_once_and_joining_mid_flight_match_hf(tiny):
    model_dir, tokenizer, prompt_ids, expected = tiny
    engine = make_engine(model_dir)
    try:
        handles = [engine.generate_async(ids, greedy(tokenizer)) for ids in prompt_ids]
        assert [h.result().outputs[0].token_ids for h in handles] == expected
        # Two start streaming; the others join once those have produced tokens.
        early = [engine.generate_async(ids, greedy(tokenizer), streaming=True) for ids in prompt_ids[:2]]
        first_updates = [next(iter(h)) for h in early]
        assert all(update.outputs[0].token_ids for update in first_updates)
        late = [engine.generate_async(ids, greedy(tokenizer)) for ids in prompt_ids[2:]]
        got = [h.result().outputs[0].token_ids for h in early + late]
        assert got == expected
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_preemption_keeps_outputs_identical(tiny):
    model_dir, tokenizer, prompt_ids, expected = tiny
    longest = max(len(ids) for ids in prompt_ids) + MAX_NEW
    engine = make_engine(
        model_dir,
        kv_cache_config={"tokens_per_block": 4, "max_tokens": longest + 16},
        scheduler_config={"capacity_scheduler_policy": "MAX_UTILIZATION"},
    )
    try:
        outputs = [h.result() for h in [engine.generate_async(ids, greedy(tokenizer)) for ids in prompt_ids]]
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert sum(o.outputs[0].request_perf_metrics.num_preemptions for o in outputs) > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_streaming_yields_the_same_tokens_step_by_step(tiny):
    model_dir, tokenizer, prompt_ids, expected = tiny
    engine = make_engine(model_dir)
    try:
        pieces = []
        for update in engine.generate_async(prompt_ids[2], greedy(tokenizer), streaming=True):
            pieces.extend(update.outputs[0].token_ids_diff)
        assert pieces == expected[2]
    finally:
        engine.shutdown()


def test_abort_mid_stream_frees_every_block(tiny):
    model_dir, tokenizer, prompt_ids, _ = tiny
    engine = make_engine(model_dir)
    try:
        handles = [
            engine.generate_async(ids, greedy(tokenizer, max_tokens=200, ignore_eos=True), streaming=True)
            for ids in prompt_ids
        ]
        next(iter(handles[0]))
        for handle in handles[::2]:
            handle.abort()
        finals = [handle.result() for handle in handles]
        assert [f.outputs[0].finish_reason for f in finals[::2]] == ["cancelled"] * 3
        assert all(f.outputs[0].finish_reason == "length" for f in finals[1::2])
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_smollm2_matches_hf(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("What is the capital of France?", "Write a haiku about the sea.")
    ]
    prompt_ids = [tokenizer.encode(p) for p in prompts] + [tokenizer.encode("The history of Rome begins")]
    expected = hf_greedy(smollm2_dir, prompt_ids, 20, tokenizer.eos_token_id)
    engine = make_engine(smollm2_dir, kv_cache_config={"tokens_per_block": 16, "max_tokens": 2048})
    try:
        handles = [engine.generate_async(ids, greedy(tokenizer, max_tokens=20)) for ids in prompt_ids]
        assert [h.result().outputs[0].token_ids for h in handles] == expected
        assert "Paris" in tokenizer.decode(expected[0])
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_async_iteration_ends_with_the_final_output(tiny):
    import asyncio

    model_dir, tokenizer, prompt_ids, expected = tiny
    engine = make_engine(model_dir)

    async def collect():
        tokens = []
        async for update in engine.generate_async(prompt_ids[1], greedy(tokenizer), streaming=True):
            tokens.extend(update.outputs[0].token_ids_diff)
        return tokens

    try:
        assert asyncio.run(asyncio.wait_for(collect(), 60)) == expected[1]
    finally:
        engine.shutdown()


def test_chunked_prefill_matches_hf(tiny):
    model_dir, tokenizer, prompt_ids, expected = tiny
    engine = make_engine(model_dir, enable_chunked_prefill=True, max_num_tokens=8)
    try:
        outputs = [h.result() for h in [engine.generate_async(ids, greedy(tokenizer)) for ids in prompt_ids]]
        assert [o.outputs[0].token_ids for o in outputs] == expected
        longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
        assert outputs[longest].outputs[0].request_perf_metrics.prefill_steps > 1
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
