"""Stop strings matched on text, so that they stop a sequence however the tokenizer splits them (pain point P4).
One matcher for every text-level stop rule: the BLS (which keeps the stop string and cuts after it), the LLM-API
model and the OpenAI front (which cut before it and, while a stream runs, hold back a tail that could still
become one)."""

from __future__ import annotations

from typing import Optional, Sequence


class StopStrings:
    def __init__(self, words: Sequence[str]):
        self.words = tuple(word for word in words if word)
        self.longest = max((len(word) for word in self.words), default=0)

    def __bool__(self) -> bool:
        return bool(self.words)

    def search_start(self, known_length: int) -> int:
        """Where to search again once text was appended after `known_length` characters that held no stop
        string: one may begin up to its length minus one characters before the new text."""
        return max(known_length - self.longest + 1, 0)

    def first_end(self, text: str, start: int = 0) -> Optional[int]:
        """Where the earliest-ending stop string in `text[start:]` ends, or None. "Earliest-ending" is where a
        stream first sees a complete stop string, so streamed and whole-text matching cut at the same place."""
        ends = [position + len(word) for word, position in self._hits(text, start)]
        return min(ends, default=None)

    def first_start(self, text: str, start: int = 0) -> Optional[tuple[int, str]]:
        """Where the earliest-starting stop string in `text[start:]` begins, and which it is (of two starting
        at the same place, the one that sorts first), or None."""
        return min(((position, word) for word, position in self._hits(text, start)), default=None)

    def held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string: what a stream must
        not send yet, so that nothing sent is ever taken back."""
        longest = 0
        for word in self.words:
            for length in range(min(len(word) - 1, len(text)), longest, -1):
                if text.endswith(word[:length]):
                    longest = length
                    break
        return longest

    def _hits(self, text: str, start: int):
        for word in self.words:
            position = text.find(word, start)
            if position >= 0:
                yield word, position
