"""The `preprocessing` Triton model: prompt text -> token ids and the per-request tensors `tensorrt_llm` needs.

Contract: interface-contract.md section 1.1. The model repository's `preprocessing/1/model.py` only imports
`TritonPythonModel` from here. Encoder-decoder, multimodal and p-tuning inputs are refused per request with an
error naming the input, instead of being half-supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from tritonllm import tokenizer as tok
from tritonllm.triton import pb
from tritonllm.triton.params import Parameters
from tritonllm.triton.parent_watch import exit_with_parent
from tritonllm.triton.start_errors import reports_start_errors
from tritonllm.triton.tokenizer_param import load_tokenizer_for_model, required_tokenizer_dir

UNSUPPORTED_INPUTS = {
    "DECODER_QUERY": "encoder-decoder models are not supported",
    "IMAGE_BYTES": "multimodal models are not supported",
    "IMAGE_URL": "multimodal models are not supported",
    "VIDEO_BYTES": "multimodal models are not supported",
    "PROMPT_TABLE_EXTRA_ID": "prompt-table (p-tuning) extra ids are not supported yet",
}


@dataclass
class PreprocessingConfig:
    tokenizer_dir: str
    add_special_tokens: bool = True

    @classmethod
    def from_parameters(cls, params: Parameters) -> "PreprocessingConfig":
        return cls(required_tokenizer_dir(params), params.bool("add_special_tokens", True))


@dataclass
class PreprocessingRequest:
    """One Triton request's inputs, read and validated; every list has one entry per batch row."""

    prompts: list[str]
    request_output_len: np.ndarray
    bad_words: list[list[str]]
    stop_words: list[list[str]]
    bias_words: list[list[str]]
    bias_weights: Optional[list[list[float]]]
    end_ids: Optional[np.ndarray]
    pad_ids: Optional[np.ndarray]


def read_request(request: Any) -> PreprocessingRequest:
    for name, why in UNSUPPORTED_INPUTS.items():
        pb.reject_input(request, name, why)
    query = pb.required_input(request, "QUERY", "STRING")
    batch = query.shape[0] if query.ndim else 0
    prompts = [pb.row_scalar(query, row, "QUERY", "str") for row in range(batch)]
    output_len = _batched(request, "REQUEST_OUTPUT_LEN", "INT32", batch, required=True)
    assert output_len is not None  # required: a missing input raised
    return PreprocessingRequest(
        prompts=prompts,
        request_output_len=output_len,
        bad_words=_words(request, "BAD_WORDS_DICT", batch),
        stop_words=_words(request, "STOP_WORDS_DICT", batch),
        bias_words=_words(request, "EMBEDDING_BIAS_WORDS", batch),
        bias_weights=_weights(request, "EMBEDDING_BIAS_WEIGHTS", batch),
        end_ids=_ids(request, "END_ID", batch),
        pad_ids=_ids(request, "PAD_ID", batch),
    )


def _batched(request: Any, name: str, dtype: str, batch: int, required: bool = False) -> Optional[np.ndarray]:
    array = pb.required_input(request, name, dtype) if required else pb.optional_input(request, name, dtype)
    if array is not None:
        pb.check_batch_size(array, name, batch)
    return array


def _words(request: Any, name: str, batch: int) -> list[list[str]]:
    """A [B, N] STRING word list; absent means no words in any row."""
    array = _batched(request, name, "STRING", batch)
    return [[] for _ in range(batch)] if array is None else pb.string_rows(array, name)


def _weights(request: Any, name: str, batch: int) -> Optional[list[list[float]]]:
    array = _batched(request, name, "FP32", batch)
    return None if array is None else [list(map(float, row)) for row in array.reshape(batch, -1)]


def _ids(request: Any, name: str, batch: int) -> Optional[np.ndarray]:
    array = _batched(request, name, "INT32", batch)
    if array is None:
        return None
    return np.array([[pb.row_scalar(array, row, name, "int")] for row in range(batch)], dtype=np.int32)


class Preprocessor:
    """Turns one request into the output tensors; holds the tokenizer, loaded once."""

    def __init__(self, tokenizer: tok.LoadedTokenizer, add_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens

    def outputs(self, inputs: PreprocessingRequest) -> dict[str, np.ndarray]:
        batch = len(inputs.prompts)
        input_ids, lengths = tok.encode_prompts(self.tokenizer, inputs.prompts, self.add_special_tokens)
        pad_ids = self._default_ids(inputs.pad_ids, self.tokenizer.pad_id, batch)
        return {
            "INPUT_ID": input_ids,
            "REQUEST_INPUT_LEN": lengths.reshape(batch, 1),
            # Decoder-only: the decoder input is one pad token per row, as the anchor sends.
            "DECODER_INPUT_ID": pad_ids.copy(),
            "REQUEST_DECODER_INPUT_LEN": np.ones((batch, 1), dtype=np.int32),
            "BAD_WORDS_IDS": tok.to_word_list_format(self.tokenizer, inputs.bad_words),
            "STOP_WORDS_IDS": tok.to_word_list_format(self.tokenizer, inputs.stop_words),
            "EMBEDDING_BIAS": tok.embedding_bias(self.tokenizer, inputs.bias_words, inputs.bias_weights),
            "REQUEST_OUTPUT_LEN": inputs.request_output_len,
            "OUT_END_ID": self._default_ids(inputs.end_ids, self.tokenizer.end_id, batch),
            "OUT_PAD_ID": pad_ids,
        }

    @staticmethod
    def _default_ids(given: Optional[np.ndarray], default: int, batch: int) -> np.ndarray:
        return given if given is not None else np.full((batch, 1), default, dtype=np.int32)

    def respond(self, request: Any) -> Any:
        """The response to one request: its outputs, or an error naming the bad input."""
        return pb.respond(
            "preprocessing",
            lambda: [pb.output_tensor(name, array) for name, array in self.outputs(read_request(request)).items()],
        )


class TritonPythonModel:
    preprocessor: Optional[Preprocessor]  # None after finalize()

    @reports_start_errors
    def initialize(self, args: dict) -> None:
        exit_with_parent()
        params = Parameters.from_model_config(json.loads(args["model_config"]))
        config = PreprocessingConfig.from_parameters(params)
        tokenizer = load_tokenizer_for_model(config.tokenizer_dir, params.model_name)
        self.preprocessor = Preprocessor(tokenizer, config.add_special_tokens)

    def execute(self, requests: list) -> list:
        preprocessor = self.preprocessor
        assert preprocessor is not None  # Triton calls execute() only between initialize() and finalize()
        return [preprocessor.respond(request) for request in requests]

    def finalize(self) -> None:
        self.preprocessor = None
