"""Response tensors of the LLM-API `tensorrt_llm` model: one element per returned sequence in each output.

`finish_reason` and `stop_reason` are strings, as TensorRT-LLM's model sends them (`str(...)`, so an unset value is
"None"); `cumulative_logprob` is FP32 as its config.pbtxt declares (the anchor sent strings there: bug Q5).
With `sampling_param_return_perf_metrics` each response also carries the request's KV-cache and timing outputs,
in the types config.pbtxt declares (TensorRT-LLM's model sends them as strings there)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..engine.types import RequestPerfMetrics
from .llmapi_request import OutputOptions
from .pb import output_tensor, pb_utils, string_tensor

ERROR_TEXT = "N/A"  # text_output of an error response, as the anchor sends it


@dataclass(frozen=True)
class SequenceResult:
    text: str
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled"; None while running
    stop_reason: Optional[str] = None  # the stop string that ended the text
    cumulative_logprob: float = 0.0
    perf: Optional["PerfOutputs"] = None  # with sampling_param_return_perf_metrics


@dataclass(frozen=True)
class PerfOutputs:
    """The perf-metrics outputs of TensorRT-LLM's llmapi config.pbtxt, for one sequence."""

    kv_cache_reused_block: int
    kv_cache_missed_block: int
    kv_cache_alloc_new_blocks: int
    kv_cache_alloc_total_blocks: int
    kv_cache_hit_rate: float
    arrival_time_ns: int
    first_scheduled_time_ns: int
    first_token_time_ns: int
    last_token_time_ns: int
    acceptance_rate: float
    total_accepted_draft_tokens: int
    total_draft_tokens: int


PERF_TYPES = {
    "kv_cache_reused_block": np.int32,
    "kv_cache_missed_block": np.int32,
    "kv_cache_alloc_new_blocks": np.int32,
    "kv_cache_alloc_total_blocks": np.int32,
    "kv_cache_hit_rate": np.float32,
    "arrival_time_ns": np.int64,
    "first_scheduled_time_ns": np.int64,
    "first_token_time_ns": np.int64,
    "last_token_time_ns": np.int64,
    "acceptance_rate": np.float32,
    "total_accepted_draft_tokens": np.int32,
    "total_draft_tokens": np.int32,
}


def perf_outputs(metrics: RequestPerfMetrics, prompt_len: int, tokens_per_block: int) -> PerfOutputs:
    """Missed blocks are the prompt's blocks that the prefix cache could not give (TensorRT-LLM counts context
    blocks only); the hit rate is reused / (reused + missed), 0 without prompt blocks."""
    prompt_blocks = math.ceil(prompt_len / tokens_per_block) if tokens_per_block > 0 else 0
    reused = metrics.kv_cache_reused_blocks
    missed = max(prompt_blocks - reused, 0)
    return PerfOutputs(
        kv_cache_reused_block=reused,
        kv_cache_missed_block=missed,
        kv_cache_alloc_new_blocks=metrics.kv_cache_alloc_new_blocks,
        kv_cache_alloc_total_blocks=metrics.kv_cache_alloc_total_blocks,
        kv_cache_hit_rate=reused / (reused + missed) if reused + missed else 0.0,
        arrival_time_ns=metrics.arrival_time_ns,
        first_scheduled_time_ns=metrics.first_scheduled_time_ns,
        first_token_time_ns=metrics.first_token_time_ns,
        last_token_time_ns=metrics.last_token_time_ns,
        acceptance_rate=metrics.acceptance_rate,
        total_accepted_draft_tokens=metrics.total_accepted_draft_tokens,
        total_draft_tokens=metrics.total_draft_tokens,
    )


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
    perf = results[0].perf if results else None
    if options.perf_metrics and perf is not None:  # one value: the first sequence's, as TensorRT-LLM sends
        tensors += [
            output_tensor(name, np.array([getattr(perf, name)], dtype=kind)) for name, kind in PERF_TYPES.items()
        ]
    return [with_batch_dim(tensor) for tensor in tensors] if options.batch_dim else tensors


def with_batch_dim(tensor: Any) -> Any:
    """The tensor with Triton's leading batch dimension (of 1), for a model with max_batch_size > 0."""
    return output_tensor(tensor.name(), tensor.as_numpy()[None])


def inference_response(results: list[SequenceResult], options: OutputOptions) -> Any:
    return pb_utils().InferenceResponse(output_tensors=response_tensors(results, options))


def error_response(message: str, code_name: str = "INVALID_ARG", batch_dim: bool = False) -> Any:
    """An error (code INVALID_ARG, CANCELLED or INTERNAL), with text_output "N/A" as TensorRT-LLM's llmapi model
    answers (clients may read it)."""
    pb = pb_utils()
    code = getattr(pb.TritonError, code_name, None)
    error = pb.TritonError(message) if code is None else pb.TritonError(message, code)
    text = string_tensor("text_output", [ERROR_TEXT])
    return pb.InferenceResponse(output_tensors=[with_batch_dim(text) if batch_dim else text], error=error)
