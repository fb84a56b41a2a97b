"""Reads one `tensorrt_llm_bls` request: checks it, and names the tensors its preprocessing and tensorrt_llm
calls get (contract section 1.5; BLS inputs are renamed on the way as the ensemble renames them).

Inputs of features that are not built yet are refused with an error naming them, never silently dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..triton import pb
from ..triton.pb import InputError
from .speculative import SpeculationSettings

# BLS input -> preprocessing input.
TO_PREPROCESSING = {
    "text_input": "QUERY",
    "max_tokens": "REQUEST_OUTPUT_LEN",
    "bad_words": "BAD_WORDS_DICT",
    "stop_words": "STOP_WORDS_DICT",
    "embedding_bias_words": "EMBEDDING_BIAS_WORDS",
    "embedding_bias_weights": "EMBEDDING_BIAS_WEIGHTS",
    "end_id": "END_ID",
    "pad_id": "PAD_ID",
}
# preprocessing output -> tensorrt_llm input.
PREPROCESSED_TO_LLM = {
    "INPUT_ID": "input_ids",
    "REQUEST_INPUT_LEN": "input_lengths",
    "REQUEST_OUTPUT_LEN": "request_output_len",
    "OUT_END_ID": "end_id",
    "OUT_PAD_ID": "pad_id",
    "STOP_WORDS_IDS": "stop_words_list",
    "BAD_WORDS_IDS": "bad_words_list",
    "EMBEDDING_BIAS": "embedding_bias",
}
# BLS input -> tensorrt_llm input: one value per batch row.
TO_LLM = {
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "length_penalty": "len_penalty",
    "stream": "streaming",
    "temperature": "temperature",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "return_log_probs": "return_log_probs",
    "return_perf_metrics": "return_perf_metrics",
    "exclude_input_in_output": "exclude_input_in_output",
    "num_return_sequences": "num_return_sequences",
    "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits",
    "lora_task_id": "lora_task_id",
    "lora_name": "lora_name",
    "priority": "priority",
    "beam_width": "beam_width",
    # Checked by tensorrt_llm, whose error names the input (and reaches the client as this request's error).
    "guided_decoding_guide_type": "guided_decoding_guide_type",
    "guided_decoding_guide": "guided_decoding_guide",
}

# BLS input -> tensorrt_llm input, forwarded as sent ([batch, ...] ragged tensors).
TO_LLM_AS_IS = ("lora_weights", "lora_config")
# Inputs whose mere presence asks for a feature that is not built yet.
UNSUPPORTED_INPUTS = {
    "decoder_text_input": "encoder-decoder models",
    "image_input": "multimodal models",
    "image_bytes_input": "multimodal models",
    "image_url_input": "multimodal models",
    "video_bytes_input": "multimodal models",
    "prompt_embedding_table": "prompt tables",
    "prompt_table_extra_id": "prompt tables",
}
# Inputs that ask for a feature not built yet only with some values: (rule that is refused, feature).
UNSUPPORTED_VALUES: dict = {}


@dataclass
class BlsRequest:
    """One BLS request, checked. Lists have one entry per batch row."""

    inputs: dict[str, np.ndarray]  # every input the request carries, as sent
    prompts: list[str]
    stop_words: list[list[str]]
    streaming: bool
    exclude_input: list[bool]
    sequences_per_row: list[int]  # response streams per row: num_return_sequences, or 1 for all beams
    speculation: Optional[SpeculationSettings] = None  # num_draft_tokens > 0: the draft/target loop

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    @property
    def sequence_count(self) -> int:
        return sum(self.sequences_per_row)

    def preprocessing_inputs(self) -> dict[str, np.ndarray]:
        return {target: self.inputs[name] for name, target in TO_PREPROCESSING.items() if name in self.inputs}

    def llm_inputs(self, preprocessed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The tensorrt_llm request: token ids and word lists from preprocessing, the knobs from this request.
        Every per-row knob goes as [batch, 1] (tensorrt_llm declares them dims [1] with a reshape)."""
        tensors = {
            PREPROCESSED_TO_LLM[name]: array for name, array in preprocessed.items() if name in PREPROCESSED_TO_LLM
        }
        for name, target in TO_LLM.items():
            if name in self.inputs:
                tensors[target] = self.inputs[name].reshape(self.batch_size, 1)
        for name in TO_LLM_AS_IS:
            if name in self.inputs and self.inputs[name].size:
                tensors[name] = self.inputs[name]
        if "min_tokens" not in tensors and "min_length" in self.inputs:  # genai-perf's older name
            tensors["min_tokens"] = self.inputs["min_length"].reshape(self.batch_size, 1)
        return tensors


