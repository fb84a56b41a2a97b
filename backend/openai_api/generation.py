"""Runs a checked `GenerationRequest` on the backend model and turns its responses into per-choice events.

Every request goes to Triton as a stream (also when the OpenAI client did not ask for one): that is how a
client that goes away cancels its request, and each streamed response carries the log-probabilities of exactly
the tokens it adds, which is how completion tokens are counted (the backend is always asked for
`return_log_probs`; the ensemble and tensorrt_llm_bls return text, not token ids). Prompt tokens are counted
with the model's tokenizer, as the preprocessing step counts them.

`n` samples go as one request with `num_return_sequences` (the engine seeds sequence i with seed + i, so the
samples are independent and reproducible); several prompts go as one request each, run concurrently."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import AsyncGenerator, Optional

import numpy as np

from .errors import OpenAIError, PromptTooLong
from .schemas import GenerationRequest
from .stop_text import StopTrimmer
from .triton_client import StreamResponse, TritonClient

OUTPUTS = ("text_output", "output_log_probs", "sequence_index")


@dataclass
class ChoiceEvent:
    """New text of one choice; `finish_reason` set on its last event."""

    index: int
    text: str
    logprobs: list[tuple[str, float]] = field(default_factory=list)  # (token text, log-probability)
    finish_reason: Optional[str] = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


class Choice:
    """One generated sequence: its stop strings, token count and finish reason."""

    def __init__(self, index: int, stops: tuple[str, ...], max_tokens: int):
        self.index = index
        self.trimmer = StopTrimmer(stops)
        self.max_tokens = max_tokens
        self.tokens = 0
        self.finish_reason: Optional[str] = None

    def add(self, text: str, logprobs: np.ndarray) -> ChoiceEvent:
        self.tokens += int(logprobs.size)
        tokens = [(text if i == 0 else "", float(value)) for i, value in enumerate(logprobs.reshape(-1))]
        event = ChoiceEvent(self.index, self.trimmer.feed(text), tokens)
        if self.trimmer.stopped:
            event.finish_reason = self.finish_reason = "stop"
        return event

    def end(self) -> ChoiceEvent:
        """The backend finished the sequence: at its token limit, or at an end token or stop word."""
        self.finish_reason = "length" if self.tokens >= self.max_tokens else "stop"
        return ChoiceEvent(self.index, self.trimmer.flush(), finish_reason=self.finish_reason)


@dataclass
class PreparedPrompt:
    text: str
    prompt_tokens: int
    max_tokens: int


class Generation:
    """One OpenAI request in flight. Iterate `events()` once; `usage` is complete when it ends."""

    def __init__(
        self,
        client: TritonClient,
        backend_model: str,
        request: GenerationRequest,
        prompts: list[PreparedPrompt],
        extra_inputs: Optional[dict[str, np.ndarray]] = None,
    ):
        self.client = client
        self.extra_inputs = extra_inputs or {}  # the LoRA adapter's lora_name, for one
        self.backend_model = backend_model
        self.request = request
        self.prompts = prompts
        self.choices = [
            [Choice(p * request.n + s, request.stop, prompt.max_tokens) for s in range(request.n)]
            for p, prompt in enumerate(prompts)
        ]
        self.usage = Usage(prompt_tokens=sum(prompt.prompt_tokens for prompt in prompts))

    @property
    def completion_tokens(self) -> int:
        return sum(choice.tokens for row in self.choices for choice in row)

    async def events(self) -> AsyncGenerator[ChoiceEvent, None]:
        streams = [self._prompt_events(p) for p in range(len(self.prompts))]
        async with contextlib.aclosing(merge(streams)) as events:
            async for event in events:
                yield event
        self.usage.completion_tokens = self.completion_tokens

    async def _prompt_events(self, p: int) -> AsyncGenerator[ChoiceEvent, None]:
        choices = self.choices[p]
        inputs = {**backend_inputs(self.prompts[p], self.request), **self.extra_inputs}
        stream = self.client.stream(self.backend_model, inputs, OUTPUTS)
        try:
            async with contextlib.aclosing(stream) as responses:
                async for response in responses:
                    for event in self._response_events(choices, response):
                        yield event
                    if all(choice.finish_reason for choice in choices):
                        return  # every choice hit a stop string: leaving cancels the backend request
        except OpenAIError as error:
            raise blame_the_guide(error, self.request) from None
        for choice in choices:
            if choice.finish_reason is None:
                yield choice.end()

    @staticmethod
    def _response_events(choices: list[Choice], response: StreamResponse) -> list[ChoiceEvent]:
        outputs = response.outputs
        if "text_output" not in outputs:
            return []  # the final flag alone
        texts = outputs["text_output"].reshape(-1)
        logprobs = outputs.get("output_log_probs")
        indices = outputs.get("sequence_index")
        events = []
        for row, raw in enumerate(texts):
            choice = choices[int(indices.reshape(-1)[row]) if indices is not None else 0]
            if choice.finish_reason:
                continue
            text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else str(raw)
            row_logprobs = logprobs[row] if logprobs is not None else np.zeros(0, np.float32)
            events.append(choice.add(text, row_logprobs))
        return events


def backend_inputs(prompt: PreparedPrompt, request: GenerationRequest) -> dict[str, np.ndarray]:
    """The ensemble / tensorrt_llm_bls inputs for one prompt (one batch row; dims [1] inputs as [1, 1])."""
    sampling = request.sampling
    inputs = {
        "text_input": np.array([[prompt.text.encode("utf-8")]], dtype=object),
        "max_tokens": _scalar(prompt.max_tokens, np.int32),
        "stream": _scalar(True, np.bool_),
        "exclude_input_in_output": _scalar(True, np.bool_),
        "return_log_probs": _scalar(True, np.bool_),
        "temperature": _scalar(sampling.temperature, np.float32),
    }
    optional = {
        "top_p": (sampling.top_p, np.float32),
        "top_k": (sampling.top_k, np.int32),
        "seed": (sampling.seed, np.uint64),
        "presence_penalty": (sampling.presence_penalty, np.float32),
        "frequency_penalty": (sampling.frequency_penalty, np.float32),
        "min_tokens": (sampling.min_tokens, np.int32),
    }
    for name, (value, dtype) in optional.items():
        if value is not None:
            inputs[name] = _scalar(value, dtype)
    if request.n > 1:
        inputs["num_return_sequences"] = _scalar(request.n, np.int32)
    stop_words = list(request.stop) + list(request.end_of_turn)
    if stop_words:
        inputs["stop_words"] = np.array([[word.encode("utf-8") for word in stop_words]], dtype=object)
    if request.guide is not None:
        inputs["guided_decoding_guide_type"] = _text(request.guide.guide_type)
        if request.guide.guide:  # `json` (any object) needs no guide
            inputs["guided_decoding_guide"] = _text(request.guide.guide)
    return inputs


def _text(value: str) -> np.ndarray:
    return np.array([[value.encode("utf-8")]], dtype=object)


def blame_the_guide(error: OpenAIError, request: GenerationRequest) -> OpenAIError:
    """A backend error about the guided-decoding inputs names the request field the guide came from (the schema
    of response_format, or the tools), which is what the client sent."""
    if request.guide is not None and error.param is None and "guided_decoding" in error.message:
        error.param = request.guide.param
    return error


def _scalar(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def prepare_prompt(
    text: str, prompt_tokens: int, max_tokens: Optional[int], context_length: int, prompt_param: str, default: int
) -> PreparedPrompt:
    """The prompt with its token budget; PromptTooLong when it does not fit the model's context. Without
    max_tokens the budget is `default`, lowered to what the context leaves (as vLLM does, never an error)."""
    if prompt_tokens >= context_length:
        raise PromptTooLong(
            f"the prompt has {prompt_tokens} tokens, but this model's context holds "
            f"{context_length} (prompt and completion together)",
            param=prompt_param,
        )
    if max_tokens is None:
        return PreparedPrompt(text, prompt_tokens, min(default, context_length - prompt_tokens))
    if prompt_tokens + max_tokens > context_length:
        raise PromptTooLong(
            f"the prompt has {prompt_tokens} tokens and {max_tokens} more were asked for, but "
            f"this model's context holds {context_length}: shorten the prompt or lower "
            f"max_tokens",
            param="max_tokens",
        )
    return PreparedPrompt(text, prompt_tokens, max_tokens)


async def merge(streams: list[AsyncGenerator]) -> AsyncGenerator:
    """The items of several async iterators as they come; leaving early cancels (and so closes) them all."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async with contextlib.aclosing(stream) as items:
                async for item in items:
                    await queue.put((item, None))
        except Exception as error:  # handed to the consumer
            await queue.put((None, error))
        finally:
            await queue.put((done, None))

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item, error = await queue.get()
            if error is not None:
                raise error
            if item is done:
                remaining -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
