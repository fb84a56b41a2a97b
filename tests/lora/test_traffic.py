"""Random traffic (tests/traffic.py) where each request runs with one of two LoRA adapters (attention, MLP) or the
base model, mixed in batches: every greedy answer equals the request's answer alone with its adapter, with and
without speculation, under chunked prefill with prefix reuse or a KV cache small enough to preempt; every KV block
is free afterwards."""

import pytest

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.types import LoRARequest

from ..traffic import mismatches, random_traffic, send
from .conftest import ATTENTION, DEVICE, MLP

SETTINGS = {
    "chunked_reuse": {
        "enable_chunked_prefill": True,
        "max_num_tokens": 16,
        "kv_cache_config": {"tokens_per_block": 4, "max_tokens": 4096, "enable_block_reuse": True},
    },
    "preempting": {
        "scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"},
        "kv_cache_config": {"tokens_per_block": 4, "max_tokens": 160, "enable_block_reuse": False},
    },
}


def make_engine(model_dir, spec=None, **overrides) -> EmbeddedEngine:
    args = {
        "model": str(model_dir),
        "dtype": "float32",
        "device": DEVICE,
        "max_batch_size": 6,
        "max_beam_width": 2,
        "kv_cache_config": {"tokens_per_block": 4, "max_tokens": 4096},
        "enable_lora": True,
        "lora_config": {"max_loras": 2, "max_cpu_loras": 2},
        **overrides,
    }
    if spec is not None:
        args.update(speculative_config=spec, max_beam_width=1)
    return EmbeddedEngine(EngineConfig.from_dict(args))


@pytest.fixture(scope="module")
def adapters(tiny_llama, peft_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("traffic_adapters")
    return [
        peft_factory(tiny_llama, folder / "attention", ATTENTION, seed=1),
        peft_factory(tiny_llama, folder / "mlp", MLP, seed=2),
    ]


@pytest.mark.parametrize("setting, seed", [("chunked_reuse", 11), ("preempting", 12)])
@pytest.mark.parametrize(
    "spec", [None, {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 3}], ids=["plain", "ngram"]
)
def test_random_traffic_with_adapters_keeps_every_greedy_answer(tiny_llama, adapters, spec, setting, seed):
    def lora_for(adapter):
        return None if adapter == 0 else LoRARequest(f"adapter{adapter}", adapter, str(adapters[adapter - 1]))

    traffic = random_traffic(seed, count=30, vocab=400, beams=spec is None, adapters=len(adapters))
    engine = make_engine(tiny_llama, spec, **SETTINGS[setting])
    try:
        results = send(engine, traffic, lora_for)
        stats = engine.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()
    assert {traffic[i].adapter for i in results} == {0, 1, 2}
    solo = make_engine(tiny_llama)
    try:
        assert mismatches(solo, traffic, results, lora_for) == []
    finally:
        solo.shutdown()
