"""The BLS draft/target loop (speculative decoding with a draft model served as its own tensorrt_llm model).

Each round: the draft model proposes `num_draft_tokens` tokens after the text so far; the target model checks them
in one step (`draft_input_ids`, plus `draft_logits` with `use_draft_logits`) and answers the tokens it accepts and
one of its own. The round's new tokens go to the client at once (a stream gets one piece per round, which the
TensorRT-LLM BLS cannot do), and the next round starts from the longer text. Prefix reuse in the engines keeps the
re-sent context cheap.

Both calls run with end_id -1 (never stop on it) and the loop stops on the real end id itself: a target that
stopped on it would answer without it, and the loop could not tell that from a short accepted draft. The loop also
stops at max_tokens, when a round adds nothing, or when the handler closes it (a text stop word).

A guided request's target calls carry its guide and `guided_decoding_prefix_len` = the tokens generated so far, so
the grammar continues where the last round left it (its end, too, ends a round short, and the next one adds
nothing); the draft runs unguided, and the target rejects the draft tokens the grammar forbids."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

import numpy as np

from ..tokenizer import DETOKENIZE_PREFIX_TOKENS
from .llm_calls import LlmCall, LlmCancelled, LlmResponse

# The guide's inputs (tensorrt_llm's names), and ours that continues it past the tokens generated so far.
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")
GUIDE_PREFIX_INPUT = "guided_decoding_prefix_len"
# Inputs of the target request that do not apply to the draft call (or are set per call here).
PER_CALL = (
    "input_ids",
    "input_lengths",
    "request_output_len",
    "streaming",
    "exclude_input_in_output",
    "end_id",
    "min_tokens",
    "draft_input_ids",
    "draft_logits",
    "return_generation_logits",
    "return_context_logits",
    "return_log_probs",
    "num_return_sequences",
    *GUIDE_INPUTS,
    GUIDE_PREFIX_INPUT,
)


@dataclass
class SpeculationSettings:
    num_draft_tokens: int
    use_draft_logits: bool


class SpeculativeCall:
    """Has a tensorrt_llm call's interface (`responses()`, `cancel()`) for the handler; runs rounds of a draft
    call then a target call, each a plain non-streaming tensorrt_llm request."""

    def __init__(
        self,
        target,
        draft,
        inputs: Mapping[str, np.ndarray],
        settings: SpeculationSettings,
        streaming: bool,
        echo_prompt: bool,
        request_id: str,
    ):
        self.target, self.draft = target, draft
        self.base = {name: array for name, array in inputs.items() if name not in PER_CALL}
        # The target's verification follows the request's guide, continued past the tokens generated so far; the
        # draft runs unguided (the target rejects the drafts the grammar forbids).
        self.guide = {name: inputs[name] for name in GUIDE_INPUTS if name in inputs}
        if not _first_text(self.guide.get(GUIDE_INPUTS[0])):  # no guide type: not guided
            self.guide = {}
        self.prompt = [int(t) for t in inputs["input_ids"][0][: int(inputs["input_lengths"].reshape(-1)[0])]]
        self.max_tokens = int(inputs["request_output_len"].reshape(-1)[0])
        self.end_id = int(inputs["end_id"].reshape(-1)[0]) if "end_id" in inputs else -1
        self.settings, self.streaming, self.echo_prompt = settings, streaming, echo_prompt
        self.request_id = request_id
        self.lock = threading.Lock()
        self.current: Optional[LlmCall] = None  # the inner call in flight
        self.cancelled = False
        self.rounds = self.drafted = self.accepted = 0

    def responses(self) -> Iterator[LlmResponse]:
        generated: list[int] = []
        finished = False
        while not finished:
            new, finished = self._round(generated)
            before = len(generated)
            generated += new
            if self.streaming and (new or finished):
                yield self._response(generated[before:], self.prompt + generated[:before], finished)
        if not self.streaming:
            tokens = (self.prompt if self.echo_prompt else []) + generated
            yield self._response(tokens, [], True)

    def _round(self, generated: list[int]) -> tuple[list[int], bool]:
        """One draft + verify round: the new tokens, and whether the sequence is done."""
        context = self.prompt + generated
        budget = self.max_tokens - len(generated)
        num_draft = min(self.settings.num_draft_tokens, budget - 1)
        draft_tokens, draft_logits = self._propose(context, num_draft) if num_draft > 0 else ([], None)
        new = self._verify(context, draft_tokens, draft_logits, len(generated))
        self.rounds += 1
        self.drafted += len(draft_tokens)
        self.accepted += _common_prefix(draft_tokens, new)
        if self.end_id >= 0 and self.end_id in new:
            return new[: new.index(self.end_id)], True
        new = new[:budget]
        return new, not new or len(generated) + len(new) >= self.max_tokens

    def _propose(self, context: list[int], count: int) -> tuple[list[int], Optional[np.ndarray]]:
        inputs = self._call_inputs(
            context, count, min_tokens=count, return_generation_logits=self.settings.use_draft_logits
        )
        outputs = self._run(self.draft, inputs)
        tokens = _tokens(outputs)
        logits = None
        if self.settings.use_draft_logits and "generation_logits" in outputs:
            logits = outputs["generation_logits"][0, 0, : len(tokens)].astype(np.float32)
        return tokens, logits

    def _verify(
        self, context: list[int], draft: list[int], draft_logits: Optional[np.ndarray], generated: int
    ) -> list[int]:
        inputs = self._call_inputs(context, len(draft) + 1)
        if self.guide:
            inputs.update(self.guide)
            inputs[GUIDE_PREFIX_INPUT] = np.array([[generated]], dtype=np.int32)
        if draft:
            inputs["draft_input_ids"] = np.array([draft], dtype=np.int32)
            if draft_logits is not None:
                inputs["draft_logits"] = draft_logits[None]
        return _tokens(self._run(self.target, inputs))

    def _call_inputs(self, context: list[int], max_tokens: int, **extra) -> dict[str, np.ndarray]:
        inputs = dict(self.base)
        inputs.update(
            {
                "input_ids": np.array([context], dtype=np.int32),
                "input_lengths": np.array([[len(context)]], dtype=np.int32),
                "request_output_len": np.array([[max_tokens]], dtype=np.int32),
                "end_id": np.array([[-1]], dtype=np.int32),
                "streaming": np.array([[False]]),
                "exclude_input_in_output": np.array([[True]]),
            }
        )
        for name, value in extra.items():
            inputs[name] = np.array(
                [[value]], dtype=np.int32 if isinstance(value, int) and not isinstance(value, bool) else bool
            )
        return inputs

    def _run(self, transport, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            if self.cancelled:
                raise LlmCancelled()
            current = self.current = transport.start(inputs, f"{self.request_id}-{self.rounds}")
        outputs: dict[str, np.ndarray] = {}
        for response in current.responses():
            if "output_ids" in response.outputs:
                outputs = response.outputs
        return outputs

    def _response(self, tokens: list[int], before: list[int], final: bool) -> LlmResponse:
        prefix = before[-DETOKENIZE_PREFIX_TOKENS:] if self.streaming else []
        outputs = {
            "output_ids": np.array(tokens, dtype=np.int32).reshape(1, 1, len(tokens)),
            "sequence_length": np.array([[len(tokens)]], dtype=np.int32),
            "detok_prefix_ids": np.array(prefix, dtype=np.int32).reshape(1, 1, len(prefix)),
            "detok_is_final": np.array([[final]]),
            "total_draft_tokens": np.array([[self.drafted]], dtype=np.int32),
            "total_accepted_draft_tokens": np.array([[self.accepted]], dtype=np.int32),
            "acceptance_rate": np.array([[self.accepted / self.drafted if self.drafted else 0.0]], np.float32),
        }
        return LlmResponse(outputs, final=final)

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            current = self.current
        if current is not None:
            current.cancel()


def _first_text(array: Optional[np.ndarray]) -> str:
    if array is None or array.size == 0:
        return ""
    value = array.reshape(-1)[0]
    return (value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)).strip()


def _tokens(outputs: Mapping[str, np.ndarray]) -> list[int]:
    if "output_ids" not in outputs:
        return []
    length = int(outputs["sequence_length"].reshape(-1)[0])
    return [int(t) for t in outputs["output_ids"][0, 0, :length]]


def _common_prefix(draft: list[int], answer: list[int]) -> int:
    """Draft tokens the target accepted: the answer repeats them, then adds its own token."""
    count = 0
    for proposed, verified in zip(draft, answer):
        if proposed != verified:
            break
        count += 1
    return count
