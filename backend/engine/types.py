"""Request and output types of the engine seam, shaped like TensorRT-LLM's LLM API.

`SamplingParams`, `CompletionOutput` and `RequestOutput` carry the field names of `tensorrt_llm.SamplingParams`,
`tensorrt_llm.executor.result.CompletionOutput` and `GenerationResult`, so that the Triton models speak one
vocabulary whichever engine runs behind them. The engine works on token ids only: text is the tokenizer's job.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    import torch

    from tritonllm.spec_decode.config import LookaheadConfig


class InvalidRequestError(ValueError):
    """A request the engine refuses: the message names the field, its value and the rule."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise InvalidRequestError(message)


# The guide types of TensorRT-LLM's executor and of the Triton input `guided_decoding_guide_type`.
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")
# The GuidedDecodingParams field that holds each type's guide (`json` needs none: json_object).
_GUIDE_FIELDS = {"json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar", "structural_tag": "structural_tag"}


@dataclass
class GuidedDecodingParams:
    """Constrains a request's output to a language (TensorRT-LLM's LLM-API `GuidedDecodingParams`); at most one
    field is set. `json`: a JSON schema (text or mapping); `json_object`: any JSON object; `regex`: a regular
    expression the whole output matches; `grammar`: an EBNF grammar (xgrammar's dialect, rule `root`);
    `structural_tag`: xgrammar's structural tag (JSON text or mapping)."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    grammar: Optional[str] = None
    json_object: bool = False
    structural_tag: Optional[Union[str, dict]] = None

    @classmethod
    def from_guide(cls, guide_type: str, guide: Optional[str]) -> "GuidedDecodingParams":
        """From the executor's pair (`guided_decoding_guide_type`, `guided_decoding_guide`); `json` needs no guide."""
        _require(
            guide_type in GUIDE_TYPES, f"guided_decoding_guide_type must be one of {GUIDE_TYPES}, got {guide_type!r}"
        )
        if guide_type == "json":
            return cls(json_object=True)
        _require(bool(guide), f"guided_decoding_guide_type={guide_type!r} needs a guided_decoding_guide")
        params = cls()
        setattr(params, _GUIDE_FIELDS[guide_type], guide)
        params.validate()
        return params

    def validate(self) -> None:
        set_fields = [
            name for name in ("json", "regex", "grammar", "json_object", "structural_tag") if _is_set(self, name)
        ]
        _require(
            len(set_fields) <= 1,
            f"guided_decoding: give at most one of json, json_object, regex, grammar, structural_tag; got {set_fields}",
        )
        _require(
            isinstance(self.json_object, bool), f"guided_decoding.json_object must be a bool, got {self.json_object!r}"
        )
        for name, kinds in (
            ("json", (str, dict)),
            ("regex", (str,)),
            ("grammar", (str,)),
            ("structural_tag", (str, dict)),
        ):
            value = getattr(self, name)
            _require(
                value is None or isinstance(value, kinds),
                f"guided_decoding.{name} must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}",
            )
        for name in ("json", "structural_tag"):
            _check_json(f"guided_decoding.{name}", getattr(self, name))

    @property
    def is_set(self) -> bool:
        return any(_is_set(self, name) for name in ("json", "regex", "grammar", "json_object", "structural_tag"))

    def guide(self) -> tuple[str, str]:
        """(guide type, guide text) as the executor names them: the cache key of a compiled grammar."""
        if self.json_object:
            return "json", ""
        if self.json is not None:
            return "json_schema", _as_text(self.json)
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "ebnf_grammar", self.grammar
        if self.structural_tag is not None:
            return "structural_tag", _as_text(self.structural_tag)
        raise InvalidRequestError("guided_decoding has no guide set")


def _is_set(params: GuidedDecodingParams, name: str) -> bool:
    value = getattr(params, name)
    return value is not False and value is not None


def _as_text(value: Union[str, dict]) -> str:
    # Keys keep their order: the grammar writes an object's properties in the schema's order.
    return value if isinstance(value, str) else json.dumps(value)


def _check_json(name: str, value: Any) -> None:
    """JSON text must parse, a mapping must serialize (what the grammar compiler reads)."""
    try:
        if isinstance(value, str):
            json.loads(value)
        elif value is not None:
            json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{name} is not valid JSON: {exc}") from None


