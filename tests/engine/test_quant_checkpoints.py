"""Quantized checkpoints into the embedded engine: compressed-tensors ones written by compressed-tensors (FP8
dynamic, W8A16, W4A16, symmetric and not, packed and naive) against Hugging Face transformers, which reads them on
CPU by decompressing them; AWQ and GPTQ ones written in their documented layouts from known weights (no tool here
writes them: AutoAWQ and AutoGPTQ need CUDA builds), checked against those weights; and the loader's refusals.

Tolerances (fp32 logits): weight-only schemes 1e-4, as for unquantized models: both sides multiply by the same
dequantized weights. FP8 also quantizes activations per token; a difference of ~1e-6 upstream (HF's and our
kernels round differently) can move one activation across an fp8 rounding boundary, one fp8 step (~6%) of that
element, which measurably moves logits of this tiny model (std ~12): atol 0.5 there, and greedy tokens equal."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.embedded.loader import ModelLoadError, load_model
from tritonllm.engine.embedded.quant.formats import dequantize_int4
from tritonllm.engine.embedded.quant.linear import QuantLinear

from .quant_checkpoints import write_compressed_tensors, write_int4_checkpoint
from .test_model_code import BLOCK_SIZE, PROMPT, decode_step, empty_caches, hf_logits, prefill

WEIGHT_ONLY_TOLERANCE = 1e-4
FP8_ATOL = 0.5
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), seed=0, arch=request.param)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), seed=1, arch="llama")


def greedy(model, config, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    caches = empty_caches(config, -(-(len(prompt) + new_tokens) // BLOCK_SIZE))
    logits, caches = prefill(model, config, prompt, caches)
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < new_tokens:
        tokens.append(int(decode_step(model, tokens[-1], len(prompt) + len(tokens) - 1, caches).argmax()))
    return tokens


def hf_greedy(model_dir, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def quant_modules(model) -> list[QuantLinear]:
    return [m for m in model.modules() if isinstance(m, QuantLinear)]


@pytest.mark.parametrize(
    "preset, group_size, fmt, kind",
    [
        ("FP8_DYNAMIC", None, None, "fp8"),
        ("W8A16", 32, None, "int8"),  # the preset's grouped int8, packed four to a word
        ("W8A16", None, "naive-quantized", "int8"),  # per channel, int8 tensors
        ("W4A16", 32, None, "int4"),
        ("W4A16", 32, "naive-quantized", "int4"),
    ],
)
def test_compressed_tensors_checkpoint_matches_transformers(tiny, tmp_path, preset, group_size, fmt, kind):
    folder = write_compressed_tensors(tiny, tmp_path / "ct", preset, group_size, fmt)
    model, config = load_model(folder, torch.float32, "cpu")
    modules = quant_modules(model)
    assert len(modules) == 4 * config.num_layers and {m.kind for m in modules} == {kind}
    logits, _ = prefill(model, config, PROMPT)
    tolerance = dict(atol=FP8_ATOL, rtol=0) if kind == "fp8" else dict(atol=WEIGHT_ONLY_TOLERANCE, rtol=1e-4)
    torch.testing.assert_close(logits, hf_logits(folder, PROMPT), **tolerance)
    assert greedy(model, config, PROMPT[:6]) == hf_greedy(folder, PROMPT[:6])


def test_static_fp8_checkpoint_matches_transformers_and_reads_as_quant_method_fp8(tiny_llama, tmp_path):
    """compressed-tensors' FP8 preset: per-tensor weight scales and a static per-tensor activation scale
    (calibrated on the prompt). The same tensors under quant_method fp8 (vLLM's per-tensor FP8 layout, which no
    tool here writes) load to the same logits."""
    folder = write_compressed_tensors(tiny_llama, tmp_path / "ct", "FP8", calibration=PROMPT)
    model, config = load_model(folder, torch.float32, "cpu")
    module = model.layers[0].self_attn.qkv_proj
    assert module.kind == "fp8" and module.input_scale is not None and float(module.input_scale) > 0
    assert len(set(module.weight_scale.tolist())) == 3  # q, k and v each brought their per-tensor scale
    logits, _ = prefill(model, config, PROMPT)
    torch.testing.assert_close(logits, hf_logits(folder, PROMPT), atol=FP8_ATOL, rtol=0)
    fp8_folder = shutil.copytree(folder, tmp_path / "fp8")
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    (fp8_folder / "config.json").write_text(json.dumps(raw))
    tensors = load_file(folder / "model.safetensors")
    tensors = {k: v.reshape(()) if k.endswith(("_scale",)) and v.numel() == 1 else v for k, v in tensors.items()}
    save_file(tensors, str(fp8_folder / "model.safetensors"), metadata={"format": "pt"})
    same, _ = load_model(fp8_folder, torch.float32, "cpu")
    torch.testing.assert_close(prefill(same, config, PROMPT)[0], logits, atol=0, rtol=0)


def test_asymmetric_int4_matches_compressed_tensors_dequantized_weights(tiny_llama, tmp_path):
    """transformers 5.24 cannot load an asymmetric pack-quantized checkpoint (it expects the zero points
    unpacked), so the reference is the model with compressed-tensors' own fake-quantized weights."""
    reference = shutil.copytree(tiny_llama, tmp_path / "reference")
    folder = write_compressed_tensors(tiny_llama, tmp_path / "ct", "W4A16_ASYM", 32, dense_reference=reference)
    assert not json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"
    ]["symmetric"]
    model, config = load_model(folder, torch.float32, "cpu")
    assert any(bool((m.weight_zero != 8).any()) for m in quant_modules(model))
    logits, _ = prefill(model, config, PROMPT)
    torch.testing.assert_close(logits, hf_logits(reference, PROMPT), atol=WEIGHT_ONLY_TOLERANCE, rtol=1e-4)


