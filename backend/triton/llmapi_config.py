"""Settings of the LLM-API `tensorrt_llm` model, all from its `1/model.yaml`, as in TensorRT-LLM's llmapi model.

The file holds TensorRT-LLM `LLM()` keyword arguments plus a `triton_config` section with `max_batch_size` and
`decoupled`, which `auto_complete_config` hands to Triton (config.pbtxt leaves them out). Problems raise
`ConfigError` naming the file and the key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from ..checkpoints.model_ref import resolve_model_ref
from ..engine.config import ConfigError, EngineConfig, load_yaml_args
from ..tokenizer import LoadedTokenizer, load_tokenizer
from .engine_args import find_engine_args_file
from .params import Parameters

# TensorRT-LLM's llmapi model reads these triton_config keys; `multimodal` is refused (text-only models here).
TRITON_CONFIG_KEYS = ("max_batch_size", "decoupled", "cancellation_check_period_ms", "multimodal")


@dataclass(frozen=True)
class TritonConfig:
    """model.yaml's `triton_config`: what Triton itself needs to know about the model. max_batch_size > 0 makes
    Triton add a batch dimension to every tensor; each request still carries one prompt (llmapi_inputs.py)."""

    max_batch_size: int = 0
    decoupled: bool = False
    cancellation_check_period_ms: Optional[int] = None  # None: config.pbtxt's parameter, else 100


@dataclass(frozen=True)
class LLMAPISettings:
    engine: EngineConfig
    triton: TritonConfig
    tokenizer_dir: str
    yaml_path: Path
    cancellation_check_period_ms: int = 100
    stats_check_period_ms: int = 100


def model_yaml_path(version_dir: str | Path) -> Path:
    """`$LLM_CONFIG_PATH` or `model.yaml` in the model's version folder (what pb_utils.get_model_dir() names)."""
    version_dir = Path(version_dir)
    path = find_engine_args_file(version_dir.parent, version_dir.name)
    if path is None:
        raise ConfigError(
            f"{version_dir / 'model.yaml'} is missing: the LLM-API model reads its engine arguments "
            "and triton_config from it"
        )
    return path


def read_triton_config(path: Path) -> TritonConfig:
    section = _read_yaml(path).get("triton_config")
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: triton_config must be a mapping with {' and '.join(TRITON_CONFIG_KEYS[:2])}")
    unknown = sorted(set(section) - set(TRITON_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"{path}: triton_config has unknown key(s) {unknown}; known: {list(TRITON_CONFIG_KEYS)}")
    if section.get("multimodal"):
        raise ConfigError(
            f"{path}: triton_config.multimodal = {section['multimodal']!r} is not supported: this model serves "
            "text-only models (set it false or leave it out)"
        )
    batch, decoupled = section.get("max_batch_size", 0), section.get("decoupled", False)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ConfigError(f"{path}: triton_config.max_batch_size = {batch!r} must be an integer >= 0")
    if not isinstance(decoupled, bool):
        raise ConfigError(f"{path}: triton_config.decoupled = {decoupled!r} must be true or false")
    period = section.get("cancellation_check_period_ms")
    if period is not None and (isinstance(period, bool) or not isinstance(period, int) or period < 1):
        raise ConfigError(f"{path}: triton_config.cancellation_check_period_ms = {period!r} must be an integer >= 1")
    return TritonConfig(max_batch_size=batch, decoupled=decoupled, cancellation_check_period_ms=period)


def load_llmapi_settings(version_dir: str | Path, model_config: Optional[Mapping[str, Any]] = None) -> LLMAPISettings:
    """Everything the model needs to start. `model_config` (Triton's, after auto-complete) may set the optional
    parameters cancellation_check_period_ms and stats_check_period_ms."""
    path = model_yaml_path(version_dir)
    triton = read_triton_config(path)
    args = load_yaml_args(path)
    model = resolve_model_ref(args.get("model"), "model", str(path), base_dir=path.parent)
    if model is None:
        raise ConfigError(
            f"{path}: 'model' is unset: name the Hugging Face model folder (tritonllm repo build --llmapi fills it)"
        )
    args["model"] = model
    tokenizer = resolve_model_ref(args.get("tokenizer"), "tokenizer", str(path), base_dir=path.parent) or model
    args["tokenizer"] = tokenizer
    params = Parameters.from_model_config(model_config or {})
    return LLMAPISettings(
        engine=EngineConfig.from_dict(args),
        triton=triton,
        tokenizer_dir=tokenizer,
        yaml_path=path,
        cancellation_check_period_ms=triton.cancellation_check_period_ms
        or params.int("cancellation_check_period_ms", 100, minimum=1),
        stats_check_period_ms=params.int("stats_check_period_ms", 100, minimum=1),
    )


def load_llmapi_tokenizer(settings: LLMAPISettings) -> LoadedTokenizer:
    try:
        return load_tokenizer(settings.tokenizer_dir)
    except Exception as error:
        raise ConfigError(
            f"{settings.yaml_path}: cannot load a tokenizer from {settings.tokenizer_dir} (model or "
            f"tokenizer): {type(error).__name__}: {error}"
        ) from error


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping of LLM() arguments and triton_config")
    return data
