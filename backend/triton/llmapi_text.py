"""The text of one generated sequence of the LLM-API model: decoded as its tokens arrive, cut at stop strings.

Streaming responses carry the cumulative text, as TensorRT-LLM's LLM API `output.text` is (each response holds
everything generated so far; a client shows the last one). Two rules keep every response a prefix of the final
text, so a client never sees text taken back:
  * a multi-byte character is sent only once it is complete (the StreamDecoder holds the partial bytes back);
  * text that could be the beginning of a stop string is held back until the next tokens tell.
A stop string ends the sequence and is left out of the text (the LLM API's include_stop_str_in_output=False).
Stop strings are matched on the text, so they stop generation however the tokenizer splits them in context
(token-level stop words miss those: pain point P4)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..decode_stream import StreamDecoder
from ..stop_strings import StopStrings


class SequenceText:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True):
        self.decoder = StreamDecoder(tokenizer, skip_special_tokens)
        self.stops = StopStrings(stop)
        self.decoded = ""  # complete characters of every token seen, stop strings included
        self.stop_at: Optional[int] = None  # where the first stop string starts in `decoded`
        self.stopped_by: Optional[str] = None
        self.tokens_seen = 0

    @property
    def stopped(self) -> bool:
        return self.stopped_by is not None

    def add(self, token_ids: Sequence[int], is_final: bool) -> None:
        """Take the sequence's tokens so far (cumulative); the ones not seen before are decoded and appended."""
        if self.stopped:
            return  # a stop string ended the text; later tokens are not part of it
        new_count = len(token_ids) - self.tokens_seen
        if new_count == 0 and not is_final:
            return
        searched_from = self.stops.search_start(len(self.decoded))
        self.decoded += self.decoder.add(token_ids[len(token_ids) - new_count :], is_final)
        self.tokens_seen = len(token_ids)
        hit = self.stops.first_start(self.decoded, searched_from)
        if hit is not None:
            self.stop_at, self.stopped_by = hit  # the earliest stop string wins

    def text(self, final: bool) -> str:
        """What a response may carry now: everything before a stop string, and, until the end, nothing that could
        still turn out to be the start of one."""
        if self.stopped:
            return self.decoded[: self.stop_at]
        if final:
            return self.decoded
        return self.decoded[: len(self.decoded) - self.stops.held_back(self.decoded)]
