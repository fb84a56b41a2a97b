"""Turns one `tensorrt_llm` Triton request into engine rows: token ids plus SamplingParams per batch row.

Tensor names are the contract's (TensorRT-LLM backend `tensorrt_llm` model). Every bad value raises `InputError`
naming the input; inputs of features that are not built yet are refused rather than silently ignored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..engine.types import LoRARequest, SamplingParams
from .guided_inputs import GUIDE_INPUT, GUIDE_PREFIX_INPUT, GUIDE_TYPE_INPUT, parse_guide
from .pb import InputError, decode_string, optional_input

# Inputs whose feature is not built yet: sending one is an error, never silently dropped.
UNSUPPORTED_INPUTS = {
    "prompt_embedding_table": "prompt tables",
    "prompt_table_extra_ids": "prompt tables",
    "encoder_input_features": "encoder-decoder/multimodal",
    "encoder_output_lengths": "encoder-decoder/multimodal",
    "cross_attention_mask": "multimodal",
    "skip_cross_attn_blocks": "multimodal",
    "mrope_rotary_cos_sin": "multimodal",
    "mrope_position_deltas": "multimodal",
    "context_phase_params": "disaggregated serving",
    "retention_token_range_starts": "KV cache retention",
    "retention_token_range_ends": "KV cache retention",
    "retention_token_range_priorities": "KV cache retention",
    "retention_token_range_durations_ms": "KV cache retention",
    "retention_decode_priority": "KV cache retention",
    "retention_decode_duration_ms": "KV cache retention",
    "runtime_top_p_min": "top-p decay",
    "runtime_top_p_decay": "top-p decay",
    "runtime_top_p_reset_ids": "top-p decay",
}


@dataclass
class RowOptions:
    """What a row's responses carry, beyond the tokens."""

    streaming: bool
    exclude_input_in_output: bool
    return_log_probs: bool
    return_perf_metrics: bool
    return_context_logits: bool = False
    return_generation_logits: bool = False


@dataclass
class EngineRow:
    prompt_token_ids: list[int]
    params: SamplingParams
    options: RowOptions
    lora: Optional[LoRARequest] = None


def batch_size(request) -> int:
    ids = optional_input(request, "input_ids")
    if ids is None:
        raise InputError("input 'input_ids' is required (a value is required for input_ids)")
    if ids.ndim != 2:
        raise InputError(f"input 'input_ids' must be 2-D [batch, tokens], got shape {list(ids.shape)}")
    return ids.shape[0]


def is_stop_request(request) -> bool:
    stop = optional_input(request, "stop")
    return stop is not None and bool(np.asarray(stop).reshape(-1)[0])


def check_unsupported(request) -> None:
    for name, feature in UNSUPPORTED_INPUTS.items():
        value = optional_input(request, name)
        if value is None or value.size == 0:
            continue
        raise InputError(f"input '{name}' needs {feature}, which is not supported yet")


def convert_request(request, default_exclude_input: bool, decoupled: bool) -> list[EngineRow]:
    """All rows of a Triton request, validated."""
    check_unsupported(request)
    rows = batch_size(request)
    ids = optional_input(request, "input_ids")
    assert ids is not None  # batch_size() raised otherwise
    ids = ids.astype(np.int64)
    lengths = _column(request, "input_lengths", rows, required=True)
    assert lengths is not None  # required: _column raised otherwise
    return [
        _convert_row(request, row, ids[row], int(lengths[row]), default_exclude_input, decoupled) for row in range(rows)
    ]


