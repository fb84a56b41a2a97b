"""Speculative decoding through the real tritonserver: a repository whose model.yaml has a speculative_config
(DraftTarget, NGram, Medusa, Eagle, Eagle3; untrained heads and draft layers where they need weights) gives the plain
repository's greedy tokens for concurrent requests of mixed lengths and reports draft counts; lookahead takes the
TensorRT-LLM backend's parameters; a plain repository verifies a request's own draft_input_ids; and SmolLM2 with its
shipped Medusa heads gives the plain engine's greedy tokens."""

from concurrent.futures import ThreadPoolExecutor

import e2e_clients
import numpy as np
import pytest

from tritonllm.deploy.repo import build_repo
from tritonllm.deploy.tritonserver import Ports, TritonServer

pytestmark = pytest.mark.server

MAX_SEQ_LEN = 2048
PROMPTS = [
    "the river ran past the mill and the mill wheel turned, the river ran past the mill",
    "one",
    "a b c d e f g a b c d e f g a b c",
    "Explain how bread rises in a warm kitchen.",
]


@pytest.fixture(scope="module")
def spec_server(tiny_model, tmp_path_factory):
    """The decoupled repository with the tiny model drafting for itself (DraftTarget): every draft is right."""
    work = tmp_path_factory.mktemp("speculative")
    repo = build_repo(tiny_model, work / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN)
    with (repo / "tensorrt_llm" / "1" / "model.yaml").open("a") as yaml_file:
        yaml_file.write(
            f"\nspeculative_config:\n  decoding_type: DraftTarget\n  max_draft_len: 3\n"
            f"  speculative_model_dir: {tiny_model}\n"
        )
    yield from serve(repo, work)


def serve(repo, work):
    """A live server on `repo` for the fixture's lifetime."""
    triton = TritonServer(repo, Ports.free(), log_file=work / "tritonserver.log")
    triton.start(timeout=180)
    try:
        yield e2e_clients.LiveServer(triton, work / "tritonserver.log", MAX_SEQ_LEN)
    finally:
        triton.stop()


def perf_reply(server, prompt_ids, max_tokens, end_id, **extra):
    reply = server.stream_infer(
        "tensorrt_llm",
        e2e_clients.direct_request(
            prompt_ids, max_tokens, end_id, return_perf_metrics=True, exclude_input_in_output=True, **extra
        ),
    )
    assert reply.error is None, reply.error
    (output_ids,) = reply.outputs("output_ids")
    counts = {
        name: int(reply.outputs(name)[-1].reshape(-1)[0])
        for name in ("total_draft_tokens", "total_accepted_draft_tokens")
    }
    return output_ids.reshape(-1).tolist(), counts


def test_greedy_tokens_equal_the_plain_repository(server, spec_server, tokenizer):
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS]
    lengths = [24, 9, 31, 16]
    want = [e2e_clients.greedy_token_ids(server, ids, n, tokenizer.end_id) for ids, n in zip(prompts, lengths)]
    with ThreadPoolExecutor(len(prompts)) as pool:  # together, so the engine batches them
        got = list(pool.map(lambda args: perf_reply(spec_server, *args, tokenizer.end_id), zip(prompts, lengths)))
    assert [tokens for tokens, _ in got] == want
    for tokens, counts in got:
        if len(tokens) > 2:
            assert counts["total_draft_tokens"] > 0
            assert counts["total_accepted_draft_tokens"] == counts["total_draft_tokens"]
    gauges = spec_server.wait_engine_idle()
    assert gauges[("nv_trt_llm_kv_cache_block_metrics", "free")] == gauges[("nv_trt_llm_kv_cache_block_metrics", "max")]
    drafted = sum(counts["total_draft_tokens"] for _, counts in got)
    samples = {
        s.name: s.value
        for s in e2e_clients.parse_samples(spec_server.metrics_text())
        if s.name.startswith("nv_llm_spec_") and s.labels.get("model") == "tensorrt_llm"
    }
    assert samples["nv_llm_spec_draft_tokens_sum"] == drafted  # the Prometheus histograms saw every draft
    assert samples["nv_llm_spec_acceptance_rate_count"] == sum(1 for _, counts in got if counts["total_draft_tokens"])


