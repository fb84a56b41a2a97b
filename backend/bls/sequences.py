"""The text of one generated sequence (one batch row and sequence index) as the BLS sends it.

Streaming: each tensorrt_llm response brings the text of its new tokens (postprocessing's delta); the BLS sends
that delta, or with `accumulate_tokens` everything so far. Whole (non-streaming): one response with the full
text. Either way the text ends right after the first stop word, and nothing of the sequence is sent after it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..stop_strings import StopStrings


@dataclass
class SequenceText:
    stop_words: list[str]
    accumulate: bool = False
    generation_start: int = 0  # where generated text begins in whole text (after an echoed prompt)
    text: str = ""  # everything of the sequence sent so far
    finished: bool = False
    stopped_by_word: bool = False
    stops: StopStrings = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stops = StopStrings(self.stop_words)

    def add_delta(self, delta: str, is_final: bool) -> str:
        """Take a streamed piece; returns what to send (the piece, or all text so far when accumulating).
        Pieces after the sequence finished are not part of it: "" then."""
        if self.finished:
            return ""
        before = len(self.text)
        self.text += delta
        end = self.stops.first_end(self.text, self.stops.search_start(before))
        self._finish_at(end, is_final)
        return self.text if self.accumulate else self.text[before:]

    def add_whole(self, text: str, is_final: bool) -> str:
        """Take the whole text of the sequence (a non-streaming response); returns what to send."""
        if self.finished:
            return ""
        self.text = text
        self._finish_at(self.stops.first_end(text, self.generation_start), is_final)
        return self.text

    def add_beams(self, texts: list[str], is_final: bool) -> list[str]:
        """Take the whole text of every beam (beam search rewrites earlier tokens, so beams always come whole);
        each is cut after its first stop word. The row is done with its final response."""
        if self.finished:
            return []
        cut = []
        for text in texts:
            end = self.stops.first_end(text, self.generation_start)
            cut.append(text if end is None else text[:end])
        self.finished = is_final
        return cut

    def _finish_at(self, stop_end, is_final: bool) -> None:
        if stop_end is not None:
            self.text = self.text[:stop_end]
            self.stopped_by_word = True
        self.finished = is_final or stop_end is not None
