"""Tool calls read from a choice's generated text, as it streams: each reader turns text pieces into message
deltas (content, or a call's first delta with its id and name, or more of a call's arguments). A whole answer is
the same deltas joined, so a streamed answer and a whole one always agree.

- `ArgumentsReader`: the output is one named function's arguments (guided by its parameters schema).
- `CallListReader`: the output is a guided JSON array of `{"name", "arguments"}` objects; each call's arguments are
  the exact text the model wrote for them, streamed as they come once the name is known.
- `TaggedCallsReader`: unguided text in which the chat template's format marks calls, `<tool_call>{"name": ...,
  "arguments": ...}</tool_call>` (Hermes, Qwen2.5, SmolLM3); text outside the tags is content, a block that does
  not parse stays content."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from .tools import ToolPlan

HERMES = "hermes"
CALL_FORMATS = {HERMES: ("<tool_call>", "</tool_call>")}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    index: int
    arguments: str
    id: Optional[str] = None  # id and name: on a call's first delta only
    name: Optional[str] = None


@dataclass
class MessageDelta:
    content: Optional[str] = None
    call: Optional[CallDelta] = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Message:
    """A choice's whole message: its content and its calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: MessageDelta) -> None:
        if delta.content:
            self.content += delta.content
        call = delta.call
        if call is None:
            return
        if call.id is not None:
            self.calls.append(ToolCall(call.id, call.name or ""))
        self.calls[call.index].arguments += call.arguments


class CallReader:
    """Text pieces in, message deltas out; `made_calls` once any call has begun."""

    made_calls = False

    def feed(self, text: str) -> list[MessageDelta]:
        raise NotImplementedError

    def end(self) -> list[MessageDelta]:
        return []


def reader_for(plan: ToolPlan) -> CallReader:
    if plan.mode == "named":
        return ArgumentsReader(plan.name or "")
    if plan.mode == "required":
        return CallListReader()
    return TaggedCallsReader(*CALL_FORMATS[plan.call_format or HERMES])


def read_whole(reader: CallReader, text: str) -> Message:
    message = Message()
    for delta in reader.feed(text) + reader.end():
        message.add(delta)
    return message


class ArgumentsReader(CallReader):
    """One call to `name`; the text is its arguments (leading whitespace dropped)."""

    def __init__(self, name: str):
        self.name = name
        self.started = False
        self.begun = False  # any arguments text sent

    def feed(self, text: str) -> list[MessageDelta]:
        deltas = []
        if not self.started:
            self.started = self.made_calls = True
            deltas.append(MessageDelta(call=CallDelta(0, "", new_call_id(), self.name)))
        if not self.begun:
            text = text.lstrip()
            self.begun = bool(text)
        if text:
            deltas.append(MessageDelta(call=CallDelta(0, text)))
        return deltas

    def end(self) -> list[MessageDelta]:
        return self.feed("") if not self.started else []


# The head of a call object up to its arguments' value; the guided grammar writes "name" before "arguments".
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}\s*([,\]])")


class CallListReader(CallReader):
    """A JSON array of calls. Each call's first delta goes once its name is read; its arguments follow as the text
    arrives, up to the end of their JSON value. Text that never became a call ends up as content."""

    def __init__(self) -> None:
        self.text = ""
        self.sent: list[int] = []  # per call: how far into self.text its arguments have been sent

    def feed(self, text: str) -> list[MessageDelta]:
        self.text += text
        deltas = []
        for index, (name, start, end) in enumerate(self._scan()):
            if index == len(self.sent):
                self.sent.append(start)
                self.made_calls = True
                deltas.append(MessageDelta(call=CallDelta(index, "", new_call_id(), json.loads(f'"{name}"'))))
            stop = len(self.text) if end is None else end
            if stop > self.sent[index]:
                deltas.append(MessageDelta(call=CallDelta(index, self.text[self.sent[index] : stop])))
                self.sent[index] = stop
        return deltas

    def end(self) -> list[MessageDelta]:
        return [] if self.made_calls or not self.text else [MessageDelta(content=self.text)]

    def _scan(self) -> list[tuple[str, int, Optional[int]]]:
        """(name, start of the arguments, their end or None while open) of each call begun in the text."""
        calls: list[tuple[str, int, Optional[int]]] = []
        opening = re.match(r"\s*\[", self.text)
        position = opening.end() if opening else None
        while position is not None:
            head = _CALL_HEAD.match(self.text, position)
            start = _skip_space(self.text, head.end()) if head is not None else len(self.text)
            if head is None or start == len(self.text):  # the arguments have not begun
                break
            end = json_value_end(self.text, start)
            calls.append((head.group(1), start, end))
            tail = _CALL_TAIL.match(self.text, end) if end is not None else None
            position = tail.end() if tail is not None and tail.group(1) == "," else None
        return calls


