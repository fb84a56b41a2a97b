"""`tritonllm repo build --llmapi`: a model repository holding only the LLM-API `tensorrt_llm` model.

The model comes from the template `models/llmapi/tensorrt_llm/`; the repository's `1/model.yaml` is written from
the options (TensorRT-LLM `LLM()` keys plus `triton_config`) and read back with the model's own loader, so a bad
value fails the build, not the server start. The ensemble's models cannot share the repository: both flavours
are named `tensorrt_llm`, and the ensemble would route token ids to a text model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from tritonllm.checkpoints.model_ref import is_hub_id
from tritonllm.deploy.repo import (
    RepoError,
    block_bytecode,
    check_build_choices,
    check_build_numbers,
    check_model_dir,
    template_dir,
)
from tritonllm.engine import choose_engine
from tritonllm.triton.llmapi_config import load_llmapi_settings

MODEL_NAME = "tensorrt_llm"
ENSEMBLE_MODELS = ("preprocessing", "postprocessing", "ensemble", "tensorrt_llm_bls")
YAML_HEADER = (
    "# Written by `tritonllm repo build --llmapi`. Engine arguments are TensorRT-LLM LLM() keyword\n"
    "# arguments; triton_config is read by auto_complete_config. The template\n"
    "# (models/llmapi/tensorrt_llm/1/model.yaml) lists the other keys.\n"
)


def llmapi_template() -> Path:
    path = template_dir() / "llmapi" / MODEL_NAME
    if not (path / "config.pbtxt").is_file():
        raise RepoError(f"the LLM-API model template is missing: no {path / 'config.pbtxt'}")
    return path


def build_llmapi_repo(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    streaming: bool = True,
    engine: str = "auto",
    dtype: Optional[str] = None,
    device: Optional[str] = None,
    max_batch_size: Optional[int] = None,
    max_seq_len: Optional[int] = None,
    max_num_tokens: Optional[int] = None,
    kv_cache_max_tokens: Optional[int] = None,
    engine_args: Optional[Mapping[str, Any]] = None,
    overwrite: bool = False,
) -> Path:
    """Write `out_dir/tensorrt_llm` for the Hugging Face model folder `model_dir`, or a Hugging Face model id
    (written as given, so model.yaml names the model as TensorRT-LLM's does; the build resolves it once through the
    hub cache to check it). `engine_args` adds or overrides model.yaml keys ("kv_cache_config.tokens_per_block"
    reaches into a nested config). Returns `out_dir`."""
    model = model_ref(model_dir)
    check_build_numbers(
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_num_tokens=max_num_tokens,
        kv_cache_max_tokens=kv_cache_max_tokens,
    )
    check_build_choices(engine=engine, dtype=dtype, device=device, kv_cache_free_gpu_mem_fraction=None)
    args: dict[str, Any] = {
        "model": model,
        "engine": engine,
        "dtype": dtype,
        "device": device,
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "max_num_tokens": max_num_tokens,
        "kv_cache_config": {"max_tokens": kv_cache_max_tokens} if kv_cache_max_tokens else None,
    }
    args = {key: value for key, value in args.items() if value is not None}
    for key, value in (engine_args or {}).items():
        set_arg(args, key, value)
    out = Path(out_dir)
    check_target(out, overwrite)
    # triton_config.* given as engine arguments override the defaults; the load check refuses bad ones by name.
    given = args.pop("triton_config", {})
    return write_llmapi_repo(out, {**args, "triton_config": {"max_batch_size": 0, "decoupled": streaming, **given}})


def model_ref(model_dir: str | Path) -> str:
    """A folder, checked and made absolute; else a Hugging Face id, kept as it is."""
    if not Path(model_dir).expanduser().exists() and is_hub_id(str(model_dir)):
        return str(model_dir)
    return check_model_dir(model_dir)


def set_arg(args: dict, key: str, value: Any) -> None:
    """args[key] = value, where "a.b" sets args["a"]["b"]."""
    outer, dot, inner = key.partition(".")
    if not outer or (dot and not inner):
        raise RepoError(f"engine argument {key!r} is not a key or a key.subkey")
    if not dot:
        args[outer] = value
        return
    nested = args.setdefault(outer, {})
    if not isinstance(nested, dict):
        raise RepoError(f"engine argument {key!r}: {outer} is not a mapping")
    nested[inner] = value


def check_target(out: Path, overwrite: bool) -> None:
    ensemble = [name for name in ENSEMBLE_MODELS if (out / name).exists()]
    if ensemble:
        raise RepoError(
            f"{out} holds the ensemble's models {ensemble}: the LLM-API tensorrt_llm cannot share a "
            "repository with them (same model name); choose another folder"
        )
    if (out / MODEL_NAME).exists() and not overwrite:
        raise RepoError(f"{out} already holds {MODEL_NAME}; pass overwrite to replace it")


def check_loadable(version_dir: Path) -> None:
    """Read model.yaml back as the model will at load, including what the engine it would pick can honour."""
    try:
        settings = load_llmapi_settings(version_dir)
    except ValueError as exc:
        raise RepoError(f"the LLM-API model.yaml would not load: {exc}") from exc
    check_model_dir(settings.engine.model)  # a Hub id's snapshot must be a model folder too
    problems = settings.engine.embedded_unsupported() if choose_engine(settings.engine) == "embedded" else []
    if problems:
        raise RepoError("the embedded engine (the one engine: auto picks here) cannot honour: " + "; ".join(problems))


def write_llmapi_repo(out: Path, model_yaml: Mapping[str, Any]) -> Path:
    """Stage the model with its model.yaml, load the settings back as the model will, then move it in place."""
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tritonllm-build-", dir=out))
    try:
        model = staging / MODEL_NAME
        shutil.copytree(llmapi_template(), model, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        block_bytecode(model)
        (model / "1" / "model.yaml").write_text(YAML_HEADER + yaml.safe_dump(dict(model_yaml), sort_keys=False))
        check_loadable(model / "1")
        if (out / MODEL_NAME).exists():
            shutil.rmtree(out / MODEL_NAME)
        os.replace(model, out / MODEL_NAME)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
