"""Speculative decoding inside the embedded engine: every method gives the plain greedy tokens in batches mixing
lengths, with chunked prefill, prefix reuse and preemption; drafts are counted per request; every KV block is
free afterwards; external draft tokens (draft_input_ids) are verified in one target step.

TRITONLLM_TEST_DEVICE=cuda runs the engines on the GPU (the CPU is the default)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import ConfigError, EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.speculation.eagle3 import random_eagle3
from tritonllm.engine.types import InvalidRequestError, SamplingParams
from tritonllm.spec_decode.medusa import MedusaHeads, save_medusa

DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")

BLOCK = 4
# Lengths mixed on purpose: one prompt shorter than a block, one over several blocks, one repetitive.
PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, [20, 21, 22], list(range(100, 160)), [300, 301, 302, 303, 304, 305, 306]]
MAX_TOKENS = [48, 30, 40, 25]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("target"), seed=5, arch="qwen2")


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """Same tokenizer, other weights: a draft model that is mostly wrong."""
    return build_tiny_model(tmp_path_factory.mktemp("draft"), seed=6, arch="qwen2")


@pytest.fixture(scope="module")
def medusa_dir(tmp_path_factory, model_dir):
    """Random heads whose vocabulary projection starts from the model's own (tied) embedding."""
    torch.manual_seed(0)
    embedding = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    heads = MedusaHeads(embedding.shape[1], embedding.shape[0], num_heads=3)
    heads.copy_lm_head(embedding)
    with torch.no_grad():
        for head in heads.heads:
            head[0].linear.weight.normal_(std=0.05)
    return save_medusa(heads, tmp_path_factory.mktemp("medusa"))


def methods(model_dir, other_draft_dir, medusa_dir):
    return {
        "ngram": {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 3},
        "draft_same": {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": str(model_dir)},
        "draft_other": {
            "decoding_type": "DraftTarget",
            "max_draft_len": 2,
            "speculative_model_dir": str(other_draft_dir),
        },
        "medusa": {
            "decoding_type": "Medusa",
            "speculative_model_dir": str(medusa_dir),
            "medusa_choices": [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]],
        },
        "lookahead": {
            "decoding_type": "Lookahead",
            "max_window_size": 3,
            "max_ngram_size": 3,
            "max_verification_set_size": 3,
        },
    }


SETTINGS = {
    "plain": {},
    "chunked_reuse": {
        "enable_chunked_prefill": True,
        "max_num_tokens": 16,
        "kv_cache_config": {"tokens_per_block": BLOCK, "max_tokens": 4096, "enable_block_reuse": True},
    },
    "preempting": {
        "scheduler_config": {"capacity_scheduler_policy": "MAX_UTILIZATION"},
        "kv_cache_config": {"tokens_per_block": BLOCK, "max_tokens": 160, "enable_block_reuse": False},
    },
}


def make_engine(model_dir, spec=None, **overrides):
    args = {
        "model": str(model_dir),
        "dtype": "float32",
        "device": DEVICE,
        "max_batch_size": 8,
        "kv_cache_config": {"tokens_per_block": BLOCK, "max_tokens": 4096},
    }
    args.update(overrides)
    if spec is not None:
        args["speculative_config"] = spec
    return EmbeddedEngine(EngineConfig.from_dict(args))


def run_batch(engine, prompts=PROMPTS, **knobs):
    handles = [
        engine.generate_async(p, SamplingParams(max_tokens=n, end_id=2, **knobs)) for p, n in zip(prompts, MAX_TOKENS)
    ]
    return [h.result().outputs[0] for h in handles]


def assert_all_blocks_free(engine):
    stats = engine.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks
    core = engine.core
    if hasattr(core.speculator.method, "proposer") and hasattr(core.speculator.method.proposer, "blocks"):
        draft_blocks = core.speculator.method.proposer.blocks
        assert draft_blocks.num_free_blocks == draft_blocks.num_blocks  # the draft model's own cache too


@pytest.fixture(scope="module")
def reference(model_dir):
    engine = make_engine(model_dir)
    try:
        return [o.token_ids for o in run_batch(engine)]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["ngram", "draft_same", "draft_other", "medusa", "lookahead"])
