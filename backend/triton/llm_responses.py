"""Builds the `tensorrt_llm` model's response tensors from engine outputs (contract shapes: leading batch dim 1)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..engine.types import CompletionOutput
from ..tokenizer import DETOKENIZE_PREFIX_TOKENS
from .llm_request import RowOptions
from .pb import output_tensor

PERF_INT32 = (
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
)
PERF_INT64 = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


def sequence_tensors(
    prompt: list[int],
    completion: CompletionOutput,
    options: RowOptions,
    *,
    delta: bool,
    is_final: bool,
    batch_index: Optional[int],
    sequence_index: Optional[int],
    context_logits=None,
) -> list:
    """The tensors of one response for one sequence. `delta`: only the tokens not sent before (streaming)."""
    start = completion._diff_start if delta else 0
    new_tokens = completion.token_ids[start:]
    echo_prompt = not delta and not options.exclude_input_in_output
    tokens = (prompt + new_tokens) if echo_prompt else new_tokens
    # The postprocessing step decodes statelessly: it needs the tokens before these ones to get spaces and
    # multi-byte characters right. A full sequence (prompt echoed) needs none.
    prefix = [] if echo_prompt else (prompt + completion.token_ids[:start])[-DETOKENIZE_PREFIX_TOKENS:]
    tensors = [
        output_tensor("output_ids", np.array([[tokens]], dtype=np.int32).reshape(1, 1, len(tokens))),
        output_tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32)),
        output_tensor("detok_prefix_ids", np.array(prefix, dtype=np.int32).reshape(1, 1, len(prefix))),
        output_tensor("detok_is_final", np.array([[is_final]], dtype=bool)),
    ]
    if options.return_log_probs:
        logprobs = completion.logprobs[start:]
        tensors.append(output_tensor("cum_log_probs", np.array([[completion.cumulative_logprob]], dtype=np.float32)))
        tensors.append(
            output_tensor("output_log_probs", np.array(logprobs, dtype=np.float32).reshape(1, 1, len(logprobs)))
        )
    if options.return_perf_metrics and completion.request_perf_metrics is not None:
        tensors += perf_tensors(completion)
    tensors += logits_tensors(completion, options, start, context_logits)
    if batch_index is not None:
        tensors.append(output_tensor("batch_index", np.array([[batch_index]], dtype=np.int32)))
    if sequence_index is not None:
        tensors.append(output_tensor("sequence_index", np.array([[sequence_index]], dtype=np.int32)))
    return tensors


def beam_tensors(
    prompt: list[int],
    completions: list[CompletionOutput],
    options: RowOptions,
    *,
    is_final: bool,
    batch_index: Optional[int],
    streaming: bool,
) -> list:
    """One response carrying every beam: output_ids [1, beams, len] padded with -1, sequence_length [1, beams].
    Beams rewrite their earlier tokens, so a stream sends each beam whole (its generated tokens) every time; a
    final non-streamed response echoes the prompt unless excluded, like a single sequence."""
    echo_prompt = not streaming and not options.exclude_input_in_output
    rows = [(prompt if echo_prompt else []) + c.token_ids for c in completions]
    width = max(len(r) for r in rows)
    ids = np.full((1, len(rows), width), -1, dtype=np.int32)
    for beam, row in enumerate(rows):
        ids[0, beam, : len(row)] = row
    tensors = [
        output_tensor("output_ids", ids),
        output_tensor("sequence_length", np.array([[len(r) for r in rows]], dtype=np.int32)),
        output_tensor("detok_prefix_ids", np.zeros((1, len(rows), 0), dtype=np.int32)),
        output_tensor("detok_is_final", np.array([[is_final]], dtype=bool)),
    ]
    if options.return_log_probs:
        logprobs = np.zeros((1, len(rows), max(len(c.logprobs) for c in completions)), dtype=np.float32)
        for beam, completion in enumerate(completions):
            logprobs[0, beam, : len(completion.logprobs)] = completion.logprobs
        tensors.append(
            output_tensor("cum_log_probs", np.array([[c.cumulative_logprob for c in completions]], dtype=np.float32))
        )
        tensors.append(output_tensor("output_log_probs", logprobs))
    if options.return_perf_metrics and completions[0].request_perf_metrics is not None:
        tensors += perf_tensors(completions[0])
    if batch_index is not None:
        tensors.append(output_tensor("batch_index", np.array([[batch_index]], dtype=np.int32)))
    return tensors


def logits_tensors(completion: CompletionOutput, options: RowOptions, start: int, context_logits) -> list:
    """context_logits [1, prompt_len, vocab] with a sequence's first response; generation_logits
    [1, 1, tokens, vocab] for the tokens of this response."""
    tensors = []
    if options.return_context_logits and start == 0 and context_logits is not None:
        tensors.append(output_tensor("context_logits", context_logits.numpy().astype(np.float32)[None]))
    if options.return_generation_logits and completion.generation_logits is not None:
        rows = completion.generation_logits[start:].numpy().astype(np.float32)
        tensors.append(output_tensor("generation_logits", rows[None, None]))
    return tensors


def perf_tensors(completion: CompletionOutput) -> list:
    metrics = completion.request_perf_metrics
    assert metrics is not None  # the callers send perf tensors only with metrics
    tensors = [output_tensor(name, np.array([[getattr(metrics, name)]], dtype=np.int32)) for name in PERF_INT32]
    tensors += [output_tensor(name, np.array([[getattr(metrics, name)]], dtype=np.int64)) for name in PERF_INT64]
    tensors.append(output_tensor("acceptance_rate", np.array([[metrics.acceptance_rate]], dtype=np.float32)))
    return tensors


def merge_batch(per_row: list[list]) -> list:
    """One response for all rows (non-decoupled mode): stack each tensor along the batch dim, padding token
    tensors with -1 (as the anchor pads output_ids) and prefix ids on the left."""
    merged = []
    for position, first in enumerate(per_row[0]):
        name = first.name()
        arrays = [row[position].as_numpy() for row in per_row]
        merged.append(output_tensor(name, _stack(arrays, left_pad=name == "detok_prefix_ids")))
    return merged


def _stack(arrays: list[np.ndarray], left_pad: bool) -> np.ndarray:
    if arrays[0].ndim < 3:
        return np.concatenate(arrays, axis=0)
    width = max(a.shape[-1] for a in arrays)
    padded = []
    for array in arrays:
        missing = width - array.shape[-1]
        pad = [(0, 0)] * (array.ndim - 1) + [(missing, 0) if left_pad else (0, missing)]
        padded.append(np.pad(array, pad, constant_values=-1))
    return np.concatenate(padded, axis=0)
