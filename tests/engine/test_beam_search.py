"""Beam search in the embedded engine against Hugging Face `generate(num_beams=...)`, fp32, same weights: the
same beams in the same order, for several widths, length penalties and early-stopping rules, alone, next to
other requests, with small KV blocks (forks copy partly filled blocks) and under preemption."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.types import InvalidRequestError, SamplingParams

DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, and then",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Caf\u00e9 cr\u00e8me et pain au chocolat: ",
]
MAX_NEW = 12
# TensorRT-LLM's early_stopping integer -> HF's early_stopping
EARLY_STOPPING = {0: False, 1: True, 2: "never"}


def make_engine(model_dir, **overrides) -> EmbeddedEngine:
    args = {
        "model": str(model_dir),
        "dtype": "float32",
        "device": DEVICE,
        "max_batch_size": 16,
        "max_num_tokens": 512,
        "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 4096},
    }
    args.update(overrides)
    return EmbeddedEngine(EngineConfig.from_dict(args))


def assert_all_blocks_free(engine):
    stats = engine.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("beam"), seed=3, arch="llama")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    # A random model rarely says its real end token: end on a token greedy decoding produces early instead, so
    # that hypotheses finish at different lengths and the stopping rules matter.
    end_ids = [_greedy(model, ids, 6)[3] for ids in prompt_ids]
    return model_dir, model, prompt_ids, end_ids


def _greedy(model, ids, max_new):
    input_ids = torch.tensor([ids], device=DEVICE)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def hf_beams(model, ids, end_id, beams, length_penalty, early_stopping, max_new=MAX_NEW):
    input_ids = torch.tensor([ids], device=DEVICE)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new,
            num_beams=beams,
            num_return_sequences=beams,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=EARLY_STOPPING[early_stopping],
            eos_token_id=end_id,
            pad_token_id=end_id,
        )
    results = []
    for row in out[:, len(ids) :].tolist():
        results.append(row[: row.index(end_id)] if end_id in row else row)  # the engine drops the end token
    return results


def beam_params(end_id, beams, length_penalty=1.0, early_stopping=0, max_tokens=MAX_NEW, **extra):
    return SamplingParams(
        max_tokens=max_tokens,
        end_id=end_id,
        beam_width=beams,
        n=beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        **extra,
    )


@pytest.mark.parametrize(
    "beams,length_penalty,early_stopping", [(2, 1.0, 0), (4, 1.0, 0), (4, 0.0, 1), (3, 2.0, 2), (4, -0.5, 0)]
)
def test_beams_match_hf(tiny, beams, length_penalty, early_stopping):
    model_dir, model, prompt_ids, end_ids = tiny
    engine = make_engine(model_dir, max_beam_width=4)
    try:
        for ids, end_id in zip(prompt_ids, end_ids):
            expected = hf_beams(model, ids, end_id, beams, length_penalty, early_stopping)
            output = engine.generate(ids, beam_params(end_id, beams, length_penalty, early_stopping))
            assert [o.token_ids for o in output.outputs] == expected
            assert all(o.finish_reason in ("stop", "length") for o in output.outputs)
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_beams_next_to_other_requests_with_small_blocks(tiny):
    """Beam forks share full blocks and copy the partly filled one (4-token blocks make that frequent)."""
    model_dir, model, prompt_ids, end_ids = tiny
    expected = [hf_beams(model, ids, end, 4, 1.0, 0) for ids, end in zip(prompt_ids, end_ids)]
    engine = make_engine(model_dir, max_beam_width=4, kv_cache_config={"tokens_per_block": 4, "max_tokens": 4096})
    try:
        handles = []
        for ids, end_id in zip(prompt_ids, end_ids):
            handles.append(engine.generate_async(ids, beam_params(end_id, 4)))
            handles.append(engine.generate_async(ids, SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=5)))
        results = [h.result(timeout=120) for h in handles]
        assert [[o.token_ids for o in r.outputs] for r in results[::2]] == expected
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def hf_beam_scores(model, ids, end_id, beams, max_new):
    input_ids = torch.tensor([ids], device=DEVICE)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new,
            num_beams=beams,
            num_return_sequences=beams,
            do_sample=False,
            eos_token_id=end_id,
            pad_token_id=end_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return out.sequences_scores.tolist()


def test_beams_survive_preemption(tiny):
    """Preempted beams are recomputed by a prefill, whose fp32 rounding differs from the decode steps' a little;
    on a random model's flat distributions that can swap two near-equal beams. So: the best beam is HF's, and
    every beam's length-normalised score equals HF's at the same rank within 1e-4."""
    model_dir, model, prompt_ids, end_ids = tiny
    expected = [hf_beams(model, ids, end, 4, 1.0, 0, max_new=24) for ids, end in zip(prompt_ids, end_ids)]
    expected_scores = [hf_beam_scores(model, ids, end, 4, 24) for ids, end in zip(prompt_ids, end_ids)]
    engine = make_engine(
        model_dir,
        max_beam_width=4,
        scheduler_config={"capacity_scheduler_policy": "MAX_UTILIZATION"},
        kv_cache_config={"tokens_per_block": 4, "max_tokens": 224},
    )
    try:
        handles = [
            engine.generate_async(ids, beam_params(end, 4, max_tokens=24)) for ids, end in zip(prompt_ids, end_ids)
        ]
        results = [h.result(timeout=300) for h in handles]
        assert [r.outputs[0].token_ids for r in results] == [beams[0] for beams in expected]
        for result, scores in zip(results, expected_scores):
            got = [o.cumulative_logprob / (len(o.token_ids) + (o.finish_reason == "stop")) for o in result.outputs]
            assert got == pytest.approx(scores, abs=1e-4)
        assert sum(r.outputs[0].request_perf_metrics.num_preemptions for r in results) > 0
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


def test_fewer_returned_beams_are_the_best_ones(tiny):
    model_dir, model, prompt_ids, end_ids = tiny
    expected = hf_beams(model, prompt_ids[1], end_ids[1], 4, 1.0, 0)
    engine = make_engine(model_dir, max_beam_width=4)
    try:
        params = beam_params(end_ids[1], 4)
        params.n = 2
        output = engine.generate(prompt_ids[1], params)
        assert [o.token_ids for o in output.outputs] == expected[:2]
    finally:
        engine.shutdown()


def test_streamed_beams_end_with_the_final_beams(tiny):
    model_dir, model, prompt_ids, end_ids = tiny
    engine = make_engine(model_dir, max_beam_width=4)
    try:
        final = engine.generate(prompt_ids[0], beam_params(end_ids[0], 2))
        updates = list(engine.generate_async(prompt_ids[0], beam_params(end_ids[0], 2), streaming=True))
        assert len(updates) > 1 and updates[-1].finished
        assert [o.token_ids for o in updates[-1].outputs] == [o.token_ids for o in final.outputs]
        assert all(len(o.token_ids_diff) == len(o.token_ids) for u in updates for o in u.outputs)  # whole beams
    finally:
        engine.shutdown()


def test_beam_limits_are_clear_errors(tiny):
    model_dir, _, prompt_ids, end_ids = tiny
    engine = make_engine(model_dir, max_beam_width=2)
    try:
        with pytest.raises(InvalidRequestError, match="max_beam_width 2"):
            engine.generate(prompt_ids[0], beam_params(end_ids[0], 4))
        with pytest.raises(InvalidRequestError, match="must not exceed beam_width"):
            engine.generate(prompt_ids[0], SamplingParams(max_tokens=4, beam_width=2, n=3))
        with pytest.raises(InvalidRequestError, match="generation_logits"):
            engine.generate(prompt_ids[0], SamplingParams(max_tokens=4, beam_width=2, return_generation_logits=True))
    finally:
        engine.shutdown()


def test_beam_width_one_is_greedy(tiny):
    model_dir, model, prompt_ids, end_ids = tiny
    engine = make_engine(model_dir, max_beam_width=4)
    try:
        for ids, end_id in zip(prompt_ids, end_ids):
            greedy = engine.generate(ids, SamplingParams(max_tokens=MAX_NEW, end_id=end_id))
            one_beam = engine.generate(ids, beam_params(end_id, 1))
            assert one_beam.outputs[0].token_ids == greedy.outputs[0].token_ids
            assert one_beam.outputs[0].token_ids == hf_beams(model, ids, end_id, 1, 1.0, 0)[0]
    finally:
        engine.shutdown()