def _convert_row(request, row, ids, length, default_exclude_input, decoupled) -> EngineRow:
    if not 0 < length <= ids.shape[0]:
        raise InputError(f"input 'input_lengths' = {length} must be in [1, {ids.shape[0]}] (the input_ids width)")
    streaming = _flag(request, "streaming", row, False)
    if streaming and not decoupled:
        raise InputError("input 'streaming' = true: streaming is only supported in decoupled mode")
    beam_width = _int(request, "beam_width", row) or 1
    _refuse_diversity(request, row)
    params = SamplingParams(
        max_tokens=_output_len(request, row),
        end_id=_int(request, "end_id", row),
        pad_id=_int(request, "pad_id", row),
        n=_int(request, "num_return_sequences", row) or beam_width,  # beam search returns every beam by default
        beam_width=beam_width,
        early_stopping=_early_stopping(request, row),
        priority=_float(request, "priority", row),
        temperature=_float(request, "temperature", row),
        top_k=_int(request, "runtime_top_k", row),
        top_p=_top_p(request, row),
        seed=_int(request, "seed", row),
        min_tokens=_min_tokens(request, row),
        repetition_penalty=_float(request, "repetition_penalty", row),
        presence_penalty=_float(request, "presence_penalty", row),
        frequency_penalty=_float(request, "frequency_penalty", row),
        length_penalty=_float(request, "len_penalty", row),
        stop_words=_word_list(request, "stop_words_list", row),
        bad_words=_word_list(request, "bad_words_list", row),
        embedding_bias=_embedding_bias(request, row),
        logprobs=_flag(request, "return_log_probs", row, False),
        return_context_logits=_flag(request, "return_context_logits", row, False),
        return_generation_logits=_flag(request, "return_generation_logits", row, False),
        return_perf_metrics=_flag(request, "return_perf_metrics", row, False),
        lookahead_config=_lookahead(request, row),
        guided_decoding=parse_guide(_text(request, GUIDE_TYPE_INPUT, row), _text(request, GUIDE_INPUT, row)),
        guided_prefix_len=_guided_prefix_len(request, row, length),
        **_draft_inputs(request, row),
    )
    options = RowOptions(
        streaming,
        _flag(request, "exclude_input_in_output", row, default_exclude_input),
        params.logprobs,
        params.return_perf_metrics,
        params.return_context_logits,
        params.return_generation_logits,
    )
    try:
        params.validate()
    except ValueError as exc:
        raise InputError(f"invalid sampling input: {exc}") from None
    return EngineRow([int(t) for t in ids[:length]], params, options, _lora_request(request, row))


LOOKAHEAD_INPUTS = {
    "lookahead_window_size": "max_window_size",
    "lookahead_ngram_size": "max_ngram_size",
    "lookahead_verification_set_size": "max_verification_set_size",
}


def _lookahead(request, row):
    """The row's own lookahead (W, N, G): all three inputs or none (as TensorRT-LLM's backend requires)."""
    from tritonllm.spec_decode.config import LookaheadConfig

    values = {name: _int(request, name, row) for name in LOOKAHEAD_INPUTS}
    given = [name for name, value in values.items() if value is not None]
    if not given:
        return None
    if len(given) < len(values):
        missing = sorted(set(values) - set(given))
        raise InputError(f"input '{given[0]}' needs all three lookahead inputs; missing {', '.join(missing)}")
    for name, value in values.items():
        least = 2 if name == "lookahead_ngram_size" else 1
        if value < least:
            raise InputError(f"input '{name}' = {value} must be >= {least}")
    return LookaheadConfig(**{key: values[name] for name, key in LOOKAHEAD_INPUTS.items()})


def _early_stopping(request, row) -> Optional[int]:
    value = _scalar(request, "early_stopping", row)  # BOOL on the wire; TensorRT-LLM's integer 1 / 0
    return None if value is None else int(bool(value))


def _refuse_diversity(request, row) -> None:
    rate = _float(request, "beam_search_diversity_rate", row)
    if rate:
        raise InputError(
            f"input 'beam_search_diversity_rate' = {rate}: diverse beam search is not supported "
            "(send 0 or leave it out)"
        )


def _lora_request(request, row) -> Optional[LoRARequest]:
    """The row's adapter: `lora_task_id` (with `lora_weights` + `lora_config` the first time), or `lora_name`
    (an adapter preloaded from lora_dir / lora_prefetch_dir). None: the base model."""
    task_id = _int(request, "lora_task_id", row)
    name = _scalar(request, "lora_name", row)
    name = name.decode() if isinstance(name, bytes) else (None if name is None else str(name))
    weights, config = _row_tensor(request, "lora_weights", row), _row_tensor(request, "lora_config", row)
    if task_id is None and not name:
        if weights is not None or config is not None:
            raise InputError(
                "input 'lora_task_id' is required with lora_weights / lora_config (the id the adapter is cached under)"
            )
        return None
    if (weights is None) != (config is None):
        missing = "lora_config" if config is None else "lora_weights"
        raise InputError(
            f"input '{missing}' is missing: lora_weights and lora_config go together (lora_task_id {task_id})"
        )
    return LoRARequest(lora_name=name or None, lora_int_id=task_id, lora_weights=weights, lora_config=config)


def _draft_inputs(request, row) -> dict:
    """External draft tokens (TensorRT-LLM's ExternalDraftTokensConfig): `draft_input_ids` [batch, k],
    `draft_logits` [batch, k, vocab] and `draft_acceptance_threshold` [batch] for one row."""
    ids = _row_tensor(request, "draft_input_ids", row)
    logits = _row_tensor(request, "draft_logits", row)
    threshold = _float(request, "draft_acceptance_threshold", row)
    if ids is None:
        if logits is not None or threshold is not None:
            name = "draft_logits" if logits is not None else "draft_acceptance_threshold"
            raise InputError(f"input '{name}' needs input 'draft_input_ids' (the draft tokens it goes with)")
        return {}
    if ids.ndim != 1:
        raise InputError(f"input 'draft_input_ids' must be [batch, draft tokens], got a row of shape {list(ids.shape)}")
    fields: dict[str, Any] = {"draft_tokens": [int(t) for t in ids], "draft_acceptance_threshold": threshold}
    if logits is not None:
        if logits.ndim != 2 or logits.shape[0] != ids.shape[0]:
            raise InputError(
                f"input 'draft_logits' must be [batch, {ids.shape[0]}, vocab] for {ids.shape[0]} draft "
                f"tokens, got a row of shape {list(logits.shape)}"
            )
        import torch

        fields["draft_logits"] = torch.from_numpy(np.ascontiguousarray(logits, dtype=np.float32))
    return fields


