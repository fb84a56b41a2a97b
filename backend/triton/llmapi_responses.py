"""Response tensors of the LLM-API `tensorrt_llm` model: one element per returned sequence in each output.

`finish_reason` and `stop_reason` are strings, as TensorRT-LLM's model sends them (`str(...)`, so an unset value is
"None"); `cumulative_logprob` is FP32 as its config.pbtxt declares (the anchor sent strings there: bug Q5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .llmapi_request import OutputOptions
from .pb import output_tensor, pb_utils, string_tensor

ERROR_TEXT = "N/A"  # text_output of an error response, as the anchor sends it


@dataclass(frozen=True)
class SequenceResult:
    text: str
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled"; None while running
    stop_reason: Optional[str] = None  # the stop string that ended the text
    cumulative_logprob: float = 0.0


def response_tensors(results: list[SequenceResult], options: OutputOptions) -> list[Any]:
    tensors = [string_tensor("text_output", [result.text for result in results])]
    if options.finish_reason:
        tensors.append(string_tensor("finish_reason", [str(result.finish_reason) for result in results]))
    if options.stop_reason:
        tensors.append(string_tensor("stop_reason", [str(result.stop_reason) for result in results]))
    if options.cumulative_logprob:
        tensors.append(
            output_tensor(
                "cumulative_logprob", np.array([result.cumulative_logprob for result in results], dtype=np.float32)
            )
        )
    return tensors


def inference_response(results: list[SequenceResult], options: OutputOptions) -> Any:
    return pb_utils().InferenceResponse(output_tensors=response_tensors(results, options))


def error_response(message: str, code_name: str = "INVALID_ARG") -> Any:
    """An error (code INVALID_ARG, CANCELLED or INTERNAL), with text_output "N/A" as TensorRT-LLM's llmapi model
    answers (clients may read it)."""
    pb = pb_utils()
    code = getattr(pb.TritonError, code_name, None)
    error = pb.TritonError(message) if code is None else pb.TritonError(message, code)
    return pb.InferenceResponse(output_tensors=[string_tensor("text_output", [ERROR_TEXT])], error=error)
