"""LoRA on Gemma 2 and Gemma 3 (the tiny models): the embedded engine with a PEFT adapter on every projection
against the PEFT-merged Hugging Face model, greedy, fp32, token for token; with the base model in the same batch."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.types import LoRARequest

from .test_engine_lora import ATTENTION, MAX_NEW, MLP, PROMPTS, greedy, make_engine


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_adapter_matches_peft_merged_model(arch, tmp_path, peft_factory, merged_reference):
    model_dir = build_tiny_model(tmp_path / arch, seed=3, arch=arch)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    peft_dir = peft_factory(model_dir, tmp_path / "adapter", ATTENTION + MLP, rank=4, alpha=8, seed=1)
    expected = merged_reference(model_dir, peft_dir, prompt_ids, MAX_NEW, tokenizer.eos_token_id)
    base = merged_reference(model_dir, None, prompt_ids, MAX_NEW, tokenizer.eos_token_id)
    assert expected != base  # the adapter changes the output, so the comparison means something
    engine = make_engine(model_dir)
    try:
        lora = LoRARequest("adapter", 7, str(peft_dir))
        handles = [engine.generate_async(ids, greedy(tokenizer), lora_request=lora) for ids in prompt_ids]
        handles += [engine.generate_async(ids, greedy(tokenizer)) for ids in prompt_ids]
        got = [h.result().outputs[0].token_ids for h in handles]
        assert got == expected + base
        stats = engine.wait_idle()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()
