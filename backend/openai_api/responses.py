"""OpenAI's answer objects: whole chat / text completions and their streamed chunks.

Log-probabilities: the backend returns the log-probability of each chosen token but neither its id nor the
alternatives, so each entry's `token` is the text that token added to the stream (one token per streamed step;
a step that adds several tokens puts its text on the first) and `top_logprobs` is empty."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from .generation import ChoiceEvent, Usage


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
    def __init__(self, chat: bool, model: str, logprobs: bool):
        self.chat = chat
        self.model = model
        self.logprobs = logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.role_sent: set[int] = set()

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
            items = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c.logprobs),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ]
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

    # -- streamed chunks -------------------------------------------------------------------------------------

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
