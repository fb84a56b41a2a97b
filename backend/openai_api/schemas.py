"""OpenAI request bodies: pydantic models that check every field, and their conversion into the typed objects
the rest of the frontend uses (`Sampling`, `GenerationRequest`).

Unknown fields are ignored (clients send vendor extras); known fields this server cannot honour are refused
with a 422 naming them, never silently dropped. `top_k` and `min_tokens` are accepted as extensions (send them
with the `openai` client's `extra_body`), and so is `response_format` on text completions.

`response_format`, `tools` and `tool_choice` are kept as sent here and checked by `structured.py` and `tools.py`,
whose errors name the exact part (`response_format.json_schema.schema`, `tools.0.function.name`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import BadRequest, Unsupported
from .structured import Guide
from .tools import ToolPlan

MAX_N = 16
MAX_STOP_STRINGS = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        """OpenAI reads a field sent as null as a field not sent; so do we (the defaults then apply)."""
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationBody(_Body):
    """The fields chat and text completions share."""

    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # extensions
    top_k: Optional[int] = Field(None, ge=0)
    min_tokens: Optional[int] = Field(None, ge=0)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        words = [value] if isinstance(value, str) else (value or [])
        if len(words) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(word == "" for word in words):
            raise ValueError("a stop string must not be empty")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class TextPart(_Body):
    type: str
    text: Optional[str] = None


class CalledFunction(_Body):
    name: str = Field(min_length=1)
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class MessageToolCall(_Body):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None  # an assistant's calls
    tool_call_id: Optional[str] = None  # a tool message's answer to a call


class ChatCompletionBody(_GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    functions: Optional[list[Any]] = None
    function_call: Union[str, dict[str, Any], None] = None
    response_format: Optional[dict[str, Any]] = None


class CompletionBody(_GenerationBody):
    prompt: Union[str, list[Union[str, int, list[int]]]]
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1)
    suffix: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None  # an extension: structured outputs, as in chat


# ---------------------------------------------------------------------------------------------- typed results


@dataclass(frozen=True)
class Sampling:
    """What the backend model gets besides the prompt. `max_tokens` None: as many as the context allows."""

    max_tokens: Optional[int]
    temperature: float
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    min_tokens: Optional[int] = None


@dataclass(frozen=True)
class GenerationRequest:
    """One OpenAI request, checked: `n` samples of each prompt."""

    model: str
    prompts: tuple[str, ...]
    n: int
    sampling: Sampling
    stop: tuple[str, ...]  # matched on the text and left out of it, as OpenAI does
    end_of_turn: tuple[str, ...]  # special tokens that end generation (the chat template's end of turn)
    logprobs: bool
    stream: bool
    include_usage: bool
    guide: Optional[Guide] = None  # guided decoding (response_format, or tools required / named)
    tool_plan: Optional[ToolPlan] = None  # how tool calls are read from the text; None: plain content


def parse_body(model: type[_Body], body: Any) -> Any:
    """The request body as `model`, or BadRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if not _is_type_tag(part))
        raise BadRequest(f"{param or 'body'}: {first['msg']}", param=param or None) from None


def _is_type_tag(part: Any) -> bool:
    """pydantic puts the union member it tried into an error's location ("str", "list[str]", "TextPart"); the
    field path a client knows has only field names (snake_case) and list indices."""
    text = str(part)
    return isinstance(part, str) and (
        text in ("str", "int", "float", "bool") or "[" in text or "-" in text or text[:1].isupper()
    )


def sampling_of(body: _GenerationBody, max_tokens: Optional[int]) -> Sampling:
    if body.logit_bias:
        raise Unsupported("logit_bias is not supported yet", param="logit_bias")
    if body.min_tokens is not None and max_tokens is not None and body.min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens"
        )
    # OpenAI samples at temperature 1 when none is given (the backend's own default would be greedy).
    temperature = 1.0 if body.temperature is None else body.temperature
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        min_tokens=body.min_tokens,
    )


def stop_strings(body: _GenerationBody) -> tuple[str, ...]:
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())


def include_usage(body: _GenerationBody) -> bool:
    """Streams carry usage only when asked; a whole answer always does."""
    return not body.stream or bool(body.stream_options and body.stream_options.include_usage)


def completion_prompts(body: CompletionBody) -> tuple[str, ...]:
    if isinstance(body.prompt, str):
        return (body.prompt,)
    if not body.prompt:
        raise BadRequest("prompt must not be an empty list", param="prompt")
    prompts = tuple(item for item in body.prompt if isinstance(item, str))
    if len(prompts) != len(body.prompt):
        raise Unsupported("token-id prompts are not supported: send text", param="prompt")
    return prompts


def check_completion_fields(body: CompletionBody) -> None:
    if body.echo:
        raise Unsupported("echo is not supported", param="echo")
    if body.suffix:
        raise Unsupported("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise Unsupported("best_of other than n is not supported", param="best_of")
    if body.logprobs:
        raise Unsupported(
            "the backend returns the log-probability of each chosen token only: logprobs must be 0", param="logprobs"
        )


def check_chat_fields(body: ChatCompletionBody) -> None:
    if body.functions or body.function_call:
        raise Unsupported(
            "the deprecated functions / function_call are not supported: send tools and tool_choice",
            param="functions" if body.functions else "function_call",
        )
    if body.top_logprobs:
        raise Unsupported(
            "the backend returns the log-probability of each chosen token only: top_logprobs must be 0",
            param="top_logprobs",
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")


def chat_messages(body: ChatCompletionBody) -> list[dict[str, Any]]:
    """The messages as the chat template takes them; text parts are joined, other parts refused; an assistant's
    tool calls carry their arguments as a mapping (what Hugging Face chat templates expect)."""
    messages = []
    for index, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part_index, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise Unsupported(
                        f"content parts of type '{part.type}' are not supported (text only)",
                        param=f"messages.{index}.content.{part_index}",
                    )
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [
                _template_call(call, f"messages.{index}.tool_calls.{i}") for i, call in enumerate(message.tool_calls)
            ]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        messages.append(entry)
    return messages


def _template_call(call: MessageToolCall, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise BadRequest(
            f"{where}.function.arguments must be JSON text, got {call.function.arguments[:80]!r}",
            param=f"{where}.function.arguments",
        ) from None
    entry: dict[str, Any] = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id:
        entry["id"] = call.id
    return entry


def chat_max_tokens(body: ChatCompletionBody) -> Optional[int]:
    """max_completion_tokens is the current name; max_tokens the deprecated one. Both set must agree."""
    if (
        body.max_completion_tokens is not None
        and body.max_tokens is not None
        and body.max_completion_tokens != body.max_tokens
    ):
        raise BadRequest("max_tokens and max_completion_tokens differ: send one of them", param="max_completion_tokens")
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
