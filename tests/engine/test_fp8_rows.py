"""FP8 rows (quant/fusion.py): the fused norms and SiLUs before dynamic-FP8 projections quantize their outputs,
and fp8_linear takes those rows instead of quantizing again. The kernels' values are checked in test_fused_ops.py;
here the marking, the hand-over, and on CUDA (TRITONLLM_TEST_DEVICE=cuda) that the engine's greedy output is the
same with the hand-over as without it (the rows hold exactly what the projection's quantizer would write)."""

import os

import pytest
import torch

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.config import EngineConfig
from tritonllm.engine.embedded.engine import EmbeddedEngine
from tritonllm.engine.embedded.loader import load_model
from tritonllm.engine.embedded.network.layers import GatedMLP, RMSNorm, use_fused_kernels
from tritonllm.engine.embedded.quant import fusion, kernels
from tritonllm.engine.types import SamplingParams

DEVICE = os.environ.get("TRITONLLM_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), seed=0, arch="llama")


def fused_model(tiny, quant_config):
    model, _ = load_model(tiny, torch.float32, "cpu", quant_config=quant_config)
    use_fused_kernels(model)
    return model


def marks(model) -> list[bool]:
    return [m.fp8_rows for m in model.modules() if isinstance(m, (RMSNorm, GatedMLP)) and m.fp8_rows]


def test_producers_before_dynamic_fp8_projections_are_marked(tiny, monkeypatch):
    model = fused_model(tiny, {"quant_algo": "FP8"})
    assert fusion.hand_fp8_rows(model, torch.device("cpu")) == 0  # no FP8 matmuls: fp8_linear dequantizes
    monkeypatch.setattr(fusion, "fp8_supported", lambda device: True)
    layers = list(model.decoder_layers)
    assert fusion.hand_fp8_rows(model, torch.device("cpu")) == 3 * len(layers)
    for layer in layers:
        assert layer.input_layernorm.fp8_rows and layer.post_attention_layernorm.fp8_rows and layer.mlp.fp8_rows
    assert not model.norm.fp8_rows  # the final norm feeds the unquantized LM head


@pytest.mark.parametrize("quant_config", [{"quant_algo": "W8A16"}, None], ids=["weight-only", "unquantized"])
def test_other_projections_leave_their_producers_alone(tiny, monkeypatch, quant_config):
    monkeypatch.setattr(fusion, "fp8_supported", lambda device: True)
    model = fused_model(tiny, quant_config)
    assert fusion.hand_fp8_rows(model, torch.device("cpu")) == 0 and not marks(model)


def test_unfused_producers_are_not_marked(tiny, monkeypatch):
    monkeypatch.setattr(fusion, "fp8_supported", lambda device: True)
    model, _ = load_model(tiny, torch.float32, "cpu", quant_config={"quant_algo": "FP8"})
    assert fusion.hand_fp8_rows(model, torch.device("cpu")) == 0  # the torch path writes no rows


def test_fp8_linear_takes_the_rows_its_input_carries(monkeypatch):
    taken = []
    monkeypatch.setattr(kernels, "fp8_supported", lambda device: True)
    monkeypatch.setattr(
        kernels, "_fp8_scaled_mm", lambda x, w, s, b, i, rows=None: taken.append(rows) or x.new_zeros(x.shape[0], 32)
    )
    weight, scale = torch.zeros(32, 64, dtype=torch.float8_e4m3fn), torch.ones(32)
    x = torch.randn(4, 64)
    x.fp8_rows = rows = (torch.zeros(4, 64, dtype=torch.float8_e4m3fn), torch.ones(4, 1))
    kernels.fp8_linear(x, weight, scale, None)
    kernels.fp8_linear(x, weight, scale, None, input_scale=torch.tensor(0.5))  # static: its own scale
    kernels.fp8_linear(x.view(4, 64), weight, scale, None)  # a view carries nothing
    assert taken[0] is rows and taken[1:] == [None, None]


@pytest.mark.skipif(DEVICE != "cuda", reason="FP8 matmuls need a GPU with FP8 tensor cores")
def test_the_engine_gives_the_same_greedy_output_with_and_without_the_rows(tiny, monkeypatch):
    config = {"model": str(tiny), "dtype": "bfloat16", "device": "cuda", "quant_config": {"quant_algo": "FP8"}}
    prompts = [[1, 5, 9, 14, 3], [7, 7, 2], list(range(2, 40))]
    outputs = []
    for handed in (True, False):
        monkeypatch.setattr(fusion, "FP8_ROWS", handed)
        engine = EmbeddedEngine(EngineConfig.from_dict(config))
        try:
            assert bool(marks(engine.core.model)) == handed
            params = SamplingParams(max_tokens=16, end_id=-1)
            outputs.append([engine.generate(p, params).outputs[0].token_ids for p in prompts])
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]
