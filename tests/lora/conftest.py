"""Fixtures for the LoRA tests: a tiny fp32 llama, PEFT adapters made on it, and the PEFT-merged reference."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft", reason="the LoRA tests build their adapters with peft")

from tritonllm.checkpoints.tiny import build_tiny_model  # noqa: E402

DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora_tiny"), seed=3)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def make_peft_adapter(
    model_dir: Path,
    out: Path,
    targets: list[str],
    rank: int = 4,
    alpha: float = 8,
    rslora: bool = False,
    seed: int = 0,
    scale: float = 1.0,
) -> Path:
    """A PEFT folder with random, non-zero A and B (a freshly initialised LoRA has B = 0 and changes nothing)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    wrapped.save_pretrained(out)
    return out


def merged_greedy(
    model_dir: Path, peft_dir: Path | None, prompts: list[list[int]], max_new: int, eos_id: int
) -> list[list[int]]:
    """Greedy tokens of the base model with the adapter merged by PEFT (or of the base model), without the end
    token, as the engine returns them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if peft_dir is not None:
        model = peft.PeftModel.from_pretrained(model, peft_dir).merge_and_unload()
    model = model.to(DEVICE).eval()
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids], device=DEVICE)
            new = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=eos_id,
                pad_token_id=eos_id,
            )[0, len(ids) :].tolist()
            outputs.append(new[: new.index(eos_id)] if eos_id in new else new)
    return outputs


@pytest.fixture(scope="session")
def peft_factory():
    return make_peft_adapter


@pytest.fixture(scope="session")
def merged_reference():
    return merged_greedy
