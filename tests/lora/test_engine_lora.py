"""The embedded engine with LoRA adapters against the PEFT-merged Hugging Face model: greedy, fp32, token for token,
one adapter at a time and several adapters (and the base model) in one batch."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.types import GuidedDecodingParams, InvalidRequestError, LoRARequest, SamplingParams
from tritonllm.lora.convert import CONFIG_NPY, WEIGHTS_NPY, convert_peft_folder

DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, and then",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
MAX_NEW = 16


def make_engine(model_dir, **lora_config) -> EmbeddedEngine:
    return EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(model_dir),
                "dtype": "float32",
                "device": DEVICE,
                "max_batch_size": 8,
                "max_num_tokens": 512,
                "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 4096},
                "enable_lora": True,
                "lora_config": lora_config,
            }
        )
    )


def greedy(tokenizer) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, end_id=tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def prompt_ids(tiny_tokenizer):
    return [tiny_tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def base_tokens(tiny_llama, tiny_tokenizer, prompt_ids, merged_reference):
    return merged_reference(tiny_llama, None, prompt_ids, MAX_NEW, tiny_tokenizer.eos_token_id)


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
@pytest.mark.parametrize("targets", [ATTENTION, MLP, ATTENTION + MLP], ids=["attention", "mlp", "both"])
def test_adapter_matches_peft_merged_model(
    tiny_llama, tiny_tokenizer, prompt_ids, base_tokens, peft_factory, merged_reference, tmp_path, targets, rslora
):
    peft_dir = peft_factory(tiny_llama, tmp_path / "adapter", targets, rank=4, alpha=8, rslora=rslora, seed=1)
    expected = merged_reference(tiny_llama, peft_dir, prompt_ids, MAX_NEW, tiny_tokenizer.eos_token_id)
    assert expected != base_tokens  # the adapter changes the output, so the comparison means something
    engine = make_engine(tiny_llama)
    try:
        lora = LoRARequest("adapter", 7, str(peft_dir))
        got = [
            engine.generate(ids, greedy(tiny_tokenizer), lora_request=lora).outputs[0].token_ids for ids in prompt_ids
        ]
        assert got == expected
        assert engine.wait_idle().num_free_blocks == engine.wait_idle().num_total_blocks
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def two_adapters(tiny_llama, tiny_tokenizer, prompt_ids, peft_factory, merged_reference, tmp_path_factory):
    work = tmp_path_factory.mktemp("two_adapters")
    first = peft_factory(tiny_llama, work / "first", ATTENTION + MLP, rank=4, seed=11)
    second = peft_factory(tiny_llama, work / "second", ["q_proj", "v_proj", "down_proj"], rank=8, seed=12, rslora=True)
    eos = tiny_tokenizer.eos_token_id
    return {
        "first": (first, merged_reference(tiny_llama, first, prompt_ids, MAX_NEW, eos)),
        "second": (second, merged_reference(tiny_llama, second, prompt_ids, MAX_NEW, eos)),
    }


def test_base_and_two_adapters_in_one_batch(tiny_llama, tiny_tokenizer, prompt_ids, base_tokens, two_adapters):
    """Every prompt three times (base, first, second adapter) submitted together: each gets its own tokens."""
    engine = make_engine(tiny_llama)
    try:
        jobs = []
        for ids, base in zip(prompt_ids, base_tokens):
            jobs.append((engine.generate_async(ids, greedy(tiny_tokenizer)), base))
        for task_id, name in ((1, "first"), (2, "second")):
            path, expected = two_adapters[name]
            for ids, want in zip(prompt_ids, expected):
                handle = engine.generate_async(
                    ids, greedy(tiny_tokenizer), lora_request=LoRARequest(name, task_id, str(path))
                )
                jobs.append((handle, want))
        assert [h.result().outputs[0].token_ids for h, _ in jobs] == [want for _, want in jobs]
        assert engine.core.lora.slots.num_loads == 2
    finally:
        engine.shutdown()


def test_converted_tensors_give_the_peft_folder_tokens(tiny_llama, tiny_tokenizer, prompt_ids, two_adapters, tmp_path):
    """The converter's .npy pair sent in memory, then the id alone, then the folder preloaded by name."""
    path, expected = two_adapters["second"]
    weights_file, config_file = convert_peft_folder(path, tmp_path / "npy", dtype="float32")
    weights, config = np.load(weights_file), np.load(config_file)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "second").symlink_to(path, target_is_directory=True)
    engine = make_engine(tiny_llama, lora_dir=str(tmp_path / "dir"))
    try:
        params = greedy(tiny_tokenizer)
        first = engine.generate(
            prompt_ids[1], params, LoRARequest(lora_int_id=42, lora_weights=weights, lora_config=config)
        )
        again = engine.generate(prompt_ids[1], params, LoRARequest(lora_int_id=42))
        by_name = engine.generate(prompt_ids[1], params, LoRARequest(lora_name="second"))
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == by_name.outputs[0].token_ids == expected[1]
    finally:
        engine.shutdown()


def test_a_guided_request_with_an_adapter_follows_its_grammar(tiny_llama, tiny_tokenizer, prompt_ids, two_adapters):
    """The grammar masks the adapter's logits: its output is in the language (random weights never are by chance)."""
    pattern = r"(red|green|blue)-[0-9]{2,4}\."
    config = {
        "model": str(tiny_llama),
        "dtype": "float32",
        "device": DEVICE,
        "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 4096},
        "enable_lora": True,
        "guided_decoding_backend": "xgrammar",
    }
    engine = EmbeddedEngine(EngineConfig.from_dict(config))
    try:
        params = SamplingParams(max_tokens=32, guided_decoding=GuidedDecodingParams(regex=pattern))
        lora = LoRARequest("first", 1, str(two_adapters["first"][0]))
        output = engine.generate(prompt_ids[2], params, lora_request=lora).outputs[0]
        assert output.finish_reason == "stop"
        assert re.fullmatch(pattern, tiny_tokenizer.decode(output.token_ids, skip_special_tokens=True))
        assert engine.core.guided.matchers == {}
    finally:
        engine.shutdown()