def test_draft_input_ids_are_verified_on_a_plain_repository(server, tokenizer):
    prompt = tokenizer.encode(PROMPTS[3], add_special_tokens=True)
    want = e2e_clients.greedy_token_ids(server, prompt, 6, tokenizer.end_id)
    drafts = np.array([want[:5]], dtype=np.int32)
    tokens, counts = perf_reply(server, prompt, 6, tokenizer.end_id, draft_input_ids=drafts)
    assert tokens == want and counts == {"total_draft_tokens": 5, "total_accepted_draft_tokens": 5}
    wrong = drafts.copy()
    wrong[0, 2] = (wrong[0, 2] + 1) % 500
    tokens, counts = perf_reply(server, prompt, 6, tokenizer.end_id, draft_input_ids=wrong)
    assert tokens == want and counts == {"total_draft_tokens": 5, "total_accepted_draft_tokens": 2}
    reply = server.stream_infer(
        "tensorrt_llm",
        e2e_clients.direct_request(prompt, 6, tokenizer.end_id, draft_logits=np.zeros((1, 2, 7), np.float32)),
    )
    assert reply.error is not None and "draft_logits" in str(reply.error)


@pytest.fixture(scope="module")
def lookahead_server(tiny_model, tmp_path_factory):
    """A repository running lookahead decoding with the TensorRT-LLM backend's parameters (W = N = G = 3)."""
    work = tmp_path_factory.mktemp("lookahead")
    repo = build_repo(
        tiny_model,
        work / "repo",
        streaming=True,
        max_seq_len=MAX_SEQ_LEN,
        parameters={
            "decoding_mode": "lookahead",
            "lookahead_window_size": "3",
            "lookahead_ngram_size": "3",
            "lookahead_verification_set_size": "3",
        },
    )
    yield from serve(repo, work)


def lookahead_inputs(window, ngram, verification):
    return {
        "lookahead_window_size": window,
        "lookahead_ngram_size": ngram,
        "lookahead_verification_set_size": verification,
    }


def test_per_request_lookahead_inputs_narrow_the_instance_lookahead(server, lookahead_server, tokenizer):
    prompt = tokenizer.encode(PROMPTS[2], add_special_tokens=True)
    want = e2e_clients.greedy_token_ids(server, prompt, 20, tokenizer.end_id)
    for sizes in [(2, 2, 2), (3, 3, 3), (1, 3, 1)]:
        tokens, counts = perf_reply(lookahead_server, prompt, 20, tokenizer.end_id, **lookahead_inputs(*sizes))
        assert tokens == want, sizes
    tokens, _ = perf_reply(lookahead_server, prompt, 20, tokenizer.end_id)  # the instance's own sizes
    assert tokens == want
    too_wide = lookahead_server.stream_infer(
        "tensorrt_llm", e2e_clients.direct_request(prompt, 4, tokenizer.end_id, **lookahead_inputs(4, 3, 3))
    )
    assert too_wide.error is not None and "window size 4 exceeds the model instance's 3" in str(too_wide.error)
    partial = lookahead_server.stream_infer(
        "tensorrt_llm", e2e_clients.direct_request(prompt, 4, tokenizer.end_id, lookahead_window_size=2)
    )
    assert partial.error is not None
    assert "missing lookahead_ngram_size, lookahead_verification_set_size" in str(partial.error)


def test_per_request_lookahead_inputs_need_an_instance_running_lookahead(server, tokenizer):
    prompt = tokenizer.encode(PROMPTS[1], add_special_tokens=True)
    reply = server.stream_infer(
        "tensorrt_llm", e2e_clients.direct_request(prompt, 4, tokenizer.end_id, **lookahead_inputs(2, 2, 2))
    )
    assert reply.error is not None and "needs the model instance's lookahead decoding" in str(reply.error)


def _medusa_heads(model_dir, out):
    import json

    import torch

    from tritonllm.spec_decode.medusa import MedusaHeads, save_medusa

    torch.manual_seed(0)
    heads = MedusaHeads(
        json.loads((model_dir / "config.json").read_text())["hidden_size"], 0, num_heads=3, shared_lm_head=True
    )
    for head in heads.heads:
        torch.nn.init.normal_(head[0].linear.weight, std=0.05)
    return save_medusa(heads, out)


