"""The engine seam: one protocol (`seam.Engine`, TensorRT-LLM's LLM API shape), two implementations: the embedded
PyTorch engine (embedded/) and the TensorRT-LLM adapter (trtllm.py)."""

from __future__ import annotations

import importlib.util
import logging
import time

from .config import ConfigError, EngineConfig
from .seam import Engine, EngineError, EngineStats, RequestHandle
from .types import CompletionOutput, InvalidRequestError, RequestOutput, SamplingParams

__all__ = [
    "create_engine",
    "choose_engine",
    "Engine",
    "EngineError",
    "EngineStats",
    "RequestHandle",
    "EngineConfig",
    "ConfigError",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "InvalidRequestError",
]


def choose_engine(config: EngineConfig) -> str:
    """'auto' picks TensorRT-LLM when it is importable, the embedded engine otherwise."""
    if config.engine != "auto":
        return config.engine
    return "tensorrt_llm" if importlib.util.find_spec("tensorrt_llm") is not None else "embedded"


def create_engine(config: EngineConfig) -> Engine:
    """Start the engine `config` selects; it exposes generate_async / abort / stats / shutdown."""
    if choose_engine(config) == "tensorrt_llm":
        from .trtllm import TensorRTLLMEngine  # imported only when chosen: the library is large and GPU-only

        return TensorRTLLMEngine(config)
    started = time.monotonic()
    from .embedded.engine import EmbeddedEngine

    # Importing torch is most of a start-up's first seconds (several while other models import it too): said, so
    # that the wait before the first loading line is explained.
    logging.getLogger("tritonllm.engine").info(
        "engine code imported (torch with it) in %.1f s", time.monotonic() - started
    )
    return EmbeddedEngine(config)
