"""`tritonllm quantize`'s work: an unquantized Hugging Face checkpoint calibrated with GPTQ (gptq.py) and written as
a compressed-tensors checkpoint that the embedded engine (and vLLM, and transformers with compressed-tensors)
loads: W4A16 / W4A16_ASYM as `pack-quantized`, FP8 as `float-quantized` with dynamic per-token activations.

Calibration runs the checkpoint's own transformers model in float32, one decoder layer after the other: the
calibration tokens' hidden states enter layer i as layer i - 1 left them, already quantized, so each layer's GPTQ
sees the inputs it will get at run time. Forward hooks on the layer's nn.Linear modules gather each one's Hessian.
Embeddings, lm_head and norms stay as they are (cast to the output dtype). Files are written without the
compressed-tensors package, in the layout and config it writes (tests/engine/quant_checkpoints.py compares)."""

from __future__ import annotations

import fnmatch
import re
import shutil
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from tritonllm.engine.embedded.network.model_config import MOE_MODEL_TYPES
from tritonllm.engine.embedded.quant.formats import INT4_LEVELS
from tritonllm.engine.embedded.quant.packing import pack_int32

from .gptq import Grid, HessianSum, QuantizedWeight, gptq_quantize
from .hf_files import read_json, write_json

ALGOS = ("W4A16", "W4A16_ASYM", "FP8")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The compressed-tensors release whose checkpoint layout and config these files follow (and the tests compare with).
COMPRESSED_TENSORS_VERSION = "0.20.0"
CALIBRATION_TEXT = "calibration.txt"  # original text written for this; never the bench's evaluation passages
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_NOT_COPIED = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf")


class QuantizeError(ValueError):
    """Bad input to `tritonllm quantize`: the message names the input and what is wrong."""


@dataclass(frozen=True)
class QuantizeOptions:
    algo: str
    group_size: int = 128  # int4 only
    samples: int = 16
    seq_len: int = 256
    damp: float = 0.01
    act_order: bool = True  # columns by decreasing Hessian diagonal, static groups (gptq.py); SmolLM2: 1.21 -> 1.11
    device: str = "cpu"
    dtype: Optional[str] = None  # the written dtype; None: the checkpoint's
    exclude_modules: tuple[str, ...] = ()  # fnmatch patterns or "re:" regexes of module names
    calibration: Optional[Path] = None  # a text file; None: the shipped calibration text

    def grid(self, scale_dtype: torch.dtype) -> Grid:
        if self.algo == "FP8":
            return Grid("fp8")
        return Grid("int4", self.group_size, self.algo == "W4A16", scale_dtype)


def quantize_checkpoint(
    model_dir: Path, out: Path, options: QuantizeOptions, say: Callable[[str], None] = lambda m: None
) -> dict[str, Any]:
    """Calibrate and quantize `model_dir` into `out`; returns what was done (modules, layers, seconds)."""
    started = time.perf_counter()
    config = _checked_config(model_dir, options)
    _check_out(model_dir, out)
    dtype = _output_dtype(config, options)
    ids = calibration_ids(model_dir, options)
    model = _load_model(model_dir, options.device)
    layers, prefix = decoder_layers(model, config)
    _check_group_size(layers, prefix, options)
    say(f"calibrating on {len(ids)} samples of {options.seq_len} tokens, {len(layers)} decoder layers")
    results = calibrate(model, layers, prefix, ids, options, dtype, say)
    excluded = sorted(set(_linear_names(model)) - set(results))
    write_checkpoint(
        model_dir, out, results, {**config, "quantization_config": quantization_config(options, excluded)}, dtype
    )
    seconds = round(time.perf_counter() - started, 1)
    say(f"wrote {out} in {seconds}s")
    return {"out": str(out), "algo": options.algo, "modules": len(results), "layers": len(layers), "seconds": seconds}


