"""Parse a model's config.pbtxt as Triton does (protobuf text format into Triton's `ModelConfig`), so that a file
Triton would refuse is reported before any server starts: the file, the line, and the parameter to set.

Triton parses with the C++ protobuf text parser; `tritonclient` ships the same `ModelConfig` message for Python's,
which accepts and refuses the same field values. Without `tritonclient` (the `server` extra) nothing is parsed and
`config_errors` returns no finding: the callers keep their own placeholder scan.
"""

from __future__ import annotations

import re
from string import Template
from typing import Any, Optional

_LOCATION = re.compile(r"^\d+:\d+ : ")


def model_config_message() -> Optional[Any]:
    """A fresh Triton `ModelConfig`, or None when tritonclient is not installed."""
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        return None
    return model_config_pb2.ModelConfig()


def parse_model_config(text: str) -> Any:
    """The parsed `ModelConfig`; raises google.protobuf.text_format.ParseError as Triton's parser would refuse."""
    from google.protobuf import text_format

    message = model_config_message()
    if message is None:
        raise ImportError("tritonclient is not installed: pip install 'tritonclient[grpc]'")
    return text_format.Parse(text, message)


def config_errors(text: str, label: str, template: Optional[str] = None) -> list[str]:
    """One line naming `label`, the line and what to set if Triton cannot parse `text`; empty if it can (or if
    tritonclient is missing). `template` is the text before filling: with it, a bad value is traced back to
    the placeholder it replaced."""
    if model_config_message() is None:
        return []
    from google.protobuf import text_format

    try:
        parse_model_config(text)
    except text_format.ParseError as exc:
        return [describe(exc, text, label, template)]
    return []


def describe(exc: Exception, text: str, label: str, template: Optional[str]) -> str:
    line_no = exc.GetLine() if hasattr(exc, "GetLine") else None
    column = exc.GetColumn() if hasattr(exc, "GetColumn") else None
    lines = text.splitlines()
    if not line_no or line_no > len(lines):
        return f"{label}: Triton cannot parse it: {exc}"
    line = lines[line_no - 1]
    reason = _reason(str(exc), line)
    name = _placeholder_at(line, column)
    if name:
        return (
            f"{label}:{line_no}: ${{{name}}} is unfilled ({reason} in {line.strip()!r}): set {name}, "
            f"e.g. tritonllm repo fill {label} {name}:VALUE"
        )
    culprit = _filled_placeholder_at(template, line_no, lines, column)
    if culprit:
        value_line, name, value = culprit
        return (
            f"{label}:{value_line}: {name} was filled with {value!r}, which Triton cannot parse in "
            f"{lines[value_line - 1].strip()!r} ({reason}): set {name} to a valid value"
        )
    return f"{label}:{line_no}: Triton cannot parse {line.strip()!r}: {reason}"


def _reason(message: str, line: str) -> str:
    """The parser's own words, without its location and the quoted line that `describe` shows already."""
    reason = _LOCATION.sub("", message, count=1)
    for quoted in (f"'{line}': ", f"'{line.strip()}': "):
        if reason.startswith(quoted):
            reason = reason[len(quoted) :]
            break
    return reason.rstrip(".")


def _placeholder_at(line: str, column: Optional[int]) -> Optional[str]:
    """The `${name}` that starts at the parser's (1-based) column, else the line's first one."""
    found = list(re.finditer(r"\$\{(\w+)\}", line))
    for match in found:
        if column is not None and match.start() == column - 1:
            return match.group(1)
    return found[0].group(1) if found else None


def _filled_placeholder_at(
    template: Optional[str], line_no: int, lines: list[str], column: Optional[int]
) -> Optional[tuple[int, str, str]]:
    """(line number, placeholder, value) of the filled value the parser stopped at. An empty value makes the
    parser stop at the next token, often on the next line: then the previous line's empty value is named."""
    if template is None or column is None:
        return None
    sources = template.splitlines()
    if len(sources) != len(lines):
        return None
    for start, end, name in value_spans(sources[line_no - 1], lines[line_no - 1]):
        if start <= column - 1 <= end:
            return line_no, name, lines[line_no - 1][start:end]
    for earlier in range(line_no - 2, -1, -1):
        if lines[earlier].split("#", 1)[0].strip():
            spans = value_spans(sources[earlier], lines[earlier])
            if spans and spans[-1][0] == spans[-1][1]:
                return earlier + 1, spans[-1][2], ""
            break
    return None


def value_spans(source: str, filled: str) -> list[tuple[int, int, str]]:
    """(start, end, name) of each placeholder's value in `filled`, the line `source` became; empty when the two do
    not line up (a value holding the text that follows it, or two placeholders side by side)."""
    matches = [m for m in Template.pattern.finditer(source) if m.group("braced") or m.group("named")]
    spans: list[tuple[int, int, str]] = []
    position = cursor = 0  # in source, in filled
    for index, match in enumerate(matches):
        literal = source[position : match.start()]
        if filled[cursor : cursor + len(literal)] != literal:
            return []
        cursor += len(literal)
        following = source[match.end() : matches[index + 1].start() if index + 1 < len(matches) else len(source)]
        if not following and index + 1 < len(matches):
            return []
        end = filled.find(following, cursor) if following else len(filled)
        if end < 0:
            return []
        spans.append((cursor, end, match.group("braced") or match.group("named")))
        cursor, position = end, match.end()
    return spans if filled[cursor:] == source[position:] else []
