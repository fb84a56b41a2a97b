"""Reading the LLM-API model's inputs, with or without Triton's batch dimension.

With `triton_config.max_batch_size` 0 (TensorRT-LLM's default) each input arrives with its declared shape. A
larger value (honoured as TensorRT-LLM's flow sets it, through auto_complete_config) makes Triton prepend a batch
dimension; like TensorRT-LLM's llmapi model (JIRA-4496) this one serves one prompt per request, so that dimension
must be 1 and is dropped here. The engine batches requests itself either way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .pb import InputError, optional_input


@dataclass(frozen=True)
class BatchedRequest:
    """A request to a model with max_batch_size > 0: every input carries a leading batch dimension."""

    request: Any

    def request_id(self) -> str:
        return self.request.request_id()


def read_input(request: Any, name: str, dtype: Optional[str] = None) -> Optional[np.ndarray]:
    """The input with its declared shape, or None when the request does not carry it."""
    if not isinstance(request, BatchedRequest):
        return optional_input(request, name, dtype)
    array = optional_input(request.request, name, dtype)
    if array is None:
        return None
    if array.ndim == 0 or array.shape[0] != 1:
        raise InputError(
            name,
            f"carries a batch of {array.shape[0] if array.ndim else 0} (shape {list(array.shape)}): this model "
            "serves one prompt per request (the engine batches requests); send a batch of 1",
        )
    return array[0]