@dataclass
class SamplingParams:
    """Per-request generation settings (TensorRT-LLM's names; `None` means the engine default)."""

    max_tokens: int = 32
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    n: int = 1
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    min_tokens: Optional[int] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    stop_token_ids: Optional[list[int]] = None
    # Multi-token sequences: generation stops after any of them appears (stop) / never produces them (bad).
    stop_words: Optional[list[list[int]]] = None
    bad_words: Optional[list[list[int]]] = None
    embedding_bias: Optional[list[float]] = None
    logprobs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    ignore_eos: bool = False
    beam_width: int = 1
    length_penalty: Optional[float] = None
    early_stopping: Optional[int] = None
    return_perf_metrics: bool = False
    # Scheduling priority in [0, 1] (TensorRT-LLM's Request.priority; None = 0.5): higher waits less.
    priority: Optional[float] = None
    # External draft tokens (TensorRT-LLM's ExternalDraftTokensConfig): guesses of the next output tokens, verified
    # by the target in one step; `draft_logits` [k, vocab] (the draft's logits) switch sampled requests to
    # rejection sampling, `draft_acceptance_threshold` to a fixed acceptance threshold on p(d) / q(d).
    draft_tokens: Optional[list[int]] = None
    draft_logits: Optional["torch.Tensor"] = None
    draft_acceptance_threshold: Optional[float] = None
    # Per-request lookahead window / n-gram / verification set (TensorRT-LLM's SamplingParams.lookahead_config);
    # each at most the engine's, which must run lookahead.
    lookahead_config: Optional[LookaheadConfig] = None
    # False: decode one token per step even when the engine speculates (the baseline `tritonllm bench spec`
    # measures in the same engine, so both sides share one thread pool; not a Triton input).
    speculate: bool = True
    # Guided decoding (TensorRT-LLM's SamplingParams.guided_decoding): the output follows a schema, regex or grammar.
    guided_decoding: Optional[GuidedDecodingParams] = None
    # Continues a guided output: the last `guided_prefix_len` prompt tokens were generated under `guided_decoding`
    # already (the BLS draft/target loop's later rounds), so the grammar starts after them. Not a TensorRT-LLM field.
    guided_prefix_len: int = 0

    @property
    def guided(self) -> bool:
        return self.guided_decoding is not None and self.guided_decoding.is_set

    @property
    def greedy(self) -> bool:
        """Greedy when temperature is 0 or top_k is 1, or when no sampling knob was set at all."""
        if self.temperature is not None and self.temperature == 0:
            return True
        if self.top_k == 1:
            return True
        return self.temperature is None and self.top_k in (None, 0) and self.top_p is None

    def validate(self, max_seq_len: Optional[int] = None) -> None:
        """Raise `InvalidRequestError` naming the first field that breaks its rule."""
        _require(
            isinstance(self.max_tokens, int) and self.max_tokens > 0,
            f"max_tokens must be an integer > 0, got {self.max_tokens!r}",
        )
        if max_seq_len is not None:
            _require(
                self.max_tokens < max_seq_len,
                f"max_tokens={self.max_tokens} must be less than max_seq_len={max_seq_len}",
            )
        _require(self.n >= 1, f"n (num_return_sequences) must be >= 1, got {self.n}")
        _require(
            isinstance(self.beam_width, int) and self.beam_width >= 1,
            f"beam_width must be an integer >= 1, got {self.beam_width!r}",
        )
        if self.beam_width > 1:
            _require(
                self.n <= self.beam_width,
                f"n (num_return_sequences) = {self.n} must not exceed "
                f"beam_width = {self.beam_width}: beam search returns at most beam_width beams",
            )
            _require(
                not self.return_generation_logits,
                "return_generation_logits is not supported with beam search (beam_width > 1)",
            )
        if self.priority is not None:
            _require(
                math.isfinite(self.priority) and 0 <= self.priority <= 1,
                f"priority must be in [0, 1], got {self.priority}",
            )
        if self.length_penalty is not None:
            _require(math.isfinite(self.length_penalty), f"length_penalty must be finite, got {self.length_penalty}")
        if self.temperature is not None:
            _require(
                math.isfinite(self.temperature) and self.temperature >= 0,
                f"temperature must be >= 0, got {self.temperature}",
            )
        if self.top_p is not None:
            _require(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            _require(self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repetition_penalty is not None:
            _require(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_tokens is not None:
            _require(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("stop_words", "bad_words"):
            words = getattr(self, name)
            if words:
                _require(all(len(w) > 0 for w in words), f"{name} must not contain empty sequences")
        self._validate_draft()
        self._validate_guided()

    def _validate_guided(self) -> None:
        _require(
            isinstance(self.guided_prefix_len, int) and self.guided_prefix_len >= 0,
            f"guided_prefix_len must be an integer >= 0, got {self.guided_prefix_len!r}",
        )
        _require(
            self.guided or not self.guided_prefix_len,
            "guided_prefix_len continues a guided output: it needs guided_decoding",
        )
        if self.guided_decoding is None:
            return
        _require(
            isinstance(self.guided_decoding, GuidedDecodingParams),
            f"guided_decoding must be a GuidedDecodingParams, got {type(self.guided_decoding).__name__}",
        )
        self.guided_decoding.validate()

    def _validate_draft(self) -> None:
        if not self.draft_tokens:
            _require(
                self.draft_logits is None and self.draft_acceptance_threshold is None,
                "draft_logits / draft_acceptance_threshold need draft_input_ids (draft_tokens)",
            )
            return
        _require(
            self.beam_width == 1,
            f"draft tokens (draft_input_ids) are not supported with beam search (beam_width={self.beam_width})",
        )
        num = len(self.draft_tokens)
        if self.draft_logits is not None:
            shape = tuple(self.draft_logits.shape)
            _require(
                len(shape) == 2 and shape[0] == num,
                f"draft_logits must be [{num}, vocab] for {num} draft tokens, got {list(shape)}",
            )
        if self.draft_acceptance_threshold is not None:
            _require(
                0 <= self.draft_acceptance_threshold <= 1,
                f"draft_acceptance_threshold must be in [0, 1], got {self.draft_acceptance_threshold}",
            )


def require_guided_backend(params: SamplingParams, backend: Optional[str]) -> None:
    """A guided request needs an engine started with a grammar library (`guided_decoding_backend`)."""
    _require(
        backend is not None or not params.guided,
        "this request is guided (guided_decoding) but the engine runs without guided decoding: set "
        "guided_decoding_backend: xgrammar in model.yaml, or the tensorrt_llm model's config.pbtxt parameter "
        "guided_decoding_backend to xgrammar",
    )


@dataclass
class RequestPerfMetrics:
    """Per-request timings (ns since the epoch) and KV-cache statistics, as `return_perf_metrics` reports them."""

    arrival_time_ns: int = 0
    first_scheduled_time_ns: int = 0
    first_token_time_ns: int = 0
    last_token_time_ns: int = 0
    kv_cache_alloc_new_blocks: int = 0
    kv_cache_reused_blocks: int = 0
    kv_cache_alloc_total_blocks: int = 0
    num_preemptions: int = 0
    prefill_steps: int = 0
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0


@dataclass
class CompletionOutput:
    """One generated sequence. `token_ids` is cumulative; `token_ids_diff` is what the last update added."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled"
    stop_reason: Optional[int | list[int]] = None
    request_perf_metrics: Optional[RequestPerfMetrics] = None
    # [tokens, vocab] float32 raw logits of each generated token (return_generation_logits)
    generation_logits: Optional["torch.Tensor"] = None
    _diff_start: int = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._diff_start :]

    @property
    def logprobs_diff(self) -> list[float]:
        return self.logprobs[self._diff_start :]

    @property
    def generation_logits_diff(self) -> Optional["torch.Tensor"]:
        return None if self.generation_logits is None else self.generation_logits[self._diff_start :]


@dataclass
class RequestOutput:
    """The state of one request after an update: one `CompletionOutput` per sample (`n`)."""

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    # [prompt tokens, vocab] float32 logits at every prompt position (return_context_logits)
    context_logits: Optional["torch.Tensor"] = None


@dataclass
class LoRARequest:
    """The adapter a request runs with, as TensorRT-LLM's LLM API names it (`lora_name`, `lora_int_id`,
    `lora_path`). The embedded engine also takes the adapter in memory: `lora_weights` / `lora_config` are
    TensorRT-LLM's per-request tensors (numpy arrays, see tritonllm.lora.trtllm_format). Only an id (or only a name
    of a preloaded adapter) means: the adapter cached under it."""

    lora_name: Optional[str] = None
    lora_int_id: Optional[int] = None
    lora_path: str = ""
    lora_weights: Optional[object] = None
    lora_config: Optional[object] = None

    @property
    def adapter_id(self) -> Optional[int]:
        return self.lora_int_id

    @property
    def name(self) -> Optional[str]:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
