"""The `postprocessing` Triton model: token ids -> text, whole or as a streaming delta.

Contract: interface-contract.md section 1.4. Stateless, like the anchor's. For streaming without garbled
characters or lost spaces (pain points P1, P2) the `tensorrt_llm` model may send, with each chunk of new tokens,
the few tokens that preceded them (`PREFIX_IDS`) and whether the chunk is the last (`IS_FINAL`); the text is then
`detokenize_delta(prefix, new tokens)`. Without `PREFIX_IDS` the tokens are decoded whole, as the anchor does.
A request that Triton marks cancelled (its ensemble request was) is still answered, so that Triton 2.51 can
complete the ensemble request, and its `CANCEL_KEY` stops the generation behind it (`triton.stop_channel`).
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
from tritonllm.triton.stop_channel import send_stop
from tritonllm.triton.tokenizer_param import load_tokenizer_for_model, required_tokenizer_dir

PREFIX_PADDING = -1  # PREFIX_IDS rows are left-padded with -1 to a common width
STOPPED_KEYS_KEPT = 1024  # a cancelled stream's later chunks carry the same key: sent once


@dataclass
class PostprocessingConfig:
    tokenizer_dir: str
    skip_special_tokens: bool = True

    @classmethod
    def from_parameters(cls, params: Parameters) -> "PostprocessingConfig":
        return cls(required_tokenizer_dir(params), params.bool("skip_special_tokens", True))


@dataclass
class PostprocessingRequest:
    """One request's inputs: sequences[b][beam] are the tokens to turn into text."""

    sequences: list[list[list[int]]]
    prefixes: Optional[list[list[list[int]]]]  # None: decode whole (non-streaming)
    is_final: list[bool]


def read_request(request: Any) -> PostprocessingRequest:
    tokens = pb.required_input(request, "TOKENS_BATCH", "INT32")
    if tokens.ndim != 3:
        raise pb.InputError("TOKENS_BATCH", f"must have shape [batch, beams, tokens], got {list(tokens.shape)}")
    batch, beams = tokens.shape[:2]
    lengths = pb.required_input(request, "SEQUENCE_LENGTH", "INT32")
    if lengths.shape != (batch, beams):
        raise pb.InputError(
            "SEQUENCE_LENGTH",
            f"must have shape {[batch, beams]} (batch, beams of TOKENS_BATCH), got {list(lengths.shape)}",
        )
    return PostprocessingRequest(
        sequences=[[_sequence(tokens[b, beam], int(lengths[b, beam])) for beam in range(beams)] for b in range(batch)],
        prefixes=_prefixes(request, batch, beams),
        is_final=_is_final(request, batch),
    )


def _sequence(tokens: np.ndarray, length: int) -> list[int]:
    if not 0 <= length <= tokens.shape[0]:
        raise pb.InputError(
            "SEQUENCE_LENGTH", f"must be between 0 and {tokens.shape[0]} (the TOKENS_BATCH width), got {length}"
        )
    sequence = tokens[:length].tolist()
    if any(token < 0 for token in sequence):
        raise pb.InputError("TOKENS_BATCH", "must not hold negative token ids within SEQUENCE_LENGTH")
    return sequence


def _prefixes(request: Any, batch: int, beams: int) -> Optional[list[list[list[int]]]]:
    prefix_ids = pb.optional_input(request, "PREFIX_IDS", "INT32")
    if prefix_ids is None:
        return None
    if prefix_ids.ndim != 3 or prefix_ids.shape[:2] != (batch, beams):
        raise pb.InputError("PREFIX_IDS", f"must have shape {[batch, beams, 'K']}, got {list(prefix_ids.shape)}")
    return [
        [[int(t) for t in prefix_ids[b, beam] if t != PREFIX_PADDING] for beam in range(beams)] for b in range(batch)
    ]


def _is_final(request: Any, batch: int) -> list[bool]:
    flags = pb.optional_input(request, "IS_FINAL", "BOOL")
    if flags is None:
        return [True] * batch  # absent: each response is complete text
    pb.check_batch_size(flags, "IS_FINAL", batch)
    return [pb.row_scalar(flags, row, "IS_FINAL", "bool") for row in range(batch)]


class Postprocessor:
    def __init__(self, tokenizer: tok.LoadedTokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stopped_keys: dict[str, None] = {}  # insertion-ordered: the oldest is dropped first

    def stop_generation(self, request: Any) -> None:
        """Send the request's CANCEL_KEY (once) to the tensorrt_llm instance that generates its tokens."""
        keys = pb.optional_input(request, "CANCEL_KEY")
        for key in [] if keys is None else {bytes(k).decode("ascii", "replace") for k in keys.reshape(-1)}:
            if key in self.stopped_keys:
                continue
            self.stopped_keys[key] = None
            if len(self.stopped_keys) > STOPPED_KEYS_KEPT:
                del self.stopped_keys[next(iter(self.stopped_keys))]
            send_stop(key)

    def texts(self, inputs: PostprocessingRequest) -> list[str]:
        """One text per (batch row, beam), flattened row-major like the anchor's OUTPUT."""
        texts = []
        for b, beams in enumerate(inputs.sequences):
            for beam, sequence in enumerate(beams):
                if inputs.prefixes is None:
                    texts.append(tok.decode_ids(self.tokenizer, sequence, self.skip_special_tokens))
                else:
                    texts.append(
                        tok.detokenize_delta(
                            self.tokenizer,
                            inputs.prefixes[b][beam],
                            sequence,
                            inputs.is_final[b],
                            self.skip_special_tokens,
                        )
                    )
        return texts

    def respond(self, request: Any) -> Any:
        if request.is_cancelled():
            self.stop_generation(request)
        return pb.respond("postprocessing", lambda: [pb.string_tensor("OUTPUT", self.texts(read_request(request)))])


class TritonPythonModel:
    postprocessor: Optional[Postprocessor]  # None after finalize()

    @reports_start_errors
    def initialize(self, args: dict) -> None:
        exit_with_parent()
        params = Parameters.from_model_config(json.loads(args["model_config"]))
        config = PostprocessingConfig.from_parameters(params)
        tokenizer = load_tokenizer_for_model(config.tokenizer_dir, params.model_name)
        self.postprocessor = Postprocessor(tokenizer, config.skip_special_tokens)

    def execute(self, requests: list) -> list:
        postprocessor = self.postprocessor
        assert postprocessor is not None  # Triton calls execute() only between initialize() and finalize()
        return [postprocessor.respond(request) for request in requests]

    def finalize(self) -> None:
        self.postprocessor = None