def _row_tensor(request, name, row) -> Optional[np.ndarray]:
    """A ragged per-row tensor input ([batch, ...]) for one row, or None when absent or empty."""
    value = optional_input(request, name)
    if value is None or value.size == 0:
        return None
    return np.asarray(value[min(row, value.shape[0] - 1)])


def _column(request, name, rows, required=False) -> Optional[np.ndarray]:
    """A per-row scalar input ([B] after reshape, or [B, 1]) as a flat array of `rows` values."""
    value = optional_input(request, name)
    if value is None or value.size == 0:
        if required:
            raise InputError(f"input '{name}' is required")
        return None
    flat = np.asarray(value).reshape(value.shape[0] if value.ndim else 1, -1)[:, 0]
    if flat.shape[0] not in (1, rows):
        raise InputError(f"input '{name}' has {flat.shape[0]} rows but input_ids has {rows}")
    return flat


def _scalar(request, name, row, required=False):
    column = _column(request, name, batch_size(request), required)
    return None if column is None else column[min(row, column.shape[0] - 1)]


def _int(request, name, row, required=False) -> Optional[int]:
    value = _scalar(request, name, row, required)
    return None if value is None else int(value)


def _float(request, name, row) -> Optional[float]:
    value = _scalar(request, name, row)
    return None if value is None else float(value)


def _guided_prefix_len(request, row, length) -> int:
    """How many of the row's last prompt tokens are guided output already (0 when the input is absent)."""
    value = _int(request, GUIDE_PREFIX_INPUT, row) or 0
    if not 0 <= value <= length:
        raise InputError(GUIDE_PREFIX_INPUT, f"= {value} must be in [0, {length}] (the row's input_lengths)")
    if value and not _text(request, GUIDE_TYPE_INPUT, row).strip():
        raise InputError(GUIDE_PREFIX_INPUT, f"continues a guided output: it needs input '{GUIDE_TYPE_INPUT}'")
    return value


def _text(request, name, row) -> str:
    """A per-row STRING input as text; "" when absent."""
    value = _scalar(request, name, row)
    return "" if value is None else decode_string(value, name)


def _flag(request, name, row, default: bool) -> bool:
    value = _scalar(request, name, row)
    return default if value is None else bool(value)


def _output_len(request, row) -> int:
    value = _int(request, "request_output_len", row, required=True)
    assert value is not None  # required: _column raised otherwise
    if value < 1:
        raise InputError("request_output_len", f"(the ensemble's max_tokens) must be >= 1, got {value}")
    return value


def _top_p(request, row) -> Optional[float]:
    value = _float(request, "runtime_top_p", row)
    return None if value is None or value <= 0 else value  # the anchor treats top_p <= 0 as unset


def _min_tokens(request, row) -> Optional[int]:
    value = _int(request, "min_tokens", row)
    return value if value is not None else _int(request, "min_length", row)  # genai-perf's older name


def _word_list(request, name, row) -> Optional[list[list[int]]]:
    value = optional_input(request, name)
    if value is None or value.size == 0:
        return None
    if value.ndim != 3 or value.shape[1] != 2:
        raise InputError(f"input '{name}' must have shape [batch, 2, length], got {list(value.shape)}")
    return parse_word_list(value[min(row, value.shape[0] - 1)], name)


def parse_word_list(pair: np.ndarray, name: str) -> Optional[list[list[int]]]:
    """[[flat ids...], [cumulative end offsets..., -1 padding]] -> token sequences."""
    ids, offsets = pair[0].tolist(), [int(o) for o in pair[1].tolist() if o >= 0]
    words, start = [], 0
    for end in offsets:
        if end < start or end > len(ids):
            raise InputError(f"input '{name}' has an offset {end} outside its {len(ids)} ids")
        if end > start:
            words.append([int(t) for t in ids[start:end]])
        start = end
    return words or None


def _embedding_bias(request, row) -> Optional[list[float]]:
    value = optional_input(request, "embedding_bias")
    if value is None or value.size == 0:
        return None
    return np.asarray(value[min(row, value.shape[0] - 1)], dtype=np.float32).tolist()
