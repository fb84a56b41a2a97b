"""The adapter cache inside the engine: least recently used adapters go first, adapters of requests in flight
never do, and an evicted id without weights gets TensorRT-LLM's error. Driven step by step on the synchronous
EngineCore, so "in flight" is exact, not a race."""

from __future__ import annotations

import pytest
import torch

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine_core import EngineCore
from tritonllm.engine.types import InvalidRequestError, LoRARequest, SamplingParams
from tritonllm.lora.adapter import LoraAdapter
from tritonllm.lora.cache import AdapterCache, LoraCacheError


def make_core(model_dir, **lora_config) -> EngineCore:
    return EngineCore(
        EngineConfig.from_dict(
            {
                "model": str(model_dir),
                "dtype": "float32",
                "device": "cpu",
                "max_batch_size": 8,
                "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 2048},
                "lora_config": lora_config,
            }
        )
    )


def run_until_done(core: EngineCore, request) -> list[int]:
    while not request.finished:
        core.step()
    return list(request.seqs[0].output_token_ids)


@pytest.fixture(scope="module")
def adapters(tiny_llama, peft_factory, tmp_path_factory):
    work = tmp_path_factory.mktemp("evict")
    return {
        name: str(peft_factory(tiny_llama, work / name, ["q_proj", "v_proj", "down_proj"], seed=seed))
        for name, seed in (("a", 1), ("b", 2), ("c", 3), ("d", 4))
    }


def test_lru_eviction_keeps_requests_in_flight(tiny_llama, tiny_tokenizer, adapters):
    prompt = tiny_tokenizer.encode("Once upon a time, in a small village by the sea")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    alone = make_core(tiny_llama, max_cpu_loras=2, max_loras=2)
    expected_a = run_until_done(alone, alone.add_request(1, prompt, params, LoRARequest("a", 1, adapters["a"])))

    core = make_core(tiny_llama, max_cpu_loras=2, max_loras=2)
    request_a = core.add_request(1, prompt, params, LoRARequest("a", 1, adapters["a"]))  # stays in flight
    core.step()
    run_until_done(core, core.add_request(2, prompt, SamplingParams(max_tokens=4), LoRARequest("b", 2, adapters["b"])))
    request_c = core.add_request(3, prompt, params, LoRARequest("c", 3, adapters["c"]))
    assert core.lora.cache.evicted == [2]  # b: least recently used and not in flight; a is in flight
    with pytest.raises(InvalidRequestError, match="LoRA task 2 not found in cache. Please send LoRA weights"):
        core.add_request(4, prompt, params, LoRARequest(lora_int_id=2))
    with pytest.raises(InvalidRequestError, match="LoRA task 5 cannot be stored: the LoRA cache is full"):
        core.add_request(5, prompt, params, LoRARequest("d", 5, adapters["d"]))  # a and c are both in flight
    assert run_until_done(core, request_a) == expected_a
    run_until_done(core, request_c)
    assert sorted(core.lora.cache.entries) == [1, 3]
    assert all(entry.pins == 0 for entry in core.lora.cache.entries.values())
    # once nothing is in flight, d fits again (evicting a, now the least recently used)
    run_until_done(core, core.add_request(6, prompt, SamplingParams(max_tokens=2), LoRARequest("d", 5, adapters["d"])))
    assert core.lora.cache.evicted == [2, 1]


def test_max_loras_bounds_the_adapters_of_a_step(tiny_llama, tiny_tokenizer, adapters):
    prompt = tiny_tokenizer.encode("Hello there")
    core = make_core(tiny_llama, max_cpu_loras=4, max_loras=2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    requests = [
        core.add_request(i, prompt, params, LoRARequest(name, i, adapters[name]))
        for i, name in enumerate("abc", start=1)
    ]
    requests.append(core.add_request(9, prompt, params))  # the base model needs no slot
    seen = 0
    while any(not r.finished for r in requests):
        batch_adapters = {s.adapter_key for s in core.scheduler.running if s.adapter_key is not None}
        assert len(batch_adapters) <= 2
        core.step()
        seen = max(seen, len({s.adapter_key for s in core.scheduler.running if s.adapter_key is not None}))
    assert seen == 2
    assert all(len(r.seqs[0].output_token_ids) == 6 for r in requests)


def _adapter(rank: int = 2) -> LoraAdapter:
    adapter = LoraAdapter(source="test")
    adapter.add(0, "q_proj", torch.zeros(rank, 4), torch.zeros(4, rank))
    return adapter


def test_cache_unit_lru_pins_and_bytes():
    cache = AdapterCache(max_adapters=2)
    first = cache.acquire(1, _adapter())
    cache.release(cache.acquire(2, _adapter()))
    cache.release(first)
    cache.acquire(1, None)  # touch 1: now 2 is the least recently used
    cache.acquire(3, _adapter())
    assert list(cache.entries) == [1, 3] and cache.evicted == [2]
    with pytest.raises(LoraCacheError, match="LoRA task 4 cannot be stored"):
        cache.acquire(4, _adapter())
    by_bytes = AdapterCache(max_adapters=10, max_bytes=_adapter().num_bytes * 2)
    for task in (1, 2, 3):
        by_bytes.release(by_bytes.acquire(task, _adapter()))
    assert list(by_bytes.entries) == [2, 3]
    with pytest.raises(LoraCacheError, match="more than the whole host LoRA cache"):
        by_bytes.acquire(7, _adapter(rank=8))
