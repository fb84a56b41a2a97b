"""LoRA settings on the Triton side: config.pbtxt's PEFT-cache parameters and model.yaml's lora_config become one
typed engine config; `tritonllm repo build --lora-dir` lists the adapters and their ids; a tensorrt_llm request's
lora_* inputs become a LoRARequest per row."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from tritonllm.commands.main import main as cli_main
from tritonllm.engine.config import ConfigError
from tritonllm.triton.engine_args import load_tensorrt_llm_settings
from tritonllm.triton.llm_request import convert_request
from tritonllm.triton.pb import InputError


def triton_config(params: dict[str, str]) -> dict:
    return {
        "name": "tensorrt_llm",
        "max_batch_size": 8,
        "model_transaction_policy": {"decoupled": True},
        "parameters": {key: {"string_value": value} for key, value in {"gpt_model_path": "/m", **params}.items()},
    }


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("LLM_CONFIG_PATH", raising=False)
    (tmp_path / "1").mkdir()
    return tmp_path


def test_pbtxt_parameters_merge_with_the_yaml_lora_config(model_dir):
    (model_dir / "1" / "model.yaml").write_text(yaml.safe_dump({"lora_config": {"max_loras": 2, "max_cpu_loras": 3}}))
    settings = load_tensorrt_llm_settings(
        triton_config(
            {
                "lora_prefetch_dir": "/adapters",
                "lora_cache_max_adapter_size": "32",
                "lora_cache_host_memory_bytes": "1048576",
                "lora_cache_optimal_adapter_size": "8",
                "lora_cache_gpu_memory_fraction": "0.05",
            }
        ),
        model_dir,
    ).engine.lora_settings()
    assert (settings.max_loras, settings.max_cpu_loras, settings.max_lora_rank) == (2, 3, 32)
    assert settings.lora_dir == ("/adapters",) and settings.host_cache_bytes == 1048576


def test_lora_is_off_unless_asked_and_bad_yaml_names_the_key(model_dir):
    assert load_tensorrt_llm_settings(triton_config({}), model_dir).engine.lora_settings() is None
    (model_dir / "1" / "model.yaml").write_text(yaml.safe_dump({"enable_lora": True, "lora_config": {"max_loras": 0}}))
    with pytest.raises(ConfigError, match="lora_config.max_loras must be an integer >= 1"):
        load_tensorrt_llm_settings(triton_config({}), model_dir)


def test_repo_build_lora_dir_lists_adapters_and_sets_the_prefetch_dir(tiny_llama, peft_factory, tmp_path, capsys):
    adapters = tmp_path / "adapters"
    peft_factory(tiny_llama, adapters / "french", ["q_proj"])
    peft_factory(tiny_llama, adapters / "7", ["v_proj"])
    assert (
        cli_main(
            ["repo", "build", "--model", str(tiny_llama), "--out", str(tmp_path / "repo"), "--lora-dir", str(adapters)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "LoRA adapter '7': lora_task_id 7" in out and "LoRA adapter 'french': lora_task_id 1" in out
    pbtxt = (tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'key: "lora_prefetch_dir" value: {{ string_value: "{adapters}" }}' in pbtxt
    assert (
        cli_main(
            [
                "repo",
                "build",
                "--model",
                str(tiny_llama),
                "--out",
                str(tmp_path / "repo2"),
                "--lora-dir",
                str(tmp_path / "empty_nowhere"),
            ]
        )
        == 2
    )


class Tensor:
    def __init__(self, name, value):
        self._name, self._value = name, value

    def name(self):
        return self._name

    def as_numpy(self):
        return self._value


class Request:
    def __init__(self, **inputs):
        self.inputs_ = {name: np.asarray(value) for name, value in inputs.items()}

    def inputs(self):
        return [Tensor(n, v) for n, v in self.inputs_.items()]


@pytest.fixture
def fake_pb(monkeypatch):
    import tritonllm.triton.pb as pb

    monkeypatch.setattr(pb, "optional_input", lambda request, name, dtype=None: request.inputs_.get(name))
    import tritonllm.triton.llm_request as llm_request

    monkeypatch.setattr(llm_request, "optional_input", lambda request, name, dtype=None: request.inputs_.get(name))


def test_request_inputs_become_lora_requests_per_row(fake_pb):
    weights = np.ones((2, 3, 8), np.float16)
    config = np.ones((2, 3, 3), np.int32)
    base = {
        "input_ids": np.array([[5, 6], [7, 8]]),
        "input_lengths": np.array([[2], [2]]),
        "request_output_len": np.array([[4], [4]]),
    }
    rows = convert_request(
        Request(**base, lora_task_id=np.array([3, 4], np.uint64), lora_weights=weights, lora_config=config), False, True
    )
    assert [r.lora.lora_int_id for r in rows] == [3, 4]
    assert rows[1].lora.lora_weights.shape == (3, 8) and rows[0].lora.lora_config.shape == (3, 3)
    by_name = convert_request(Request(**base, lora_name=np.array([[b"fr"], [b"fr"]], object)), False, True)
    assert by_name[0].lora.lora_name == "fr" and by_name[0].lora.lora_int_id is None
    assert convert_request(Request(**base), False, True)[0].lora is None
    with pytest.raises(InputError, match="'lora_config' is missing"):
        convert_request(Request(**base, lora_task_id=np.array([3, 4], np.uint64), lora_weights=weights), False, True)
    with pytest.raises(InputError, match="'lora_task_id' is required"):
        convert_request(Request(**base, lora_weights=weights, lora_config=config), False, True)
