"""OpenAI's answer objects: whole chat / text completions and their streamed chunks.

Log-probabilities: the backend returns the log-probability of each chosen token but neither its id nor the
alternatives, so each entry's `token` is the text that token added to the stream (one token per streamed step;
a step that adds several tokens puts its text on the first) and `top_logprobs` is empty.

Tool calls: with a tool plan, each chat choice's text goes through its `CallReader` (tool_calls.py); its deltas
become `tool_calls` as OpenAI shapes them (a call's first delta with index, id, type, name and empty arguments,
then pieces of its arguments), and a choice that made calls finishes with `tool_calls` instead of `stop`. A
streamed step whose text the reader holds back sends nothing; its log-probabilities go with the next chunk."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from .generation import ChoiceEvent, Usage
from .tool_calls import CallDelta, CallReader, MessageDelta, ToolCall, read_whole, reader_for
from .tools import ToolPlan


@dataclass
class ChoiceText:
    """A choice gathered for a whole (non-streamed) answer."""

    text: str = ""
    logprobs: list[tuple[str, float]] = field(default_factory=list)
    finish_reason: Optional[str] = None

    def add(self, event: ChoiceEvent) -> None:
        self.text += event.text
        self.logprobs += event.logprobs
        self.finish_reason = event.finish_reason or self.finish_reason


class AnswerBuilder:
    def __init__(self, chat: bool, model: str, logprobs: bool, tool_plan: Optional[ToolPlan] = None):
        self.chat = chat
        self.model = model
        self.logprobs = logprobs
        self.tool_plan = tool_plan if chat else None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.role_sent: set[int] = set()
        self.readers: dict[int, CallReader] = {}  # per streamed choice, with a tool plan
        self.held_logprobs: dict[int, list[tuple[str, float]]] = {}

    def _envelope(self, object_name: str, choices: list, usage: Optional[Usage], stream: bool) -> dict[str, Any]:
        answer = {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None or stream:
            answer["usage"] = usage.as_dict() if usage is not None else None
        return answer

    # -- whole answers ---------------------------------------------------------------------------------------

    def whole(self, choices: list[ChoiceText], usage: Usage) -> dict[str, Any]:
        if self.chat:
            items = [self._whole_chat_choice(i, c) for i, c in enumerate(choices)]
            return self._envelope("chat.completion", items, usage, stream=False)
        items = [
            {
                "index": i,
                "text": c.text,
                "logprobs": self._text_logprobs(c.logprobs, 0),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ]
        return self._envelope("text_completion", items, usage, stream=False)

    def _whole_chat_choice(self, index: int, choice: ChoiceText) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        reason = choice.finish_reason
        if self.tool_plan is not None:
            read = read_whole(reader_for(self.tool_plan), choice.text)
            message["content"] = read.content or (None if read.calls else "")
            if read.calls:
                message["tool_calls"] = [_call_json(call) for call in read.calls]
                reason = _tool_finish(reason)
        return {
            "index": index,
            "message": message,
            "logprobs": self._chat_logprobs(choice.logprobs),
            "finish_reason": reason,
        }

    # -- streamed chunks -------------------------------------------------------------------------------------

    def chunks(self, event: ChoiceEvent, text_offset: int = 0) -> list[dict[str, Any]]:
        """The chunks a choice event sends: none for a step that added no text (unless it carries
        log-probabilities or the finish); with a tool plan, the reader's deltas."""
        if self.tool_plan is not None:
            return self._tool_chunks(event)
        if event.text or event.finish_reason or self.logprobs:
            return [self.chunk(event, text_offset)]
        return []

    def chunk(self, event: ChoiceEvent, text_offset: int = 0) -> dict[str, Any]:
        """The chunk of one choice event; `text_offset`: characters of this choice sent before (completions)."""
        if self.chat:
            delta: dict[str, Any] = {}
            if event.index not in self.role_sent:
                self.role_sent.add(event.index)
                delta["role"] = "assistant"
            if event.text or not event.finish_reason:
                delta["content"] = event.text
            item = {
                "index": event.index,
                "delta": delta,
                "logprobs": self._chat_logprobs(event.logprobs),
                "finish_reason": event.finish_reason,
            }
            return self._envelope("chat.completion.chunk", [item], None, stream=True)
        item = {
            "index": event.index,
            "text": event.text,
            "logprobs": self._text_logprobs(event.logprobs, text_offset),
            "finish_reason": event.finish_reason,
        }
        return self._envelope("text_completion", [item], None, stream=True)

    def _tool_chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        assert self.tool_plan is not None
        reader = self.readers.setdefault(event.index, reader_for(self.tool_plan))
        deltas = reader.feed(event.text) + (reader.end() if event.finish_reason else [])
        self.held_logprobs.setdefault(event.index, []).extend(event.logprobs)
        steps: list[tuple[dict[str, Any], Optional[str]]] = [(_delta_json(delta), None) for delta in deltas]
        if event.finish_reason:  # the last chunk: an empty delta with the finish reason, as OpenAI ends a choice
            steps.append(({}, _tool_finish(event.finish_reason) if reader.made_calls else event.finish_reason))
        return [self._tool_chunk(event.index, delta, finish) for delta, finish in steps]

    def _tool_chunk(self, index: int, delta: dict[str, Any], finish_reason: Optional[str]) -> dict[str, Any]:
        if index not in self.role_sent:
            self.role_sent.add(index)
            delta = {"role": "assistant", **({"content": None} if "tool_calls" in delta else {}), **delta}
        logprobs, self.held_logprobs[index] = self.held_logprobs.get(index, []), []
        item = {
            "index": index,
            "delta": delta,
            "logprobs": self._chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }
        return self._envelope("chat.completion.chunk", [item], None, stream=True)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The extra last chunk `stream_options.include_usage` asks for: no choices, the usage."""
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage, stream=True)

    # -- log-probabilities -----------------------------------------------------------------------------------

    def _chat_logprobs(self, tokens: list[tuple[str, float]]) -> Optional[dict[str, Any]]:
        if not self.logprobs:
            return None
        return {
            "content": [
                {"token": token, "logprob": value, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
                for token, value in tokens
            ]
        }

    def _text_logprobs(self, tokens: list[tuple[str, float]], offset: int) -> Optional[dict[str, Any]]:
        if not self.logprobs:
            return None
        offsets, position = [], offset
        for token, _ in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": [token for token, _ in tokens],
            "token_logprobs": [value for _, value in tokens],
            "top_logprobs": None,
            "text_offset": offsets,
        }


# ---------------------------------------------------------------------------------------------- tool calls


def _tool_finish(reason: Optional[str]) -> Optional[str]:
    """A choice that made calls and ended on its own finishes with `tool_calls`; one cut short keeps `length`."""
    return "tool_calls" if reason == "stop" else reason


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _delta_json(delta: MessageDelta) -> dict[str, Any]:
    if delta.call is None:
        return {"content": delta.content}
    return {"tool_calls": [_call_delta_json(delta.call)]}


def _call_delta_json(call: CallDelta) -> dict[str, Any]:
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {
        "index": call.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
