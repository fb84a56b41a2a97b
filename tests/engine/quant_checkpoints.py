"""Quantized checkpoints of the tiny models for the quantization tests.

compressed-tensors ones are written by compressed-tensors itself (its presets, its qparams, its compressors, as
llmcompressor drives it for data-free schemes): the weights' scales come from its `calculate_qparams` over each
weight's min and max. AWQ and GPTQ have no tool here (AutoAWQ and AutoGPTQ need CUDA builds), so their files are
written from known integer weights in the layout each project documents; the tests then check the engine's
dequantized weights against the known ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tritonllm.engine.embedded.quant.packing import AWQ_ORDER

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_compressed_tensors(
    source: Path,
    out: Path,
    preset: str,
    group_size: int | None = None,
    fmt=None,
    dense_reference=None,
    calibration: list[int] | None = None,
) -> Path:
    """`source` (a tiny model) quantized with compressed-tensors' `preset` (FP8_DYNAMIC, W8A16, W4A16, ...) into
    `out`, in format `fmt` (None: the preset's); lm_head ignored, as llmcompressor's recipes do. A group preset
    with group_size None is made per channel. `dense_reference`: a folder that gets the unquantized model with
    each quantized weight replaced by compressed-tensors' own fake_quantize of it (what the checkpoint holds).
    `calibration`: token ids whose activations set the static input scales (FP8's static preset): each Linear's
    largest input magnitude over 448, the min-max observer's scale."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStrategy,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    input_max = _input_maxima(model, calibration) if calibration else {}
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    elif scheme.weights.strategy == "group":
        scheme.weights.strategy, scheme.weights.group_size = QuantizationStrategy.CHANNEL, None
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    fake = {}
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _calibrate_weight(module)
            fake[name + ".weight"] = _fake_quantized(module)
            if name in input_max and hasattr(module, "input_scale"):
                module.input_scale.data.fill_(input_max[name] / 448.0)
    if dense_reference is not None:
        dense = load_file(source / "model.safetensors")
        save_file({**dense, **fake}, str(Path(dense_reference) / "model.safetensors"), metadata={"format": "pt"})
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    _copy_tokenizer(source, out)
    return out


def _input_maxima(model, ids: list[int]) -> dict[str, float]:
    maxima: dict[str, float] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda m, args, name=name: maxima.__setitem__(name, float(args[0].abs().max()))
        )
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return maxima


def _calibrate_weight(module) -> None:
    """The weight's scale and zero point from its min and max, per the scheme's strategy (compressed-tensors'
    observers do the same for a min-max observer)."""
    from compressed_tensors.quantization import QuantizationStrategy
    from compressed_tensors.quantization.utils import calculate_qparams

    args, weight = module.quantization_scheme.weights, module.weight.data
    if args.strategy == QuantizationStrategy.TENSOR:
        low, high = weight.min(), weight.max()
    elif args.strategy == QuantizationStrategy.CHANNEL:
        low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    else:
        grouped = weight.unflatten(-1, (-1, args.group_size))
        low, high = grouped.amin(-1), grouped.amax(-1)
    scale, zero = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def _fake_quantized(module) -> torch.Tensor:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    zero = getattr(module, "weight_zero_point", None)
    if zero is None:
        zero = torch.zeros_like(module.weight_scale, dtype=torch.int8)
    return fake_quantize(module.weight.data, module.weight_scale, zero, module.quantization_scheme.weights).clone()


def _copy_tokenizer(source: Path, out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


# ---- AWQ and GPTQ, from known integer weights ----


def known_int4(shape: tuple[int, int], group_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (values 0..15 [out, in], scales [out, groups] fp16, zeros 0..15 [out, groups]): the weight they make
    is (values - zeros) * scales."""
    generator = torch.Generator().manual_seed(seed)
    out, cols = shape
    groups = cols // group_size
    values = torch.randint(0, 16, (out, cols), generator=generator)
    zeros = torch.randint(4, 12, (out, groups), generator=generator)
    scales = (torch.rand(out, groups, generator=generator) * 0.02 + 0.005).to(torch.float16)
    return values, scales, zeros


def dense_from_known(values, scales, zeros, group_size: int) -> torch.Tensor:
    expand = lambda t: t.repeat_interleave(group_size, dim=1)  # noqa: E731
    return (values - expand(zeros)).float() * expand(scales.float())


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight: [in, out] values packed along dim 0, 32 // bits a word, the first in the lowest bits."""
    per_word = 32 // bits
    grouped = values.to(torch.int64).reshape(values.shape[0] // per_word, per_word, values.shape[1])
    words = sum(grouped[:, i] << (bits * i) for i in range(per_word))
    return _as_int32(words)


def pack_cols(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[rows, cols] packed along dim 1 (GPTQ's qzeros; with AWQ's `order`, AWQ's qweight and qzeros)."""
    per_word = 32 // bits
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, per_word)
    order = order or range(per_word)
    words = sum(grouped[:, :, column] << (bits * i) for i, column in enumerate(order))
    return _as_int32(words)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def write_int4_checkpoint(source: Path, out: Path, method: str, group_size: int, gptq_v1: bool = True):
    """`source` with every projection replaced by known int4 weights stored as `method` (awq or gptq); returns the
    folder and the dense weight of each projection {checkpoint name: [out, in]}."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(source / "model.safetensors")
    dense = {}
    for index, name in enumerate(sorted(n for n in tensors if n.endswith("_proj.weight"))):
        base = name[: -len(".weight")]
        values, scales, zeros = known_int4(tuple(tensors.pop(name).shape), group_size, seed=index)
        dense[name] = dense_from_known(values, scales, zeros, group_size)
        if method == "awq":
            tensors[base + ".qweight"] = pack_cols(values.t(), 4, AWQ_ORDER)
            tensors[base + ".qzeros"] = pack_cols(zeros.t(), 4, AWQ_ORDER)
        else:
            tensors[base + ".qweight"] = pack_rows(values.t(), 4)
            tensors[base + ".qzeros"] = pack_cols(zeros.t() - (1 if gptq_v1 else 0), 4)
            cols = values.shape[1]
            tensors[base + ".g_idx"] = (torch.arange(cols) // group_size).to(torch.int32)
        tensors[base + ".scales"] = scales.t().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = _int4_config(method, group_size, gptq_v1)
    (out / "config.json").write_text(json.dumps(config))
    _copy_tokenizer(source, out)
    return out, dense


def _int4_config(method: str, group_size: int, gptq_v1: bool) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq" if gptq_v1 else "gptq_v2",
    }