def json_value_end(text: str, start: int) -> Optional[int]:
    """Where the JSON value that begins at `start` ends (exclusive), or None if it has not ended yet."""
    position = _skip_space(text, start)
    if position >= len(text):
        return None
    first = text[position]
    if first == '"':
        return _string_end(text, position)
    if first in "{[":
        return _container_end(text, position)
    scalar = re.compile(r"[^\s,\]}]*").match(text, position)
    assert scalar is not None  # the pattern matches the empty string
    return scalar.end() if scalar.end() < len(text) else None  # a number may still go on


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    return position


def _string_end(text: str, quote: int) -> Optional[int]:
    position = quote + 1
    while position < len(text):
        if text[position] == "\\":
            position += 2
            continue
        if text[position] == '"':
            return position + 1
        position += 1
    return None


def _container_end(text: str, opening: int) -> Optional[int]:
    depth, position = 0, opening
    while position < len(text):
        char = text[position]
        if char == '"':
            string_end = _string_end(text, position)
            if string_end is None:
                return None
            position = string_end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
        position += 1
    return None


class TaggedCallsReader(CallReader):
    """Calls between `opening` and `closing` tags in free text. Content streams as it comes, but for a tail that may
    be the start of a tag, and for trailing whitespace, held until more content comes (whitespace before a call,
    or after the last one, only separates and is dropped)."""

    def __init__(self, opening: str, closing: str):
        self.opening, self.closing = opening, closing
        self.pending = ""  # text not yet read: inside a call, or a tail that may start a tag
        self.space = ""  # whitespace held back from the content sent
        self.in_call = False
        self.calls = 0

    def feed(self, text: str) -> list[MessageDelta]:
        self.pending += text
        deltas: list[MessageDelta] = []
        while True:
            tag = self.closing if self.in_call else self.opening
            found = self.pending.find(tag)
            if found < 0:
                break
            before, self.pending = self.pending[:found], self.pending[found + len(tag) :]
            deltas += self._call(before) if self.in_call else self._content(before)
            self.in_call = not self.in_call
        if not self.in_call:
            keep = len(self.pending) - _partial_tag_length(self.pending, self.opening)
            deltas += self._content(self.pending[:keep])
            self.pending = self.pending[keep:]
        return deltas

    def end(self) -> list[MessageDelta]:
        text = self.opening + self.pending if self.in_call else self.pending
        text = self.space + text
        self.pending = self.space = ""
        self.in_call = False
        if not text or (self.made_calls and not text.strip()):
            return []
        return [MessageDelta(content=text)]

    def _content(self, text: str) -> list[MessageDelta]:
        body = text.rstrip()
        deltas = [MessageDelta(content=self.space + body)] if body else []
        self.space = (self.space if not body else "") + text[len(body) :]
        return deltas

    def _call(self, block: str) -> list[MessageDelta]:
        parsed = _parse_call(block)
        space, self.space = self.space, ""  # whitespace before a call only separates it
        if parsed is None:
            return [MessageDelta(content=space + self.opening + block + self.closing)]
        name, arguments = parsed
        index, self.calls = self.calls, self.calls + 1
        self.made_calls = True
        return [
            MessageDelta(call=CallDelta(index, "", new_call_id(), name)),
            MessageDelta(call=CallDelta(index, arguments)),
        ]


def _parse_call(block: str) -> Optional[tuple[str, str]]:
    """(name, arguments as JSON text) of a `{"name": ..., "arguments": {...}}` block; None if it is not one."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper start of `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
