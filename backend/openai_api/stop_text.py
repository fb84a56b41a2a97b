"""Stop strings on streamed text, with OpenAI's semantics: the text ends where the first stop string begins and
the stop string itself is never sent.

The backend may also cut at a stop string (tensorrt_llm_bls does, keeping the stop string), and may cut later
or not at all (the ensemble matches token ids only); this trimmer gives the same text either way. While a stream
runs it holds back any tail that could be the beginning of a stop string, so nothing it has sent is ever
taken back."""
from __future__ import annotations

from typing import Optional, Sequence


class StopTrimmer:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stop for stop in stops if stop)
        self.text = ""
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Take the next piece; returns the text that is safe to send now."""
        if self.stopped:
            return ""
        search_from = max(self.sent - self._longest() + 1, 0)
        self.text += piece
        start = self._first_stop(search_from)
        if start is not None:
            self.text = self.text[:start]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The stream ended without a stop string: whatever was held back."""
        return "" if self.stopped else self._release(len(self.text))

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def _longest(self) -> int:
        return max((len(stop) for stop in self.stops), default=0)

    def _first_stop(self, search_from: int) -> Optional[int]:
        starts = [position for position in (self.text.find(stop, search_from) for stop in self.stops)
                  if position >= 0]
        return min(starts, default=None)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that a stop string starts with."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
