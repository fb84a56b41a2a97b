"""The frontend's settings, checked once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..tokenizer import tokenizer_folder_problem

BACKEND_MODELS = ("tensorrt_llm_bls", "ensemble")
# Completion tokens of a request that sets no max_tokens. OpenAI's own default (whatever the context leaves) is
# thousands of tokens: minutes of generation on a CPU for a plain curl that forgot the field.
DEFAULT_MAX_TOKENS = 256


class FrontendConfigError(ValueError):
    pass


@dataclass(frozen=True)
class FrontendConfig:
    triton_url: str  # host:port of Triton's gRPC endpoint
    model_dir: Path  # the Hugging Face folder the repository serves: tokenizer, chat template, config.json
    served_model_name: str
    backend_model: str = "tensorrt_llm_bls"
    lora_names: tuple[str, ...] = ()
    max_model_len: Optional[int] = None  # None: Triton's tensorrt_llm max_seq_len, else config.json
    host: str = "0.0.0.0"
    port: int = 9000
    max_tokens_default: int = DEFAULT_MAX_TOKENS  # a request without max_tokens (capped by the context left)
    max_tokens_limit: Optional[int] = None  # a request asking for more is refused (400); None: the context only

    def __post_init__(self):
        if ":" not in self.triton_url or not self.triton_url.rsplit(":", 1)[1].isdigit():
            raise FrontendConfigError(f"--triton-url must be HOST:GRPC_PORT, got '{self.triton_url}'")
        if not (self.model_dir / "config.json").is_file():
            raise FrontendConfigError(
                f"--model-dir {self.model_dir} has no config.json: give the Hugging Face "
                "folder the Triton repository was built from"
            )
        problem = tokenizer_folder_problem(str(self.model_dir))
        if problem is not None:
            raise FrontendConfigError(f"--model-dir {self.model_dir}: {problem} (the tokenizer and chat template)")
        if self.backend_model not in BACKEND_MODELS:
            raise FrontendConfigError(
                f"--backend-model must be one of {', '.join(BACKEND_MODELS)}, got '{self.backend_model}'"
            )
        if not self.served_model_name:
            raise FrontendConfigError("--served-model-name must not be empty")
        names = (self.served_model_name, *self.lora_names)
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise FrontendConfigError(f"model names must be unique; repeated: {', '.join(duplicates)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise FrontendConfigError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        if self.max_tokens_default < 1:
            raise FrontendConfigError(f"--max-tokens-default must be >= 1, got {self.max_tokens_default}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise FrontendConfigError(f"--max-tokens-limit must be >= 1, got {self.max_tokens_limit}")
        if self.max_tokens_limit is not None and self.max_tokens_default > self.max_tokens_limit:
            raise FrontendConfigError(
                f"--max-tokens-default ({self.max_tokens_default}) must not exceed "
                f"--max-tokens-limit ({self.max_tokens_limit})"
            )
        if not 0 <= self.port < 65536:
            raise FrontendConfigError(f"--port must be in [0, 65535], got {self.port}")

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.lora_names)


def default_max_tokens(model_dir: Path, limit: Optional[int]) -> int:
    """max_tokens for requests without one when --max-tokens-default is not given: generation_config.json's
    max_new_tokens (as vLLM takes it from there), else DEFAULT_MAX_TOKENS; never above the limit."""
    path = model_dir / "generation_config.json"
    try:
        configured = json.loads(path.read_text()).get("max_new_tokens") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        configured = None  # the engine's loader reports a broken file; here it only loses its default
    value = configured if isinstance(configured, int) and configured >= 1 else DEFAULT_MAX_TOKENS
    return min(value, limit) if limit is not None else value
