"""Stop strings on streamed text, with OpenAI's semantics: the text ends where the first stop string begins and
the stop string itself is never sent.

The backend may also cut at a stop string (tensorrt_llm_bls does, keeping the stop string), and may cut later
or not at all (the ensemble matches token ids only); this trimmer gives the same text either way. While a stream
runs it holds back any tail that could be the beginning of a stop string, so nothing it has sent is ever
taken back."""

from __future__ import annotations

from typing import Sequence

from ..stop_strings import StopStrings


class StopTrimmer:
    def __init__(self, stops: Sequence[str]):
        self.stops = StopStrings(stops)
        self.text = ""
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Take the next piece; returns the text that is safe to send now."""
        if self.stopped:
            return ""
        search_from = self.stops.search_start(self.sent)
        self.text += piece
        hit = self.stops.first_start(self.text, search_from)
        if hit is not None:
            self.text = self.text[: hit[0]]
            self.stopped = True
            return self._release(len(self.text))
        return self._release(len(self.text) - self.stops.held_back(self.text))

    def flush(self) -> str:
        """The stream ended without a stop string: whatever was held back."""
        return "" if self.stopped else self._release(len(self.text))

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out
