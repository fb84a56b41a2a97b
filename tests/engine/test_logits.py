"""Context and generation logits and log-probs against Hugging Face on the same weights (fp32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.types import SamplingParams

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp(request.param), seed=4, arch=request.param)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, tokenizer, hf, tokenizer.encode(PROMPT)


def make_engine(model_dir, **overrides):
    args = {
        "model": str(model_dir),
        "dtype": "float32",
        "device": "cpu",
        "max_num_tokens": 512,
        "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 2048},
    }
    args.update(overrides)
    return EmbeddedEngine(EngineConfig.from_dict(args))


@pytest.mark.parametrize("chunked", [False, True])
def test_context_and_generation_logits_equal_hf(setup, chunked):
    model_dir, tokenizer, hf, ids = setup
    engine = make_engine(model_dir, enable_chunked_prefill=chunked, max_num_tokens=8 if chunked else 512)
    params = SamplingParams(
        max_tokens=8, ignore_eos=True, logprobs=True, return_context_logits=True, return_generation_logits=True
    )
    try:
        engine.generate(ids, params)  # a cached prompt must not shorten the context logits
        output = engine.generate(ids, params)
    finally:
        engine.shutdown()
    completion = output.outputs[0]
    with torch.inference_mode():
        reference = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.eos_token_id,
            eos_token_id=None,
        )
        context = hf(torch.tensor([ids])).logits[0]
    assert completion.token_ids == reference.sequences[0, len(ids) :].tolist()
    assert output.context_logits.shape == (len(ids), hf.config.vocab_size)
    torch.testing.assert_close(output.context_logits, context, atol=1e-4, rtol=1e-4)
    expected_generation = torch.cat(reference.logits)  # [8, vocab]
    assert completion.generation_logits.shape == expected_generation.shape
    torch.testing.assert_close(completion.generation_logits, expected_generation, atol=1e-4, rtol=1e-4)
    chosen = torch.log_softmax(expected_generation, -1).gather(1, torch.tensor(completion.token_ids)[:, None])
    torch.testing.assert_close(torch.tensor(completion.logprobs), chosen[:, 0], atol=1e-4, rtol=1e-4)


def test_streamed_generation_logits_come_with_their_tokens(setup):
    model_dir, _, _, ids = setup
    engine = make_engine(model_dir)
    try:
        rows = []
        for update in engine.generate_async(
            ids, SamplingParams(max_tokens=5, ignore_eos=True, return_generation_logits=True), streaming=True
        ):
            diff = update.outputs[0].generation_logits_diff
            assert diff.shape[0] == len(update.outputs[0].token_ids_diff)
            rows.append(diff)
        whole = engine.generate(ids, SamplingParams(max_tokens=5, ignore_eos=True, return_generation_logits=True))
        # The second run starts from the first one's cached prefix: other matmul shapes, fp32-close results.
        torch.testing.assert_close(torch.cat(rows), whole.outputs[0].generation_logits, atol=1e-4, rtol=1e-4)
    finally:
        engine.shutdown()