def _checked_config(model_dir: Path, options: QuantizeOptions) -> dict[str, Any]:
    if options.algo not in ALGOS:
        raise QuantizeError(f"--algo {options.algo!r} is not supported; choose one of {', '.join(ALGOS)}")
    for name, value in (("--group-size", options.group_size), ("--samples", options.samples)):
        if value < 1:
            raise QuantizeError(f"{name} must be a positive integer, got {value}")
    if options.seq_len < 2:
        raise QuantizeError(f"--seq-len must be at least 2, got {options.seq_len}")
    if not options.damp > 0:
        raise QuantizeError(f"--damp must be positive, got {options.damp}")
    if options.dtype is not None and options.dtype not in DTYPES:
        raise QuantizeError(f"--dtype {options.dtype!r}; choose one of {', '.join(DTYPES)}")
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise QuantizeError(f"--device {options.device}: CUDA is not available here")
    path = model_dir / "config.json"
    if not path.is_file():
        raise QuantizeError(f"--model {model_dir}: no config.json (a Hugging Face model folder is needed)")
    config = read_json(path)
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise QuantizeError(f"--model {model_dir}: already quantized ({method}); quantize an unquantized checkpoint")
    model_type = config.get("model_type")
    experts = [key for key in _MOE_KEYS if config.get(key)]
    if model_type in MOE_MODEL_TYPES or experts:
        raise QuantizeError(
            f"--model {model_dir}: a mixture-of-experts model ({model_type}"
            f"{', ' + experts[0] + '=' + str(config[experts[0]]) if experts else ''}): the engine keeps experts "
            "dense, so `tritonllm quantize` quantizes dense decoder models only"
        )
    return config


def _check_out(model_dir: Path, out: Path) -> None:
    if out.resolve() == model_dir.resolve():
        raise QuantizeError(f"--out {out} is the --model folder; write the quantized checkpoint elsewhere")
    if out.is_dir() and any(out.glob("*.safetensors")):
        raise QuantizeError(f"--out {out} already holds a checkpoint (*.safetensors); choose a new or empty folder")


def _output_dtype(config: dict[str, Any], options: QuantizeOptions) -> torch.dtype:
    name = options.dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise QuantizeError(f"config.json dtype {name!r} is not one of {', '.join(DTYPES)}; pass --dtype")
    return DTYPES[name]


def calibration_ids(model_dir: Path, options: QuantizeOptions) -> list[list[int]]:
    """`samples` windows of `seq_len` tokens, spread evenly over the calibration text (overlapping when the text
    is shorter than samples * seq_len)."""
    from transformers import AutoTokenizer

    if options.calibration is not None:
        if not Path(options.calibration).is_file():
            raise QuantizeError(f"--calibration {options.calibration}: no such file")
        text = Path(options.calibration).read_text(encoding="utf-8")
        source = f"--calibration {options.calibration}"
    else:
        text = resources.files("tritonllm.checkpoints").joinpath("data", CALIBRATION_TEXT).read_text(encoding="utf-8")
        source = "the shipped calibration text"
    tokens = list(AutoTokenizer.from_pretrained(model_dir).encode(text, verbose=False))  # longer than a window: fine
    if len(tokens) < options.seq_len:
        raise QuantizeError(f"--seq-len {options.seq_len}: {source} has only {len(tokens)} tokens")
    last = len(tokens) - options.seq_len
    starts = sorted({round(i * last / max(options.samples - 1, 1)) for i in range(options.samples)})
    return [tokens[s : s + options.seq_len] for s in starts]


def _load_model(model_dir: Path, device: str):
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.to(device).eval()


def decoder_layers(model, config: dict[str, Any]) -> tuple[torch.nn.ModuleList, str]:
    """The model's decoder layers and their module name (model.layers), found as the ModuleList of
    num_hidden_layers entries."""
    count = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module, name
    raise QuantizeError(f"--model: no list of {count} decoder layers in {type(model).__name__}")


