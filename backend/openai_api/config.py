"""The frontend's settings, checked once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

BACKEND_MODELS = ("tensorrt_llm_bls", "ensemble")


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

    def __post_init__(self):
        if ":" not in self.triton_url or not self.triton_url.rsplit(":", 1)[1].isdigit():
            raise FrontendConfigError(f"--triton-url must be HOST:GRPC_PORT, got '{self.triton_url}'")
        if not (self.model_dir / "config.json").is_file():
            raise FrontendConfigError(
                f"--model-dir {self.model_dir} has no config.json: give the Hugging Face "
                "folder the Triton repository was built from"
            )
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
        if not 0 <= self.port < 65536:
            raise FrontendConfigError(f"--port must be in [0, 65535], got {self.port}")

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.lora_names)
