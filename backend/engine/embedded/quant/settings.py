"""What the engine quantizes and how its checkpoint stores it: `QuantSettings`, resolved once at load from
model.yaml's `quant_config` (TensorRT-LLM's keys, checked by EngineConfig) and the checkpoint's own
`quantization_config` in config.json (read as vLLM reads it). A model.yaml that contradicts the checkpoint is an
error naming both; without a checkpoint quantization, model.yaml's algorithm quantizes on load."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace
from typing import Any, Optional

from ..network.model_config import ModelLoadError

# TensorRT-LLM quant_algo -> the internal kind it quantizes to on load (None: it needs a quantized checkpoint).
ON_LOAD_KINDS: dict[str, Optional[str]] = {
    "FP8": "fp8",  # no calibration here: per-channel weights and dynamic per-token activations
    "FP8_PER_CHANNEL_PER_TOKEN": "fp8",
    "W8A16": "int8",
    "W4A16": "int4",
    "W4A16_AWQ": None,
    "W4A16_GPTQ": None,
}
SOURCES = ("on_load", "compressed-tensors", "awq", "gptq", "fp8")
DEFAULT_GROUP_SIZE = 128
CT_INT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized")
CT_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class QuantSettings:
    """kind: the internal format (fp8, int8, int4); source: where the quantized values come from (on_load, or the
    checkpoint's format); group_size: None for per channel. `targets` and `ignore` choose the projections
    (compressed-tensors' rules: a module's name, 'Linear', or 're:' regex; fnmatch patterns as TensorRT-LLM's
    exclude_modules)."""

    kind: str
    source: str
    quant_algo: str  # TensorRT-LLM's name of it, for messages
    group_size: Optional[int] = None
    static_input: bool = False  # fp8 with the checkpoint's activation scale
    per_tensor: bool = False  # the checkpoint has one weight scale per tensor (broadcast to its rows)
    symmetric: bool = True
    bits: int = 8
    ct_format: Optional[str] = None  # compressed-tensors' storage of the weights
    gptq_zero_offset: int = 0  # GPTQ's original format stores each zero point minus one
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def quantizes(self, name: str) -> bool:
        """Whether the linear module of checkpoint name `name` (model.layers.0.self_attn.q_proj) is quantized."""
        targeted = any(t == "Linear" or _matches(t, name) for t in self.targets)
        return targeted and not any(_matches(pattern, name) for pattern in self.ignore)


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or fnmatch.fnmatchcase(name, pattern)


def resolve(quant_config: Optional[dict[str, Any]], checkpoint: Optional[dict[str, Any]]) -> Optional[QuantSettings]:
    """The settings of a load: `quant_config` is model.yaml's (validated by EngineConfig), `checkpoint` the
    checkpoint's `quantization_config`; None when neither quantizes."""
    requested = (quant_config or {}).get("quant_algo")
    excluded = tuple((quant_config or {}).get("exclude_modules") or ())
    if checkpoint is not None:
        settings = from_checkpoint(checkpoint)
        if requested is not None:
            _check_agrees(requested, (quant_config or {}).get("group_size"), settings)
        return _with_ignore(settings, excluded)
    if requested is None:
        return None
    kind = ON_LOAD_KINDS.get(requested)
    if kind is None:
        raise ModelLoadError(
            f"quant_config.quant_algo={requested!r} needs a checkpoint already quantized with "
            f"{requested.split('_')[-1]} (its config.json has no quantization_config); quantization on load "
            f"offers {', '.join(k for k, v in ON_LOAD_KINDS.items() if v)}"
        )
    group = (quant_config or {}).get("group_size") or DEFAULT_GROUP_SIZE
    group_size = None if kind != "int4" else group  # W8A16 on load is per channel, as TensorRT-LLM's
    return QuantSettings(kind, "on_load", requested, group_size=group_size, ignore=excluded)


def _with_ignore(settings: QuantSettings, excluded: tuple[str, ...]) -> QuantSettings:
    if not excluded:
        return settings
    return replace(settings, ignore=settings.ignore + excluded)


# Which model.yaml algorithms agree with a checkpoint's quantization (by its source and kind).
_AGREEING = {
    ("compressed-tensors", "fp8"): ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"),
    ("fp8", "fp8"): ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"),
    ("compressed-tensors", "int8"): ("W8A16",),
    ("compressed-tensors", "int4"): ("W4A16",),
    ("awq", "int4"): ("W4A16", "W4A16_AWQ"),
    ("gptq", "int4"): ("W4A16", "W4A16_GPTQ"),
    ("gptq", "int8"): ("W8A16",),
}


def _check_agrees(requested: str, group_size: Optional[int], settings: QuantSettings) -> None:
    agreeing = _AGREEING[(settings.source, settings.kind)]
    if requested not in agreeing:
        raise ModelLoadError(
            f"quant_config.quant_algo={requested!r} contradicts the checkpoint's quantization_config "
            f"({settings.source}, {settings.kind} weights: quant_algo {' or '.join(agreeing)}); "
            "leave quant_config out to load the checkpoint as it is quantized"
        )
    if group_size is not None and settings.kind != "fp8" and group_size != settings.group_size:
        raise ModelLoadError(
            f"quant_config.group_size={group_size} contradicts the checkpoint's quantization_config "
            f"(group_size {settings.group_size or 'per channel'})"
        )


def from_checkpoint(config: dict[str, Any]) -> QuantSettings:
    """A checkpoint's `quantization_config` (config.json) as settings; what the engine cannot load is an error
    naming the key."""
    if not isinstance(config, dict):
        raise ModelLoadError(f"config.json: quantization_config must be a mapping, got {config!r}")
    method = config.get("quant_method")
    readers = {"compressed-tensors": _compressed_tensors, "awq": _awq, "gptq": _gptq, "fp8": _fp8}
    if method not in readers:
        raise ModelLoadError(
            f"config.json: quantization_config.quant_method={method!r} is not supported; "
            f"supported: {', '.join(readers)}"
        )
    return readers[method](config)


def _group(value: Any, key: str) -> Optional[int]:
    """A group size: -1 or None is per channel."""
    if value is None or value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json: quantization_config.{key} must be a positive integer or -1, got {value!r}")
    return value


def _awq(config: dict[str, Any]) -> QuantSettings:
    key = "quantization_config"
    if config.get("bits", config.get("w_bit")) != 4:
        raise ModelLoadError(f"config.json: {key}.bits={config.get('bits')!r}: AWQ checkpoints load with 4 bits only")
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"config.json: {key}.version={version!r}: only AWQ's GEMM layout loads")
    if not config.get("zero_point", True):
        raise ModelLoadError(f"config.json: {key}.zero_point=false: only AWQ with zero points loads")
    group = _group(config.get("group_size", config.get("q_group_size")), "group_size")
    ignore = tuple(f"*{name}*" for name in config.get("modules_to_not_convert") or ())
    return QuantSettings("int4", "awq", "W4A16_AWQ", group_size=group, symmetric=False, bits=4, ignore=ignore)


