"""LoRA on a quantized base model: the adapters' deltas add to the quantized projections' outputs, so the tokens
are those of PEFT merging the adapter into the dense weights the quantized checkpoint holds (compressed-tensors'
own fake-quantized weights, saved as a dense reference)."""

from __future__ import annotations

import shutil

from tritonllm.engine.types import LoRARequest

from ..engine.quant_checkpoints import write_compressed_tensors
from .conftest import ATTENTION, MLP
from .test_engine_lora import MAX_NEW, PROMPTS, greedy, make_engine


def test_an_adapter_on_a_w4a16_checkpoint_matches_peft_on_its_dense_weights(
    tiny_llama, tiny_tokenizer, peft_factory, merged_reference, tmp_path
):
    reference = shutil.copytree(tiny_llama, tmp_path / "reference")
    quantized = write_compressed_tensors(tiny_llama, tmp_path / "w4a16", "W4A16", 32, dense_reference=reference)
    peft_dir = peft_factory(tiny_llama, tmp_path / "adapter", ATTENTION + MLP, rank=4, alpha=8, rslora=False, seed=1)
    prompt_ids = [tiny_tokenizer.encode(p) for p in PROMPTS]
    eos = tiny_tokenizer.eos_token_id
    expected = merged_reference(reference, peft_dir, prompt_ids, MAX_NEW, eos)
    assert expected != merged_reference(reference, None, prompt_ids, MAX_NEW, eos)  # the adapter matters
    engine = make_engine(quantized)
    try:
        lora = LoRARequest("adapter", 3, str(peft_dir))
        got = [
            engine.generate(ids, greedy(tiny_tokenizer), lora_request=lora).outputs[0].token_ids for ids in prompt_ids
        ]
        assert got == expected
    finally:
        engine.shutdown()
