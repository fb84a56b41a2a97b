"""KV cache reuse seen from a client: `return_perf_metrics` on a repeated prompt (contract CI style)."""

import e2e_clients
import pytest

pytestmark = pytest.mark.server

TOKENS_PER_BLOCK = 32  # the repository's default kv_cache_config.tokens_per_block


def perf(server, prompt_ids, tokenizer) -> dict[str, int]:
    reply = server.stream_infer(
        "tensorrt_llm",
        e2e_clients.direct_request(
            prompt_ids, 8, tokenizer.end_id, return_perf_metrics=True, exclude_input_in_output=True
        ),
    )
    assert reply.error is None, reply.error
    names = (
        "kv_cache_alloc_new_blocks",
        "kv_cache_reused_blocks",
        "kv_cache_alloc_total_blocks",
        "arrival_time_ns",
        "first_token_time_ns",
        "last_token_time_ns",
    )
    return {name: int(reply.outputs(name)[-1].reshape(-1)[0]) for name in names}


def test_a_repeated_prompt_reuses_every_full_block(server, tokenizer):
    text = " ".join(f"item {i} of the shared context;" for i in range(40))
    prompt_ids = tokenizer.encode(text, add_special_tokens=True)
    prompt_ids = prompt_ids[: 4 * TOKENS_PER_BLOCK + 5]  # four full blocks and a partial one
    first, second = perf(server, prompt_ids, tokenizer), perf(server, prompt_ids, tokenizer)
    assert first["kv_cache_reused_blocks"] == 0
    assert first["kv_cache_alloc_new_blocks"] == first["kv_cache_alloc_total_blocks"] == 5
    assert second["kv_cache_reused_blocks"] == 4
    assert second["kv_cache_alloc_new_blocks"] == 1 and second["kv_cache_alloc_total_blocks"] == 5
    for sample in (first, second):
        assert 0 < sample["arrival_time_ns"] <= sample["first_token_time_ns"] <= sample["last_token_time_ns"]
    gauges = server.wait_engine_idle()
    assert gauges[("nv_trt_llm_kv_cache_block_metrics", "reused")] >= 4
    assert gauges[("nv_trt_llm_kv_cache_block_metrics", "free")] == gauges[("nv_trt_llm_kv_cache_block_metrics", "max")]
