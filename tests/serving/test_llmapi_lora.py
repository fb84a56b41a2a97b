"""LoRA through the LLM-API model's lora_id / lora_name / lora_path inputs (TensorRT-LLM's current llmapi config):
the adapter folder is read from disk on first use and the answer equals Hugging Face PEFT's greedy text."""

from __future__ import annotations

import time

import fake_pb_utils as fake  # registered by conftest.py
import numpy as np
import pytest
import torch

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.deploy.llmapi_repo import build_llmapi_repo

peft = pytest.importorskip("peft", reason="the adapter is built with peft")

PROMPT = "The lamp turned"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    wrapped = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.5)
    folder = tmp_path_factory.mktemp("adapter") / "mine"
    wrapped.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory, load_llmapi_model):
    repo = build_llmapi_repo(
        tiny,
        tmp_path_factory.mktemp("llmapi") / "repo",
        max_seq_len=128,
        dtype="float32",
        device="cpu",
        engine_args={"lora_config": {"max_cpu_loras": 2, "max_loras": 2}},
    )
    with load_llmapi_model(repo) as instance:
        yield instance


def answer(model, **extra) -> str:
    tensors = {
        "text_input": np.array([PROMPT.encode()], dtype=object),
        "sampling_param_max_tokens": np.array([MAX_TOKENS], dtype=np.int32),
        "sampling_param_exclude_input_from_output": np.array([True]),
        **extra,
    }
    req = fake.InferenceRequest(tensors)
    model.execute([req])
    sender = req.get_response_sender()
    deadline = time.monotonic() + 60
    while not sender.finished:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    ((response, _),) = sender.sent
    assert not response.has_error(), response.error().message()
    return response.output_tensors()[0].as_numpy()[0].decode()


def peft_greedy_text(tiny, adapter) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    wrapped = peft.PeftModel.from_pretrained(base, adapter)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = wrapped.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def lora(adapter, lora_id: int = 5, name: str = "mine") -> dict:
    return {
        "lora_id": np.array([lora_id], dtype=np.uint64),
        "lora_name": np.array([name.encode()], dtype=object),
        "lora_path": np.array([str(adapter).encode()], dtype=object),
    }


def test_an_adapter_named_by_lora_id_name_and_path_answers_as_peft_does(model, tiny, adapter):
    base = answer(model)
    with_adapter = answer(model, **lora(adapter))
    assert with_adapter != base, "the adapter changed nothing: pick a stronger one"
    assert with_adapter == peft_greedy_text(tiny, adapter)
    assert answer(model, **lora(adapter)) == with_adapter  # cached under lora_id, read once
    assert answer(model) == base  # the base model is untouched


def test_nemo_checkpoints_are_refused_by_name(model, adapter):
    tensors = {
        "text_input": np.array([PROMPT.encode()], dtype=object),
        **lora(adapter, lora_id=6),
        "lora_ckpt_source": np.array([b"nemo"], dtype=object),
    }
    req = fake.InferenceRequest(tensors)
    model.execute([req])
    deadline = time.monotonic() + 10
    while not req.get_response_sender().finished:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    ((response, _),) = req.get_response_sender().sent
    assert "input 'lora_ckpt_source'" in response.error().message()
