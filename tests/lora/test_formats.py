"""PEFT folders and TensorRT-LLM's lora_weights / lora_config tensors: layout, round trips, refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tritonllm.commands.main import main as cli_main
from tritonllm.lora.modules import LoraFormatError, ModuleShapes, module_named
from tritonllm.lora.peft_folder import read_peft_folder
from tritonllm.lora.settings import LoraSettings, LoraSettingsError
from tritonllm.lora.trtllm_format import adapter_from_tensors, adapter_to_tensors

SHAPES = ModuleShapes.of_model(hidden=64, intermediate=160, q_size=64, kv_size=32, num_layers=2)


@pytest.fixture(scope="module")
def peft_dir(tiny_llama, peft_factory, tmp_path_factory):
    return peft_factory(
        tiny_llama,
        tmp_path_factory.mktemp("fmt") / "a",
        ["q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"],
        rank=4,
        alpha=6,
        rslora=True,
    )


def test_peft_folder_folds_the_rslora_scale_into_b(peft_dir):
    adapter = read_peft_folder(peft_dir)
    raw = load_file(str(peft_dir / "adapter_model.safetensors"))
    a, b = adapter.weights[(1, "k_proj")]
    prefix = "base_model.model.model.layers.1.self_attn.k_proj"
    assert torch.equal(a, raw[f"{prefix}.lora_A.weight"])
    assert torch.allclose(b, raw[f"{prefix}.lora_B.weight"] * (6 / math.sqrt(4)))
    assert adapter.modules == {"q_proj", "k_proj", "gate_proj", "up_proj", "down_proj"}
    assert adapter.rank == 4


def test_tensor_layout_is_trtllm_s(peft_dir):
    adapter = read_peft_folder(peft_dir)
    weights, config = adapter_to_tensors(adapter, np.float32)
    assert weights.shape[:2] == (1, 10) and config.shape == (1, 10, 3) and config.dtype == np.int32
    # rows by layer, then module id: attn_q 1, attn_k 2, mlp_h_to_4h (gate_proj) 5, mlp_4h_to_h 6, mlp_gate (up) 7
    assert config[0, :5].tolist() == [[1, 0, 4], [2, 0, 4], [5, 0, 4], [6, 0, 4], [7, 0, 4]]
    a, b = adapter.weights[(0, "k_proj")]
    row = weights[0, 1]
    assert np.array_equal(row[: 4 * 64], a.reshape(-1).numpy())  # in-weights [rank, hidden]
    assert np.array_equal(row[4 * 64 : 4 * 64 + 32 * 4], b.reshape(-1).numpy())  # out-weights [out, rank]
    assert not row[4 * 64 + 32 * 4 :].any()  # padding
    assert weights.shape[2] == 4 * (64 + 160)  # the longest row: gate/up/down
    back = adapter_from_tensors(weights, config, SHAPES)
    assert back.weights.keys() == adapter.weights.keys()
    for key, (a, b) in adapter.weights.items():
        assert torch.equal(back.weights[key][0], a) and torch.equal(back.weights[key][1], b)


def test_tensors_that_do_not_match_the_model_are_refused(peft_dir):
    weights, config = adapter_to_tensors(read_peft_folder(peft_dir), np.float16)
    with pytest.raises(LoraFormatError, match="lora_weights has 10 rows but lora_config has 9"):
        adapter_from_tensors(weights, config[:, :9], SHAPES)
    with pytest.raises(LoraFormatError, match="converted for another model"):
        adapter_from_tensors(np.pad(weights, ((0, 0), (0, 0), (0, 8))), config, SHAPES)
    bad = config.copy()
    bad[0, 0, 0] = 0
    with pytest.raises(LoraFormatError, match="module id 0 is not supported"):
        adapter_from_tensors(weights, bad, SHAPES)
    adapter = adapter_from_tensors(weights, config, ModuleShapes(SHAPES.shapes, num_layers=1))
    with pytest.raises(LoraFormatError, match="layer index 1 is outside the model's 1 layers"):
        adapter.check(ModuleShapes(SHAPES.shapes, num_layers=1))
    with pytest.raises(LoraFormatError, match="is not among the enabled LoRA target modules"):
        adapter.check(SHAPES, targets=["q_proj"])


def test_peft_features_beyond_plain_lora_are_refused(peft_dir, tmp_path):
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        (tmp_path / name).write_bytes((peft_dir / name).read_bytes())
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoraFormatError, match="use_dora=True is not supported"):
        read_peft_folder(tmp_path)
    with pytest.raises(LoraFormatError, match="no adapter_config.json"):
        read_peft_folder(tmp_path / "missing")


def test_convert_command_writes_the_npy_pair(peft_dir, tmp_path, capsys):
    assert cli_main(["lora", "convert", str(peft_dir), "--out", str(tmp_path)]) == 0
    weights = np.load(tmp_path / "model.lora_weights.npy")
    config = np.load(tmp_path / "model.lora_config.npy")
    assert weights.dtype == np.float16 and weights.shape[:2] == config.shape[:2] == (1, 10)
    assert cli_main(["lora", "convert", str(tmp_path / "nope"), "--out", str(tmp_path)]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def test_settings_are_typed_and_checked():
    settings = LoraSettings.from_dict(
        {"max_loras": 2, "max_cpu_loras": 3, "lora_dir": "/x", "lora_target_modules": ["attn_q", "mlp_gate"]}
    )
    assert settings.lora_dir == ("/x",) and settings.lora_target_modules == ("q_proj", "up_proj")
    assert module_named("mlp_h_to_4h").hf_name == "gate_proj"
    with pytest.raises(LoraSettingsError, match="max_cpu_loras=1 must be >= max_loras=2"):
        LoraSettings.from_dict({"max_loras": 2, "max_cpu_loras": 1})
    with pytest.raises(LoraSettingsError, match="unknown key"):
        LoraSettings.from_dict({"max_lora": 2})
    with pytest.raises(LoraSettingsError, match="unknown LoRA target module 'attn_x'"):
        LoraSettings.from_dict({"lora_target_modules": ["attn_x"]})