def _method_config(method, model_dir, work):
    """The model.yaml lines of a speculative method, with untrained weights where it needs any."""
    from tritonllm.engine.embedded.speculation.eagle import random_eagle
    from tritonllm.engine.embedded.speculation.eagle3 import random_eagle3

    if method == "NGram":
        return "  decoding_type: NGram\n  max_draft_len: 4\n  max_matching_ngram_size: 2\n"
    if method == "Medusa":
        return (
            f"  decoding_type: Medusa\n  speculative_model_dir: {_medusa_heads(model_dir, work / 'heads')}\n"
            "  medusa_choices: [[0], [1], [0, 0], [0, 0, 0]]\n"
        )
    if method == "Eagle3":  # the tiny model's two layers (EAGLE-3's default layers need more)
        draft = random_eagle3(model_dir, work / "eagle3", seed=1, capture_layers=[0, 1])
        return f"  decoding_type: Eagle3\n  max_draft_len: 3\n  speculative_model_dir: {draft}\n"
    return (
        f"  decoding_type: Eagle\n  max_draft_len: 3\n  speculative_model_dir: "
        f"{random_eagle(model_dir, work / 'eagle', seed=1)}\n  eagle_choices: [[0], [1], [0, 0], [0, 1]]\n"
    )


@pytest.fixture(scope="module", params=["NGram", "Medusa", "Eagle", "Eagle3"])
def method_server(request, tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp(request.param.lower())
    repo = build_repo(tiny_model, work / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN)
    with (repo / "tensorrt_llm" / "1" / "model.yaml").open("a") as yaml_file:
        yaml_file.write("\nspeculative_config:\n" + _method_config(request.param, tiny_model, work))
    for server in serve(repo, work):
        yield request.param, server


def test_every_engine_method_keeps_greedy_tokens_through_the_server(server, method_server, tokenizer):
    method, spec_server = method_server
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS]
    lengths = [24, 9, 31, 16]
    want = [e2e_clients.greedy_token_ids(server, ids, n, tokenizer.end_id) for ids, n in zip(prompts, lengths)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda args: perf_reply(spec_server, *args, tokenizer.end_id), zip(prompts, lengths)))
    assert [tokens for tokens, _ in got] == want, method
    assert sum(counts["total_draft_tokens"] for _, counts in got) > 0, method
    gauges = spec_server.wait_engine_idle()
    assert gauges[("nv_trt_llm_kv_cache_block_metrics", "free")] == gauges[("nv_trt_llm_kv_cache_block_metrics", "max")]


@pytest.mark.slow
def test_smollm2_with_its_shipped_medusa_heads_keeps_the_plain_greedy_tokens(smollm2_dir, tmp_path_factory):
    """The demo model with the Medusa heads trained for it (`builtin:smollm2`, the bench's pruned tree) through
    the server: concurrent chat requests of mixed lengths give the plain engine's greedy tokens, drafts accepted."""
    from transformers import AutoTokenizer

    from tritonllm.engine import create_engine
    from tritonllm.engine.config import EngineConfig
    from tritonllm.engine.types import SamplingParams
    from tritonllm.spec_decode.training.distill import bench_requests, chat_ids

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [chat_ids(tokenizer, request) for request in bench_requests("chat", 3)]
    lengths = [40, 12, 28]
    plain = create_engine(EngineConfig.from_dict({"model": str(smollm2_dir), "dtype": "float32", "device": "cpu"}))
    try:
        want = [
            plain.generate(ids, SamplingParams(max_tokens=n, end_id=tokenizer.eos_token_id)).outputs[0].token_ids
            for ids, n in zip(prompts, lengths)
        ]
    finally:
        plain.shutdown()
    work = tmp_path_factory.mktemp("smollm2_medusa")
    repo = build_repo(smollm2_dir, work / "repo", streaming=True, max_seq_len=MAX_SEQ_LEN)
    with (repo / "tensorrt_llm" / "1" / "model.yaml").open("a") as yaml_file:
        yaml_file.write(
            "\nspeculative_config:\n  decoding_type: Medusa\n  speculative_model_dir: builtin:smollm2\n"
            "  min_path_probability: 0.15\n"
        )
    for spec_server in serve(repo, work):
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(
                pool.map(lambda args: perf_reply(spec_server, *args, tokenizer.eos_token_id), zip(prompts, lengths))
            )
        gauges = spec_server.wait_engine_idle()
    assert [tokens for tokens, _ in got] == want
    assert sum(counts["total_accepted_draft_tokens"] for _, counts in got) > 0
    assert gauges[("nv_trt_llm_kv_cache_block_metrics", "free")] == gauges[("nv_trt_llm_kv_cache_block_metrics", "max")]