def test_fp16_tensors_are_close_to_the_peft_folder(tiny_llama, tiny_tokenizer, prompt_ids, two_adapters, tmp_path):
    """What clients really send: float16 weights. The first tokens agree with the fp32 folder."""
    path, expected = two_adapters["first"]
    weights_file, config_file = convert_peft_folder(path, tmp_path)
    assert (tmp_path / WEIGHTS_NPY).is_file() and (tmp_path / CONFIG_NPY).is_file()
    engine = make_engine(tiny_llama)
    try:
        out = engine.generate(
            prompt_ids[2],
            greedy(tiny_tokenizer),
            LoRARequest(lora_int_id=5, lora_weights=np.load(weights_file), lora_config=np.load(config_file)),
        )
        assert out.outputs[0].token_ids[:4] == expected[2][:4]
    finally:
        engine.shutdown()


def test_errors_name_the_id_or_tensor(tiny_llama, tiny_tokenizer, prompt_ids, two_adapters, tmp_path):
    path, _ = two_adapters["second"]
    weights_file, config_file = convert_peft_folder(path, tmp_path)
    weights, config = np.load(weights_file), np.load(config_file)
    engine = make_engine(tiny_llama, max_lora_rank=4)
    params = greedy(tiny_tokenizer)
    try:
        with pytest.raises(InvalidRequestError, match="LoRA task 99 not found in cache"):
            engine.generate(prompt_ids[0], params, LoRARequest(lora_int_id=99))
        with pytest.raises(InvalidRequestError, match="lora_task_id 3: lora_config is missing"):
            engine.generate(prompt_ids[0], params, LoRARequest(lora_int_id=3, lora_weights=weights))
        with pytest.raises(InvalidRequestError, match="rank 8 is above max_lora_rank 4"):
            engine.generate(prompt_ids[0], params, LoRARequest(lora_int_id=3, lora_weights=weights, lora_config=config))
        with pytest.raises(InvalidRequestError, match="lora_weights row 0 .* does not match the model"):
            engine.generate(
                prompt_ids[0], params, LoRARequest(lora_int_id=3, lora_weights=weights[:, :, :100], lora_config=config)
            )
        with pytest.raises(InvalidRequestError, match="unknown LoRA adapter name 'nope'"):
            engine.generate(prompt_ids[0], params, LoRARequest(lora_name="nope"))
        # the engine still serves the base model
        assert engine.generate(prompt_ids[0], params).outputs[0].token_ids
    finally:
        engine.shutdown()


def test_lora_request_without_enable_lora_is_refused(tiny_llama, tiny_tokenizer, prompt_ids):
    engine = EmbeddedEngine(EngineConfig.from_dict({"model": str(tiny_llama), "dtype": "float32", "device": DEVICE}))
    try:
        with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
            engine.generate(prompt_ids[0], greedy(tiny_tokenizer), LoRARequest(lora_int_id=1))
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "spec",
    [
        {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2},
        {"decoding_type": "Lookahead", "max_window_size": 3, "max_ngram_size": 3, "max_verification_set_size": 3},
    ],
    ids=["ngram", "lookahead"],
)
def test_speculation_with_adapters_keeps_each_adapters_greedy_tokens(
    tiny_llama, tiny_tokenizer, prompt_ids, base_tokens, two_adapters, spec
):
    """Drafts are verified by the forward of the request's own adapter, so speculation never changes its tokens."""
    engine = EmbeddedEngine(
        EngineConfig.from_dict(
            {
                "model": str(tiny_llama),
                "dtype": "float32",
                "device": DEVICE,
                "max_batch_size": 8,
                "max_num_tokens": 512,
                "kv_cache_config": {"tokens_per_block": 8, "max_tokens": 4096},
                "enable_lora": True,
                "speculative_config": spec,
            }
        )
    )
    # Repetitive prompts give the model-free drafters something to propose.
    prompts = [ids * 3 for ids in prompt_ids]
    try:
        jobs = [(engine.generate_async(ids, greedy(tiny_tokenizer)), None) for ids in prompts]
        for task_id, name in ((1, "first"), (2, "second")):
            path = two_adapters[name][0]
            for ids in prompts:
                jobs.append(
                    (
                        engine.generate_async(
                            ids, greedy(tiny_tokenizer), lora_request=LoRARequest(name, task_id, str(path))
                        ),
                        name,
                    )
                )
        got = [handle.result().outputs[0] for handle, _ in jobs]
    finally:
        engine.shutdown()
    plain = make_engine(tiny_llama)
    try:
        want = [plain.generate(ids, greedy(tiny_tokenizer)).outputs[0].token_ids for ids in prompts]
        for task_id, name in ((1, "first"), (2, "second")):
            lora = LoRARequest(name, task_id, str(two_adapters[name][0]))
            want += [
                plain.generate(ids, greedy(tiny_tokenizer), lora_request=lora).outputs[0].token_ids for ids in prompts
            ]
    finally:
        plain.shutdown()
    assert [o.token_ids for o in got] == want
    assert sum(o.request_perf_metrics.total_draft_tokens for o in got) > 0