def _gptq(config: dict[str, Any]) -> QuantSettings:
    key = "quantization_config"
    bits = config.get("bits")
    if bits not in (4, 8):
        raise ModelLoadError(f"config.json: {key}.bits={bits!r}: GPTQ checkpoints load with 4 or 8 bits")
    if config.get("desc_act"):
        raise ModelLoadError(
            f"config.json: {key}.desc_act=true (act-order GPTQ) is not supported: its groups follow g_idx, "
            "not the input columns"
        )
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"config.json: {key}.checkpoint_format={fmt!r}; supported: gptq, gptq_v2")
    if config.get("lm_head"):
        raise ModelLoadError(f"config.json: {key}.lm_head=true: the embedded engine keeps lm_head unquantized")
    symmetric = bool(config.get("sym", True))
    if bits == 8 and not symmetric:
        raise ModelLoadError(f"config.json: {key}.sym=false with bits=8: int8 weights load symmetric only")
    kind, algo = ("int4", "W4A16_GPTQ") if bits == 4 else ("int8", "W8A16")
    ignore = tuple(f"*{name}*" for name in config.get("modules_to_not_convert") or ())
    return QuantSettings(
        kind,
        "gptq",
        algo,
        group_size=_group(config.get("group_size"), "group_size"),
        symmetric=symmetric,
        bits=bits,
        gptq_zero_offset=1 if fmt == "gptq" else 0,
        ignore=ignore,
    )


def _fp8(config: dict[str, Any]) -> QuantSettings:
    key = "quantization_config"
    if config.get("weight_block_size") is not None:
        raise ModelLoadError(
            f"config.json: {key}.weight_block_size={config['weight_block_size']!r}: block-wise FP8 is not "
            "supported (the engine's FP8 scales are per output row)"
        )
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"config.json: {key}.activation_scheme={scheme!r}; supported: dynamic, static")
    names = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
    return QuantSettings(
        "fp8",
        "fp8",
        "FP8",
        static_input=scheme == "static",
        per_tensor=True,
        ignore=tuple(f"*{name}*" for name in names),
    )


