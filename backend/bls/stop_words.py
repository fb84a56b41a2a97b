"""Stop words matched on text, so they stop generation however the tokenizer splits them (pain point P4)."""
from __future__ import annotations

from typing import Optional, Sequence


def first_stop_end(text: str, stop_words: Sequence[str], start: int = 0) -> Optional[int]:
    """Where the earliest-ending stop word that lies in `text[start:]` ends, or None.

    "Earliest-ending" is the point at which a stream would first see a complete stop word, so streamed and
    whole-text matching cut at the same place."""
    ends = []
    for word in stop_words:
        if word:
            position = text.find(word, start)
            if position >= 0:
                ends.append(position + len(word))
    return min(ends, default=None)


def search_start(known_length: int, stop_words: Sequence[str]) -> int:
    """Where to search again once text was appended after `known_length` characters that held no stop word:
    a stop word may begin up to its length minus one characters before the new text."""
    longest = max((len(word) for word in stop_words), default=0)
    return max(known_length - longest + 1, 0)
