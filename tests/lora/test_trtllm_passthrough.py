"""The TensorRT-LLM adapter passes a folder LoRARequest to the library's generate_async, and refuses in-memory
tensors (its LLM API has no way to take them), on the fake `tensorrt_llm` of tests/engine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from tritonllm.engine import trtllm as adapter
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.types import InvalidRequestError, LoRARequest, SamplingParams

FAKE = Path(__file__).parents[1] / "engine" / "fake_tensorrt_llm.py"


@pytest.fixture
def engine(monkeypatch):
    spec = importlib.util.spec_from_file_location("fake_tensorrt_llm_lora", FAKE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    engine = adapter.TensorRTLLMEngine(EngineConfig.from_dict({"model": "m", "engine": "tensorrt_llm"}))
    yield engine
    engine.shutdown()


def test_folder_adapter_reaches_the_library(engine, tmp_path):
    handle = engine.generate_async(
        [1, 2, 3], SamplingParams(max_tokens=4, end_id=2), lora_request=LoRARequest("fr", 3, str(tmp_path))
    )
    handle.result(timeout=10)
    sent = engine.llm.generate_calls[-1]["lora_request"]
    assert (sent.lora_name, sent.lora_int_id, sent.lora_path) == ("fr", 3, str(tmp_path))
    engine.generate_async([1, 2], SamplingParams(max_tokens=2, end_id=2)).result(timeout=10)
    assert engine.llm.generate_calls[-1]["lora_request"] is None


def test_in_memory_tensors_are_refused_by_name(engine):
    with pytest.raises(InvalidRequestError, match="lora_weights / lora_config"):
        engine.generate_async(
            [1],
            SamplingParams(max_tokens=2, end_id=2),
            lora_request=LoRARequest(
                lora_int_id=1, lora_weights=np.zeros((1, 4)), lora_config=np.zeros((1, 3), dtype=np.int32)
            ),
        )
