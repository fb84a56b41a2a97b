"""LoRA on Phi-3 against the PEFT-merged Hugging Face model, greedy in fp32: PEFT adapters of Phi-3 target its fused
`qkv_proj` and `gate_up_proj`, which the reader splits into the parts' adapters (A shared, B by rows)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.types import LoRARequest, SamplingParams
from tritonllm.lora.convert import convert_peft_folder
from tritonllm.lora.modules import LoraFormatError

from .test_engine_lora import PROMPTS, make_engine

MAX_NEW = 16
TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny_phi3(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("lora_phi3"), seed=3, arch="phi3")


def test_fused_phi3_adapter_matches_peft_merged_model(tiny_phi3, peft_factory, merged_reference, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_phi3)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    eos = tokenizer.eos_token_id
    peft_dir = peft_factory(tiny_phi3, tmp_path / "adapter", TARGETS, rank=4, alpha=8, seed=1)
    expected = merged_reference(tiny_phi3, peft_dir, prompt_ids, MAX_NEW, eos)
    assert expected != merged_reference(tiny_phi3, None, prompt_ids, MAX_NEW, eos)
    engine = make_engine(tiny_phi3)
    try:
        lora = LoRARequest("phi3", 3, str(peft_dir))
        params = SamplingParams(max_tokens=MAX_NEW, end_id=eos)
        got = [engine.generate(ids, params, lora_request=lora).outputs[0].token_ids for ids in prompt_ids]
        assert got == expected
    finally:
        engine.shutdown()


def test_converting_a_fused_adapter_without_the_model_is_refused_by_name(tiny_phi3, peft_factory, tmp_path):
    peft_dir = peft_factory(tiny_phi3, tmp_path / "adapter", ["qkv_proj"], rank=2, alpha=4, seed=2)
    with pytest.raises(LoraFormatError, match="fused qkv_proj adapter"):
        convert_peft_folder(peft_dir, tmp_path / "npy")