def test_greedy_output_is_plain_greedy(model_dir, other_draft_dir, medusa_dir, reference, method, setting):
    spec = methods(model_dir, other_draft_dir, medusa_dir)[method]
    engine = make_engine(model_dir, spec, **SETTINGS[setting])
    try:
        outputs = run_batch(engine)
        assert [o.token_ids for o in outputs] == reference
        metrics = [o.request_perf_metrics for o in outputs]
        assert sum(m.total_draft_tokens for m in metrics) > 0
        if method in ("ngram", "draft_same", "lookahead", "medusa"):
            assert sum(m.total_accepted_draft_tokens for m in metrics) > 0
        if method == "draft_same":  # the target drafting for itself: every draft token is right
            assert all(m.total_accepted_draft_tokens == m.total_draft_tokens for m in metrics)
        if setting == "preempting":
            assert sum(m.num_preemptions for m in metrics) > 0
        if setting == "chunked_reuse":
            again = run_batch(engine)  # prompts now come from the prefix cache
            assert [o.token_ids for o in again] == reference
            assert sum(o.request_perf_metrics.kv_cache_reused_blocks for o in again) > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_stop_words_max_tokens_and_logits_stay_exact(model_dir, reference):
    """Accepted tokens go through the finish rules one by one: a stop word inside an accepted run ends there."""
    stop = reference[0][10:12]
    plain, spec = (
        make_engine(model_dir),
        make_engine(
            model_dir, {"decoding_type": "DraftTarget", "max_draft_len": 4, "speculative_model_dir": str(model_dir)}
        ),
    )
    try:
        knobs = dict(stop_words=[stop], logprobs=True, return_generation_logits=True)
        want, got = run_batch(plain, **knobs), run_batch(spec, **knobs)
        assert got[0].token_ids[-2:] == stop and got[0].finish_reason == "stop"
        for a, b in zip(want, got):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
            assert b.generation_logits.shape[0] == len(b.token_ids)
            assert torch.allclose(a.generation_logits, b.generation_logits, atol=1e-4)
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert got[0].request_perf_metrics.total_accepted_draft_tokens > 0
        assert_all_blocks_free(spec)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_seeded_sampling_draws_the_same_tokens(model_dir):
    """Each committed token is drawn from the target's row with the sequence's generator, as without drafts."""
    plain, spec = (
        make_engine(model_dir),
        make_engine(
            model_dir, {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": str(model_dir)}
        ),
    )
    try:
        knobs = dict(temperature=0.8, top_k=20, seed=7)
        want, got = run_batch(plain, **knobs), run_batch(spec, **knobs)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert sum(o.request_perf_metrics.total_accepted_draft_tokens for o in got) > 0
    finally:
        plain.shutdown()
        spec.shutdown()


def test_external_draft_tokens_are_verified(model_dir, reference):
    engine = make_engine(model_dir)
    try:
        right = reference[2][:6]
        out = engine.generate(PROMPTS[2], SamplingParams(max_tokens=7, end_id=2, draft_tokens=right))
        metrics = out.outputs[0].request_perf_metrics
        assert out.outputs[0].token_ids == reference[2][:7]  # 6 accepted plus the bonus token
        assert (metrics.total_draft_tokens, metrics.total_accepted_draft_tokens) == (6, 6)
        assert metrics.acceptance_rate == 1.0
        wrong = right[:3] + [(right[3] + 1) % 900] + right[4:]
        out = engine.generate(PROMPTS[2], SamplingParams(max_tokens=7, end_id=2, draft_tokens=wrong))
        metrics = out.outputs[0].request_perf_metrics
        assert out.outputs[0].token_ids == reference[2][:7]
        assert (metrics.total_draft_tokens, metrics.total_accepted_draft_tokens) == (6, 3)
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_external_draft_logits_use_rejection_sampling(model_dir, reference):
    engine = make_engine(model_dir)
    try:
        vocab = engine.core.model_config.vocab_size
        drafts = reference[2][:4]
        logits = torch.full((4, vocab), -10.0)
        logits[torch.arange(4), torch.tensor(drafts)] = 10.0
        params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, draft_tokens=drafts, draft_logits=logits)
        out = engine.generate(PROMPTS[2], params).outputs[0]
        assert len(out.token_ids) == 5 and out.request_perf_metrics.total_draft_tokens == 4
        threshold = SamplingParams(
            max_tokens=5,
            temperature=1.0,
            seed=3,
            draft_tokens=drafts,
            draft_logits=logits,
            draft_acceptance_threshold=1.0,
        )
        out = engine.generate(PROMPTS[2], threshold).outputs[0]
        assert len(out.token_ids) == 5
        with pytest.raises(InvalidRequestError, match=r"draft_logits must be \[4, vocab\]"):
            engine.generate_async(
                PROMPTS[2], SamplingParams(max_tokens=5, draft_tokens=drafts, draft_logits=logits[:2])
            )
        with pytest.raises(InvalidRequestError, match="draft token id"):
            engine.generate_async(PROMPTS[2], SamplingParams(max_tokens=5, draft_tokens=[vocab + 3]))
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_configuration_errors_name_the_key(model_dir, other_draft_dir, tmp_path):
    with pytest.raises(ConfigError, match="speculative_config.max_draft_lenn"):
        EngineConfig.from_dict(
            {"model": str(model_dir), "speculative_config": {"decoding_type": "NGram", "max_draft_lenn": 3}}
        )
    with pytest.raises(InvalidRequestError, match="speculative_config.speculative_model_dir"):
        make_engine(model_dir, {"decoding_type": "Medusa", "speculative_model_dir": str(tmp_path)})
    with pytest.raises(InvalidRequestError, match="speculative_config.speculative_model_dir"):
        make_engine(model_dir, {"decoding_type": "DraftTarget", "speculative_model_dir": str(tmp_path)})
    with pytest.raises(InvalidRequestError, match="beam search"):
        make_engine(model_dir, {"decoding_type": "NGram"}, max_beam_width=2)