def quantized_linears(layer, layer_name: str, options: QuantizeOptions) -> dict[str, torch.nn.Linear]:
    """The layer's nn.Linear modules by checkpoint name, less --exclude-modules."""
    found = {}
    for name, module in layer.named_modules():
        full = f"{layer_name}.{name}"
        if isinstance(module, torch.nn.Linear) and not any(_matches(p, full) for p in options.exclude_modules):
            found[full] = module
    return found


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _check_group_size(layers, prefix: str, options: QuantizeOptions) -> None:
    if options.algo == "FP8":
        return
    for index, layer in enumerate(layers):
        for name, module in quantized_linears(layer, f"{prefix}.{index}", options).items():
            if module.in_features % options.group_size:
                raise QuantizeError(
                    f"--group-size {options.group_size} does not divide {name}'s {module.in_features} input columns"
                )


class _Captured(Exception):
    """Raised by the first layer's hook: the model's forward has done its part (embeddings, positions)."""


def first_layer_inputs(model, layer, ids: list[list[int]], device: str) -> list[tuple[torch.Tensor, dict]]:
    """What the first decoder layer receives for each sample: its hidden states and keyword arguments (position
    embeddings, masks), captured by running the model up to it."""
    captured: list[tuple[torch.Tensor, dict]] = []

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append((hidden, dict(kwargs)))
        raise _Captured

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for sample in ids:
            try:
                model(input_ids=torch.tensor([sample], device=device), use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return captured


def calibrate(model, layers, prefix: str, ids, options: QuantizeOptions, dtype: torch.dtype, say) -> dict:
    """GPTQ on every decoder layer in order; each layer's weights are replaced by their dequantized values before
    its outputs feed the next. Within a layer, projections that share an input (q, k, v; gate, up) are quantized
    together, stage after stage in the order the layer calls them, each stage's Hessians gathered with the
    stages before it already quantized (AutoGPTQ's "true sequential"). Returns {module name: QuantizedWeight}."""
    grid = options.grid(dtype)
    results: dict[str, QuantizedWeight] = {}
    with torch.no_grad():
        inputs = first_layer_inputs(model, layers[0], ids, options.device)
        for index, layer in enumerate(layers):
            started = time.perf_counter()
            linears = quantized_linears(layer, f"{prefix}.{index}", options)
            for stage in input_stages(layer, linears, inputs[0]):
                hessians = _layer_hessians(layer, {name: linears[name] for name in stage}, inputs)
                for name in stage:
                    module, hessian = linears[name], hessians[name].hessian()
                    try:
                        result = gptq_quantize(module.weight, hessian, grid, options.damp, act_order=options.act_order)
                    except ValueError as exc:
                        raise QuantizeError(f"{name}: {exc}") from None
                    module.weight.copy_(result.dense.to(module.weight.dtype))
                    results[name] = _to_cpu(result)
            inputs = [(_hidden(layer(hidden, **kwargs)), kwargs) for hidden, kwargs in inputs]
            say(f"layer {index + 1}/{len(layers)}: {len(linears)} projections in {time.perf_counter() - started:.1f}s")
    return results


def input_stages(layer, linears: dict[str, torch.nn.Linear], sample) -> list[list[str]]:
    """The layer's projections grouped by the input tensor they read, in the order the layer first calls them."""
    seen: dict[tuple, list[str]] = {}
    alive: list[torch.Tensor] = []  # held, so that no later input reuses a freed one's memory (and address)

    def record(name: str, x: torch.Tensor) -> None:
        alive.append(x)
        seen.setdefault((x.data_ptr(), tuple(x.shape)), []).append(name)

    handles = [
        module.register_forward_pre_hook(lambda m, args, name=name: record(name, args[0]))
        for name, module in linears.items()
    ]
    try:
        hidden, kwargs = sample
        layer(hidden, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    stages = list(seen.values())
    missing = set(linears) - {name for stage in stages for name in stage}
    return stages + ([sorted(missing)] if missing else [])


def _layer_hessians(layer, linears: dict[str, torch.nn.Linear], inputs) -> dict[str, HessianSum]:
    hessians = {name: HessianSum(m.in_features, m.weight.device) for name, m in linears.items()}
    handles = [
        module.register_forward_pre_hook(lambda m, args, name=name: hessians[name].add(args[0]))
        for name, module in linears.items()
    ]
    try:
        for hidden, kwargs in inputs:
            layer(hidden, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return hessians


def _hidden(output) -> torch.Tensor:
    """A decoder layer's hidden states: the output itself (transformers 5) or its first element (4.x tuples)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def _to_cpu(result: QuantizedWeight) -> QuantizedWeight:
    zero = None if result.zero is None else result.zero.cpu()
    return QuantizedWeight(result.values.cpu(), result.scale.cpu(), zero, torch.empty(0))


# ---- writing the compressed-tensors checkpoint ----


def _linear_names(model) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def write_checkpoint(model_dir: Path, out: Path, results: dict[str, QuantizedWeight], config: dict, dtype) -> None:
    """`model_dir`'s tensors (cast to dtype) with each quantized module's weight replaced by its compressed
    tensors; `config` (quantization_config included) as config.json; the tokenizer and generation files copied."""
    from safetensors.torch import save_file

    tensors = _source_tensors(model_dir, dtype)
    for name, result in results.items():
        if name + ".weight" not in tensors:
            raise QuantizeError(f"--model {model_dir}: module {name} has no tensor {name}.weight in its safetensors")
        rows, cols = tensors.pop(name + ".weight").shape
        tensors.update(compressed_tensors(name, result, rows, cols, config["quantization_config"]))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    name = next(key for key, value in DTYPES.items() if value == dtype)
    config = {**config, "dtype": name, "torch_dtype": name}
    write_json(out / "config.json", config)
    for path in model_dir.iterdir():
        if (
            path.is_file()
            and not path.name.startswith(".")
            and path.name != "config.json"
            and not path.name.endswith(_NOT_COPIED)
        ):
            shutil.copy(path, out / path.name)


def _source_tensors(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise QuantizeError(f"--model {model_dir}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        for key, value in load_file(path).items():
            tensors[key] = value.to(dtype) if value.is_floating_point() else value
    return tensors


def compressed_tensors(
    name: str, result: QuantizedWeight, rows: int, cols: int, qconfig: dict
) -> dict[str, torch.Tensor]:
    """One module's tensors as compressed-tensors stores them. pack-quantized: the int4 values as stored (signed
    value + 8, which is the internal unsigned level) eight a word along each row, the first in the lowest bits; the
    zero points (asymmetric) likewise, packed along the output rows; weight_shape. float-quantized: the fp8
    weight and its per-channel scale [out, 1] (float32)."""
    weights = qconfig["config_groups"]["group_0"]["weights"]
    if weights["type"] == "float":
        return {name + ".weight": result.values, name + ".weight_scale": result.scale.reshape(rows, 1).float()}
    assert result.zero is not None
    tensors = {
        name + ".weight_packed": pack_int32(result.values, 4, dim=1),
        name + ".weight_scale": result.scale,
        name + ".weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }
    if not weights["symmetric"]:
        tensors[name + ".weight_zero_point"] = pack_int32(result.zero, 4, dim=0)
    return tensors


def quantization_config(options: QuantizeOptions, excluded: list[str]) -> dict[str, Any]:
    """config.json's quantization_config, key for key as compressed-tensors writes it for its presets; `excluded`:
    the Linear modules left dense (lm_head, --exclude-modules), by name."""
    fp8 = options.algo == "FP8"
    weights = {
        "dynamic": False,
        "group_size": None if fp8 else options.group_size,
        "num_bits": 8 if fp8 else INT4_LEVELS.bit_length() - 1,
        "strategy": "channel" if fp8 else "group",
        "symmetric": options.algo != "W4A16_ASYM",
        "type": "float" if fp8 else "int",
    }
    if options.act_order:
        weights["actorder"] = "weight"  # compressed-tensors: act-order over contiguous groups (no g_idx)
    activations = {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token", "symmetric": True}
    fmt = "float-quantized" if fp8 else "pack-quantized"
    group = {
        "format": fmt,
        "input_activations": {**activations, "type": "float"} if fp8 else None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": weights,
    }
    return {
        "config_groups": {"group_0": group},
        "format": fmt,
        "global_compression_ratio": None,
        "ignore": excluded,
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }
