"""Chunked prefill and KV prefix reuse change how prompts are computed, never what comes out."""

import itertools

import pytest
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.block_manager import BlockManager
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.sequence import Sequence
from tritonllm.engine.types import SamplingParams

BLOCK = 4
SYSTEM = (
    "You are a careful assistant. Answer briefly, cite the text you were given, and never invent facts "
    "that the text does not hold. "
)
QUESTIONS = ["What is the capital?", "Name two rivers.", "Who wrote the letter?", "When did it rain last?"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=5, arch="qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(SYSTEM + q) for q in QUESTIONS]
    return model_dir, tokenizer, prompts


def make_engine(model_dir, chunked: bool, reuse: bool, kv_tokens: int = 4096, policy="GUARANTEED_NO_EVICT"):
    return EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(model_dir),
                "dtype": "float32",
                "device": "cpu",
                "max_batch_size": 8,
                "max_num_tokens": 16 if chunked else 512,
                "enable_chunked_prefill": chunked,
                "scheduler_config": {"capacity_scheduler_policy": policy},
                "kv_cache_config": {"tokens_per_block": BLOCK, "max_tokens": kv_tokens, "enable_block_reuse": reuse},
            }
        )
    )


def greedy(tokenizer, max_tokens=16):
    return SamplingParams(max_tokens=max_tokens, end_id=tokenizer.eos_token_id)


def run(engine, prompts, params, together: bool):
    if together:
        return [h.result() for h in [engine.generate_async(p, params) for p in prompts]]
    return [engine.generate_async(p, params).result() for p in prompts]


def assert_no_leak(engine):
    stats = engine.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_cached_blocks <= stats.num_free_blocks


@pytest.fixture(scope="module")
def reference(tiny):
    model_dir, tokenizer, prompts = tiny
    engine = make_engine(model_dir, chunked=False, reuse=False)
    try:
        return [o.outputs[0].token_ids for o in run(engine, prompts, greedy(tokenizer), together=False)]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("chunked, reuse", list(itertools.product([False, True], [False, True])))