# Each fused projection of the engine and the checkpoint projections stacked into it, in order.
FUSED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}


def dequantized(module: QuantLinear) -> torch.Tensor:
    return dequantize_int4(module.qweight, module.weight_scale, module.weight_zero, module.group_size)


@pytest.mark.parametrize("method, gptq_v1", [("awq", False), ("gptq", True), ("gptq", False)])
def test_awq_and_gptq_layouts_dequantize_to_the_known_weights(tiny_llama, tmp_path, method, gptq_v1):
    folder, dense = write_int4_checkpoint(tiny_llama, tmp_path / method, method, group_size=32, gptq_v1=gptq_v1)
    model, config = load_model(folder, torch.float32, "cpu")
    assert len(quant_modules(model)) == 4 * config.num_layers
    for i, layer in enumerate(model.layers):
        for path, parts in FUSED.items():
            block = path.split(".")[0]
            expected = torch.cat([dense[f"model.layers.{i}.{block}.{part}.weight"] for part in parts])
            torch.testing.assert_close(dequantized(layer.get_submodule(path)), expected, atol=0, rtol=0, msg=path)
    tokens = greedy(model, config, PROMPT[:6])
    assert len(tokens) == NEW_TOKENS and all(0 <= t < config.vocab_size for t in tokens)


def test_a_scale_of_the_wrong_shape_is_an_error_naming_it(tiny_llama, tmp_path):
    folder = write_compressed_tensors(tiny_llama, tmp_path / "ct", "W4A16", 32)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:, :2].contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"tensor {name} has shape \\[64, 2\\], expected \\[64, 5\\]"):
        load_model(folder, torch.float32, "cpu")


def test_a_quantized_lm_head_is_refused_by_name(tiny_llama, tmp_path):
    folder = write_compressed_tensors(tiny_llama, tmp_path / "ct", "W8A16", None, "naive-quantized")
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight_scale"] = torch.ones(tensors["lm_head.weight"].shape[0], 1)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="tensor lm_head.weight_scale is quantized, but the embedded engine keeps"):
        load_model(folder, torch.float32, "cpu")


def test_a_quantized_moe_router_is_refused_by_name(tmp_path):
    source = build_tiny_model(tmp_path / "moe", arch="qwen2_moe")
    folder = write_compressed_tensors(source, tmp_path / "ct", "W8A16", None, "naive-quantized")
    with pytest.raises(ModelLoadError, match=r"tensor model.layers.0.mlp.\S+ is quantized, but the embedded engine"):
        load_model(folder, torch.float32, "cpu")


def test_a_quantized_checkpoint_with_dummy_weights_is_quantized_from_its_config(tiny_llama, tmp_path):
    folder = write_compressed_tensors(tiny_llama, tmp_path / "ct", "W4A16", 32)
    (folder / "model.safetensors").unlink()
    model, config = load_model(folder, torch.float32, "cpu", load_format="dummy")
    assert {(m.kind, m.group_size) for m in quant_modules(model)} == {("int4", 32)}
    assert torch.isfinite(prefill(model, config, PROMPT)[0]).all()