def read_request(request: Any, decoupled: bool) -> BlsRequest:
    """The request's inputs, copied (not views into the request's memory, which Triton may release once execute
    returns) and checked; InputError names what is wrong."""
    inputs = {tensor.name(): np.array(tensor.as_numpy(), copy=True) for tensor in request.inputs()}
    query = pb.required_input(request, "text_input", "STRING")
    batch = query.shape[0] if query.ndim else 0
    for name, array in inputs.items():
        pb.check_batch_size(array, name, batch)
    check_supported(inputs)
    pb.required_input(request, "max_tokens", "INT32")
    for row in range(batch):
        _row_int(request, "max_tokens", row, default=1)  # >= 1, checked before any model works on the request
    parsed = BlsRequest(
        inputs=inputs,
        prompts=[pb.row_scalar(query, row, "text_input", "str") for row in range(batch)],
        stop_words=_stop_words(request, batch),
        streaming=_request_flag(request, "stream", batch),
        exclude_input=[_row_flag(request, "exclude_input_in_output", row) for row in range(batch)],
        sequences_per_row=[_responses_per_row(request, row) for row in range(batch)],
        speculation=_speculation(request, batch),
    )
    if not decoupled:
        check_one_response(parsed)
    return parsed


def check_supported(inputs: dict[str, np.ndarray]) -> None:
    for name, feature in UNSUPPORTED_INPUTS.items():
        if name in inputs and _carries_something(inputs[name]):
            raise InputError(f"input '{name}' needs {feature}, which is not supported yet")
    for name, (refused, feature) in UNSUPPORTED_VALUES.items():
        if name in inputs and any(refused(value) for value in inputs[name].reshape(-1).tolist()):
            raise InputError(f"input '{name}' asks for {feature}, which is not supported yet")


def _carries_something(array: np.ndarray) -> bool:
    """A present input asks for its feature unless it is empty (HTTP clients send "" for "none")."""
    if array.dtype.kind in "OSU":
        return any(value not in (b"", "") for value in array.reshape(-1).tolist())
    return array.size > 0


def check_one_response(request: BlsRequest) -> None:
    """A non-decoupled model answers each request with exactly one response (contract Q12)."""
    if request.streaming:
        raise InputError(
            "input 'stream' = true needs a decoupled tensorrt_llm_bls (this repository is not "
            "decoupled, so each request gets exactly one response): send stream=false"
        )
    if any(count > 1 for count in request.sequences_per_row):
        raise InputError(
            "input 'num_return_sequences' > 1 needs a decoupled tensorrt_llm_bls (one response per "
            "sequence); this repository is not decoupled"
        )


def _stop_words(request: Any, batch: int) -> list[list[str]]:
    array = pb.optional_input(request, "stop_words", "STRING")
    if array is None:
        return [[] for _ in range(batch)]
    return [[word for word in row if word] for row in pb.string_rows(array, "stop_words")]


def _row_value(request: Any, name: str, row: int, kind: str, default):
    array = pb.optional_input(request, name)
    return default if array is None else pb.row_scalar(array.reshape(array.shape[0], -1), row, name, kind)


def _row_flag(request: Any, name: str, row: int) -> bool:
    return _row_value(request, name, row, "bool", False)


def _row_int(request: Any, name: str, row: int, default: int) -> int:
    value = _row_value(request, name, row, "int", default)
    if value < 1:
        raise InputError(name, f"must be >= 1, got {value}")
    return value


def _request_flag(request: Any, name: str, batch: int) -> bool:
    """A flag that holds for the whole request (one stream answers all rows): every row must agree."""
    values = {_row_flag(request, name, row) for row in range(batch)}
    if len(values) > 1:
        raise InputError(name, "must have the same value in every batch row")
    return values.pop() if values else False


def _responses_per_row(request, row: int) -> int:
    """Response streams of a row: one per returned sequence, or one for all beams of a beam search."""
    if _row_int(request, "beam_width", row, 1) > 1:
        return 1
    return _row_int(request, "num_return_sequences", row, 1)


def _speculation(request: Any, batch: int) -> Optional[SpeculationSettings]:
    """The draft/target loop's settings when num_draft_tokens > 0; it runs one plain sequence."""
    if pb.optional_input(request, "num_draft_tokens") is None:
        return None
    count = _row_value(request, "num_draft_tokens", 0, "int", 0)
    if count < 0:
        raise InputError("num_draft_tokens", f"must be >= 0, got {count}")
    if count == 0:
        return None
    if batch != 1:
        raise InputError("num_draft_tokens", f"speculative decoding runs one prompt per request, got {batch}")
    for name, why in (("beam_width", "beam search"), ("num_return_sequences", "several sequences")):
        if _row_int(request, name, 0, 1) > 1:
            raise InputError(name, f"{why} cannot be combined with num_draft_tokens > 0")
    for name in ("return_context_logits", "return_generation_logits"):
        if _row_flag(request, name, 0):
            raise InputError(name, "logits cannot be returned with num_draft_tokens > 0")
    return SpeculationSettings(count, _row_flag(request, "use_draft_logits", 0))