def test_outputs_identical_with_chunking_and_reuse(tiny, reference, chunked, reuse):
    model_dir, tokenizer, prompts = tiny
    assert min(len(p) for p in prompts) > 3 * 16  # longer than several chunks
    engine = make_engine(model_dir, chunked, reuse)
    try:
        runs = []
        for together in (True, False, True):  # shared prefixes together, then one after another, then cached
            runs.append(run(engine, prompts, greedy(tokenizer), together))
            assert [o.outputs[0].token_ids for o in runs[-1]] == reference
        if chunked:  # the first prompt is computed from scratch, over several steps
            assert runs[0][0].outputs[0].request_perf_metrics.prefill_steps > 2
        reused = sum(o.outputs[0].request_perf_metrics.kv_cache_reused_blocks for o in runs[-1])
        assert (reused > 0) == reuse
        assert_no_leak(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("chunked", [False, True])
def test_outputs_identical_under_preemption_with_reuse(tiny, reference, chunked):
    model_dir, tokenizer, prompts = tiny
    longest = max(len(p) for p in prompts) + 16
    engine = make_engine(model_dir, chunked, reuse=True, kv_tokens=longest + 24, policy="MAX_UTILIZATION")
    try:
        outputs = run(engine, prompts, greedy(tokenizer), together=True)
        assert [o.outputs[0].token_ids for o in outputs] == reference
        assert sum(o.outputs[0].request_perf_metrics.num_preemptions for o in outputs) > 0
        assert_no_leak(engine)
    finally:
        engine.shutdown()


def test_repeated_prompt_reuses_every_full_block(tiny):
    model_dir, tokenizer, prompts = tiny
    # A prompt that ends inside a block: all its full blocks precede the last token's block.
    prompt = prompts[0] if len(prompts[0]) % BLOCK else prompts[0][:-1]
    engine = make_engine(model_dir, chunked=False, reuse=True)
    try:
        first = engine.generate(prompt, greedy(tokenizer)).outputs[0].request_perf_metrics
        second = engine.generate(prompt, greedy(tokenizer)).outputs[0].request_perf_metrics
        full_blocks = len(prompt) // BLOCK
        assert first.kv_cache_reused_blocks == 0
        assert second.kv_cache_reused_blocks == full_blocks
        assert second.kv_cache_alloc_total_blocks == first.kv_cache_alloc_total_blocks
        assert second.kv_cache_alloc_new_blocks == first.kv_cache_alloc_new_blocks - full_blocks
        assert engine.wait_idle().num_reused_blocks == full_blocks
    finally:
        engine.shutdown()


def test_no_block_leaks_after_a_mixed_run_with_aborts(tiny):
    model_dir, tokenizer, prompts = tiny
    engine = make_engine(model_dir, chunked=True, reuse=True, kv_tokens=256, policy="MAX_UTILIZATION")
    try:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        handles = [engine.generate_async(p, params, streaming=True) for p in prompts * 3]
        next(iter(handles[0]))
        for handle in handles[::3]:
            handle.abort()
        finals = [h.result() for h in handles]
        assert {f.outputs[0].finish_reason for f in finals} == {"cancelled", "length"}
        assert any(f.outputs[0].request_perf_metrics.num_preemptions for f in finals)
        assert_no_leak(engine)
        assert engine.stats().num_cached_blocks > 0
    finally:
        engine.shutdown()


def test_block_manager_never_matches_the_last_tokens_block():
    manager = BlockManager(num_blocks=8, block_size=4, enable_reuse=True)
    first = Sequence(0, 0, 0, list(range(8)), SamplingParams(max_tokens=1))
    manager.grow(first, 8)
    first.num_computed_tokens = 8
    manager.register_full_blocks(first)
    manager.free(first)
    assert manager.num_cached_free_blocks == 2
    same = Sequence(1, 1, 0, list(range(8)), SamplingParams(max_tokens=1))
    assert len(manager.match_prefix(same)) == 1  # the second block holds the last token: recomputed
    longer = Sequence(2, 2, 0, list(range(9)), SamplingParams(max_tokens=1))
    assert len(manager.match_prefix(longer)) == 2
    other = Sequence(3, 3, 0, [99] + list(range(1, 9)), SamplingParams(max_tokens=1))
    assert manager.match_prefix(other) == []
    assert manager.match_prefix(longer, extra_key="adapter-a") == []  # another adapter, another cache


def test_cached_blocks_are_reclaimed_least_recently_freed_first():
    manager = BlockManager(num_blocks=4, block_size=2, enable_reuse=True)
    seqs = [Sequence(i, i, 0, [10 * i, 10 * i + 1, 10 * i + 2], SamplingParams(max_tokens=1)) for i in range(2)]
    for seq in seqs:
        manager.grow(seq, 3)
        seq.num_computed_tokens = 3
        manager.register_full_blocks(seq)
    for seq in seqs:
        manager.free(seq)
    assert manager.num_cached_free_blocks == 2
    newcomer = Sequence(9, 9, 0, [7, 7, 7], SamplingParams(max_tokens=1))
    manager.grow(newcomer, 6)  # needs 3 blocks: the 2 uncached ones, then the oldest cached one
    assert manager.match_prefix(seqs[0]) == [] and len(manager.match_prefix(seqs[1])) == 1


def test_cached_free_block_count_matches_a_recount():
    manager = BlockManager(num_blocks=6, block_size=2, enable_reuse=True)
    seqs = [Sequence(i, i, 0, [1, 2, 3, 4, 5 + i], SamplingParams(max_tokens=1)) for i in range(3)]

    def recount():
        return sum(1 for b in manager.free_blocks if manager.block_hash[b] is not None)

    for seq in seqs[:2]:
        manager.reuse(seq, manager.match_prefix(seq))
        manager.grow(seq, 5)
        seq.num_computed_tokens = 5
        manager.register_full_blocks(seq)
        assert manager.num_cached_free_blocks == recount()
    manager.free(seqs[0])
    assert manager.num_cached_free_blocks == recount()
    manager.reuse(seqs[2], manager.match_prefix(seqs[2]))
    manager.grow(seqs[2], 5)
    assert manager.num_cached_free_blocks == recount()
    for seq in seqs[1:]:
        manager.free(seq)
    assert manager.num_cached_free_blocks == recount() and manager.num_free_blocks == 6
