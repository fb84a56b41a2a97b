"""`tritonllm quantize`'s checkpoints (checkpoints/quantize_model.py) of the tiny Llama: laid out as compressed-
tensors lays out its own (config, tensor names, dtypes, shapes); read by compressed-tensors and transformers to the
same logits as by the embedded engine (weight-only 1e-4 in fp32; FP8 as the FP8 checkpoint tests: atol 0.5 and
greedy tokens equal), and calibrated: GPTQ's weights, not round-to-nearest's."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tritonllm.checkpoints.quantize_model import QuantizeOptions, quantize_checkpoint
from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.engine.embedded.loader import load_model

from .quant_checkpoints import write_compressed_tensors
from .test_model_code import PROMPT, hf_logits, prefill
from .test_quant_checkpoints import FP8_ATOL, WEIGHT_ONLY_TOLERANCE, greedy, hf_greedy, quant_modules

pytest.importorskip("compressed_tensors")

FAST = dict(samples=4, seq_len=48)
PRESETS = {"W4A16": ("W4A16", 32), "W4A16_ASYM": ("W4A16_ASYM", 32), "FP8": ("FP8_DYNAMIC", None)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), seed=1, arch="llama")


@pytest.fixture(scope="module")
def written(tiny, tmp_path_factory):
    """{algo: folder} for the three algorithms, written once."""
    root = tmp_path_factory.mktemp("gptq")
    for algo in PRESETS:
        quantize_checkpoint(tiny, root / algo, QuantizeOptions(algo, group_size=32, act_order=False, **FAST))
    options = QuantizeOptions("W4A16", group_size=32, act_order=True, **FAST)
    quantize_checkpoint(tiny, root / "act_order", options)
    return {**{algo: root / algo for algo in PRESETS}, "act_order": root / "act_order"}


def tensor_layout(folder) -> dict:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {key: (f.get_slice(key).get_dtype(), f.get_slice(key).get_shape()) for key in f.keys()}


@pytest.mark.parametrize("algo", list(PRESETS))
def test_the_layout_and_config_are_compressed_tensors_own(algo, tiny, written, tmp_path):
    preset, group = PRESETS[algo]
    theirs = write_compressed_tensors(tiny, tmp_path / "ct", preset, group)
    ours = written[algo]
    config = json.loads((ours / "config.json").read_text())
    assert config["quantization_config"] == json.loads((theirs / "config.json").read_text())["quantization_config"]
    layout, expected = tensor_layout(ours), tensor_layout(theirs)
    if algo != "FP8":  # the source is fp32 here; compressed-tensors writes weight_shape int64 too
        assert layout == expected
    else:
        assert layout.keys() == expected.keys() and all(layout[k][1] == expected[k][1] for k in layout)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ours / name).read_bytes() == (tiny / name).read_bytes()


@pytest.mark.parametrize("algo", ["W4A16", "FP8", "act_order"])
def test_transformers_with_compressed_tensors_and_the_engine_agree(algo, written):
    folder = written[algo]
    model, config = load_model(folder, torch.float32, "cpu")
    modules = quant_modules(model)
    assert len(modules) == 4 * config.num_layers and {m.kind for m in modules} == {"fp8" if algo == "FP8" else "int4"}
    logits, _ = prefill(model, config, PROMPT)
    tolerance = dict(atol=FP8_ATOL, rtol=0) if algo == "FP8" else dict(atol=WEIGHT_ONLY_TOLERANCE, rtol=1e-4)
    torch.testing.assert_close(logits, hf_logits(folder, PROMPT), **tolerance)
    assert greedy(model, config, PROMPT[:6]) == hf_greedy(folder, PROMPT[:6])
    if algo == "act_order":  # contiguous groups: compressed-tensors' "weight" ordering, no g_idx
        weights = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]
        assert weights["group_0"]["weights"]["actorder"] == "weight"
        assert not any(key.endswith("g_idx") for key in tensor_layout(folder))


def test_asymmetric_checkpoint_matches_compressed_tensors_decompression(written, tiny, tmp_path):
    """transformers 5.24 cannot load asymmetric pack-quantized checkpoints, so compressed-tensors' own
    decompressor turns each module's tensors into its dense weight, and transformers runs those."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    folder = written["W4A16_ASYM"]
    group = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    tensors = load_file(folder / "model.safetensors")
    dense = load_file(tiny / "model.safetensors")
    for name in [k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")]:
        parts = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
        dense[name + ".weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
    reference = shutil.copytree(tiny, tmp_path / "reference")
    save_file(dense, str(reference / "model.safetensors"), metadata={"format": "pt"})
    model, config = load_model(folder, torch.float32, "cpu")
    assert any(bool((m.weight_zero != 8).any()) for m in quant_modules(model))
    logits, _ = prefill(model, config, PROMPT)
    torch.testing.assert_close(logits, hf_logits(reference, PROMPT), atol=WEIGHT_ONLY_TOLERANCE, rtol=1e-4)


def test_the_weights_are_calibrated_not_rounded_to_nearest(written, tiny, tmp_path):
    """The same grid quantized on load (round to nearest) gives other weights than the GPTQ checkpoint."""
    from tritonllm.engine.embedded.quant.formats import dequantize_int4

    gptq, _ = load_model(written["W4A16_ASYM"], torch.float32, "cpu")
    config = {"quant_algo": "W4A16", "group_size": 32}
    rtn, _ = load_model(tiny, torch.float32, "cpu", quant_config=config)
    for ours, theirs in zip(quant_modules(gptq), quant_modules(rtn)):
        a = dequantize_int4(ours.qweight, ours.weight_scale, ours.weight_zero, 32)
        b = dequantize_int4(theirs.qweight, theirs.weight_scale, theirs.weight_zero, 32)
        assert not torch.equal(a, b)


def test_projections_are_quantized_in_stages_of_a_shared_input(tiny):
    """q, k, v read one input, then o_proj; gate and up one, then down_proj: four stages, in call order."""
    from transformers import AutoModelForCausalLM

    from tritonllm.checkpoints.quantize_model import decoder_layers, first_layer_inputs, input_stages, quantized_linears

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    layers, prefix = decoder_layers(model, json.loads((tiny / "config.json").read_text()))
    inputs = first_layer_inputs(model, layers[0], [PROMPT], "cpu")
    linears = quantized_linears(layers[0], f"{prefix}.0", QuantizeOptions("W4A16"))
    stages = [[name.split(".")[-1] for name in stage] for stage in input_stages(layers[0], linears, inputs[0])]
    assert stages == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma2"])
def test_other_dense_families_quantize_and_agree_with_transformers(arch, tmp_path):
    """Qwen3 (q/k norms), Phi-3 (qkv_proj and gate_up_proj fused in the checkpoint itself), Gemma 2 (soft caps)."""
    source = build_tiny_model(tmp_path / arch, seed=0, arch=arch)
    folder = tmp_path / "w4"
    quantize_checkpoint(source, folder, QuantizeOptions("W4A16", group_size=32, samples=2, seq_len=32))
    model, config = load_model(folder, torch.float32, "cpu")
    assert quant_modules(model)
    logits, _ = prefill(model, config, PROMPT)
    torch.testing.assert_close(logits, hf_logits(folder, PROMPT), atol=WEIGHT_ONLY_TOLERANCE, rtol=1e-4)