def _compressed_tensors(config: dict[str, Any]) -> QuantSettings:
    key = "quantization_config"
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"config.json: {key}.config_groups must be a non-empty mapping")
    if config.get("kv_cache_scheme"):
        raise ModelLoadError(
            f"config.json: {key}.kv_cache_scheme: a quantized KV cache in the checkpoint is not supported"
        )
    schemes = {
        name: _ct_scheme(f"{key}.config_groups.{name}", group, config.get("format")) for name, group in groups.items()
    }
    first_name, first = next(iter(schemes.items()))
    for name, scheme in schemes.items():
        if scheme != first:
            raise ModelLoadError(
                f"config.json: {key}.config_groups.{name} quantizes differently from {first_name}: "
                "one scheme for every projection is supported"
            )
    targets = tuple(t for group in groups.values() for t in group.get("targets") or ())
    ignore = tuple(config.get("ignore") or ())
    return QuantSettings(**first, source="compressed-tensors", targets=targets or ("Linear",), ignore=ignore)


def _ct_scheme(key: str, group: dict[str, Any], default_format: Optional[str]) -> dict[str, Any]:
    """One config group's weights and activations as QuantSettings fields."""
    weights, inputs = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, dict):
        raise ModelLoadError(f"config.json: {key}.weights must be a mapping (weight-quantized schemes load)")
    if group.get("output_activations"):
        raise ModelLoadError(f"config.json: {key}.output_activations: output quantization is not supported")
    fmt = group.get("format") or default_format
    bits, kind_of_type = weights.get("num_bits"), weights.get("type")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "group"):
        raise ModelLoadError(f"config.json: {key}.weights.strategy={strategy!r}; supported: tensor, channel, group")
    if weights.get("dynamic"):
        raise ModelLoadError(f"config.json: {key}.weights.dynamic=true: weights must be quantized in the checkpoint")
    group_size = _group(weights.get("group_size"), f"{key}.weights.group_size") if strategy == "group" else None
    symmetric = weights.get("symmetric", True)
    if (bits, kind_of_type) == (8, "float"):
        return {**_ct_fp8(key, fmt, strategy, inputs, symmetric), "per_tensor": strategy == "tensor"}
    if (bits, kind_of_type) not in ((8, "int"), (4, "int")):
        raise ModelLoadError(
            f"config.json: {key}.weights: num_bits={bits!r} type={kind_of_type!r} is not supported "
            "(8-bit float, 8-bit int, 4-bit int load)"
        )
    if inputs:
        raise ModelLoadError(
            f"config.json: {key}.input_activations: quantized activations with int weights (W8A8/W4A8) are not "
            "supported; weight-only int schemes load"
        )
    if fmt not in CT_INT_FORMATS:
        raise ModelLoadError(f"config.json: {key}.format={fmt!r}; int weights load from {', '.join(CT_INT_FORMATS)}")
    if bits == 8 and not symmetric:
        raise ModelLoadError(f"config.json: {key}.weights.symmetric=false with num_bits=8: int8 loads symmetric only")
    algo = "W8A16" if bits == 8 else "W4A16"
    return dict(
        kind="int8" if bits == 8 else "int4",
        quant_algo=algo,
        group_size=group_size,
        symmetric=symmetric,
        bits=bits,
        ct_format=fmt,
        per_tensor=strategy == "tensor",
    )


def _ct_fp8(key: str, fmt: Optional[str], strategy: str, inputs: Any, symmetric: bool) -> dict[str, Any]:
    if strategy == "group":
        raise ModelLoadError(f"config.json: {key}.weights.strategy='group' with float weights is not supported")
    if not isinstance(inputs, dict) or (inputs.get("num_bits"), inputs.get("type")) != (8, "float"):
        raise ModelLoadError(
            f"config.json: {key}.input_activations={inputs!r}: FP8 weights load with FP8 activations only"
        )
    if fmt not in CT_FLOAT_FORMATS or not symmetric:
        raise ModelLoadError(f"config.json: {key}: fp8 weights load symmetric, from {', '.join(CT_FLOAT_FORMATS)}")
    static = not inputs.get("dynamic", False)
    if static and inputs.get("strategy") != "tensor":
        raise ModelLoadError(
            f"config.json: {key}.input_activations.strategy={inputs.get('strategy')!r}: static activation scales "
            "load per tensor only"
        )
    algo = "FP8" if strategy == "tensor" else "FP8_PER_CHANNEL_PER_TOKEN"
    return dict(kind="fp8", quant_algo=algo, static_input=static, bits=8, ct_format=fmt)