@pytest.mark.slow
def test_smollm2_greedy_output_is_plain_greedy_for_every_method(smollm2_dir, tmp_path):
    """The real model, batches mixing lengths: an input-grounded prompt (n-gram and lookahead find drafts), a short
    one and a mid-length one. Medusa heads are random (ResBlocks) over copies of the model's LM head; the EAGLE-3
    draft is random and reads the default layers (1, 14, 26 of 30)."""
    from transformers import AutoTokenizer

    from tritonllm.spec_decode.training.distill import bench_requests, chat_ids

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        chat_ids(tokenizer, bench_requests("rewrite", 1)[0]),
        tokenizer.encode("Hello"),
        tokenizer.encode("Write a short list of fruits and their colours:"),
    ]
    embedding = load_file(str(smollm2_dir / "model.safetensors"))["model.embed_tokens.weight"].float()
    heads = MedusaHeads(embedding.shape[1], embedding.shape[0], num_heads=2)
    heads.copy_lm_head(embedding)
    medusa = save_medusa(heads, tmp_path / "medusa")
    eagle3 = random_eagle3(smollm2_dir, tmp_path / "eagle3", seed=1, draft_vocab_size=4096)  # layers 1, 14, 26
    specs = [
        {"decoding_type": "NGram", "max_draft_len": 4},
        {"decoding_type": "Lookahead", "max_window_size": 3, "max_ngram_size": 3, "max_verification_set_size": 3},
        {"decoding_type": "DraftTarget", "max_draft_len": 3, "speculative_model_dir": str(smollm2_dir)},
        {"decoding_type": "Medusa", "speculative_model_dir": str(medusa), "medusa_choices": [[0], [1], [0, 0]]},
        {"decoding_type": "Eagle3", "speculative_model_dir": str(eagle3), "eagle_choices": [[0], [1], [0, 0]]},
    ]
    results = []
    for spec in [None] + specs:
        engine = make_engine(smollm2_dir, spec, kv_cache_config={"tokens_per_block": 16, "max_tokens": 4096})
        try:
            handles = [
                engine.generate_async(p, SamplingParams(max_tokens=n, end_id=tokenizer.eos_token_id))
                for p, n in zip(prompts, [40, 12, 24])
            ]
            results.append([h.result().outputs[0] for h in handles])
            assert_all_blocks_free(engine)
        finally:
            engine.shutdown()
    reference = [o.token_ids for o in results[0]]
    for spec, outputs in zip(specs, results[1:]):
        assert [o.token_ids for o in outputs] == reference, spec["decoding_type"]
        assert sum(o.request_perf_metrics.total_draft_tokens for o in outputs) > 0, spec["decoding_type"]
    assert results[1][0].request_perf_metrics.total_accepted_draft_tokens > 0  # n-gram on the grounded prompt


def test_generate_json_lines_report_draft_counts(model_dir, tmp_path, capsys):
    import json

    from tritonllm.commands.main import main as cli_main

    config = tmp_path / "model.yaml"
    config.write_text(
        f"speculative_config:\n  decoding_type: DraftTarget\n  max_draft_len: 3\n  speculative_model_dir: {model_dir}\n"
    )
    assert (
        cli_main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--config",
                str(config),
                "--prompt",
                "hello there",
                "--prompt",
                "a b c d",
                "--max-tokens",
                "12",
                "--json",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(records) == 2
    for record in records:
        stats = record["stats"]
        assert stats["total_draft_tokens"] > 0 and stats["total_accepted_draft_tokens"] == stats["total_draft_tokens"]
        assert stats["acceptance_rate"] == 1.0


def test_per_request_lookahead_configs_mix_in_one_batch_and_stay_greedy(
    model_dir, other_draft_dir, medusa_dir, reference
):
    """Each request may narrow the engine's lookahead (TensorRT-LLM's SamplingParams.lookahead_config)."""
    from tritonllm.spec_decode.config import LookaheadConfig

    engine = make_engine(model_dir, methods(model_dir, other_draft_dir, medusa_dir)["lookahead"])
    own = [
        LookaheadConfig(max_window_size=2, max_ngram_size=2, max_verification_set_size=1),
        None,
        LookaheadConfig(max_window_size=3, max_ngram_size=3, max_verification_set_size=3),
        LookaheadConfig(max_window_size=1, max_ngram_size=3, max_verification_set_size=2),
    ]
    try:
        handles = [
            engine.generate_async(p, SamplingParams(max_tokens=n, end_id=2, lookahead_config=c))
            for p, n, c in zip(PROMPTS, MAX_TOKENS, own)
        ]
        outputs = [h.result().outputs[0] for h in handles]
        assert [o.token_ids for o in outputs] == reference
        assert outputs[0].request_perf_metrics.total_draft_tokens > 0
        decoders = engine.core.speculator.method.decoders
        assert {c for c in own if c is not None} <= set(decoders)  # each request ran with its own (W, N, G)
        assert_all_blocks_free(engine)
        too_wide = LookaheadConfig(max_window_size=4, max_ngram_size=3, max_verification_set_size=3)
        with pytest.raises(InvalidRequestError, match="window size 4 exceeds the model instance's 3"):
            engine.generate_async(PROMPTS[0], SamplingParams(max_tokens=4, lookahead_config=too_wide))
    finally:
        engine.shutdown()
    plain = make_engine(model_dir)
    try:
        with pytest.raises(InvalidRequestError, match="needs the model instance's lookahead decoding"):
            plain.generate_async(PROMPTS[0], SamplingParams(max_tokens=4, lookahead_config=own[0]))
    finally:
        plain.shutdown()


def test_a_request_can_opt_out_of_speculation_in_a_speculating_batch(model_dir, reference):
    """`SamplingParams.speculate=False` (what `bench spec` measures its baseline with): that request decodes one
    token per step, the others in the batch still speculate, and every output stays plain greedy."""
    engine = make_engine(model_dir, {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 3})
    try:
        handles = [
            engine.generate_async(p, SamplingParams(max_tokens=n, end_id=2, speculate=i % 2 == 0))
            for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))
        ]
        outputs = [h.result().outputs[0] for h in handles]
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outputs] == reference
    assert [o.request_perf_metrics.total_draft_tokens > 0 for o in outputs[:2]] == [True, False]
    assert outputs[1].request_perf_metrics.total_accepted_draft_tokens == 0


@pytest.mark.parametrize("method", ["ngram", "draft_same", "medusa", "lookahead"])
def test_verification_steps_in_cuda_graphs_stay_plain_greedy(
    model_dir, other_draft_dir, medusa_dir, reference, method, graphs_on_this_device
):
    spec = methods(model_dir, other_draft_dir, medusa_dir)[method]
    engine = make_engine(model_dir, spec, cuda_graph_config={"batch_sizes": [1, 2, 4, 8], "enable_padding": True})
    try:
        assert [o.token_ids for o in run_batch(engine)] == reference
        shapes = engine.core.runner.graphs.graphs
        assert any(rows > 1 for _, rows, _ in shapes)  # roots with their drafts, padded to a power of two
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
