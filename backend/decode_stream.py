"""Incremental detokenization of one growing sequence, for the models that keep state per sequence.

`tokenizers`' DecodeStream decodes each new token against the few before it, so a step costs the same at token
10 and at token 10,000, where re-decoding a window (`tokenizer.detokenize_delta`, which a stateless
postprocessing model needs) costs several decodes per step. Its deltas never split a multi-byte character:
the bytes of an unfinished one wait for the token that completes it.

Two cases fall back to the stateless window: a tokenizer without a fast (Rust) backend, and DecodeStream
refusing a sequence (a byte-fallback decoder meeting a run of invalid bytes, which random-weight models emit).
At the end of the sequence whatever is still held back (an unfinished character) is flushed, so the deltas of a
stream concatenate to the whole decode."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from tokenizers.decoders import DecodeStream

from .tokenizer import decode_ids, detokenize_delta, emitted_text, prefix_window


class StreamDecoder:
    """Text deltas of one sequence: `add(new_ids, is_final)` returns the text those tokens add."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        hf = getattr(tokenizer, "hf", tokenizer)  # a LoadedTokenizer or a Hugging Face tokenizer
        self._backend = getattr(hf, "backend_tokenizer", None)
        self._stream: Optional[DecodeStream] = (
            DecodeStream(skip_special_tokens=skip_special_tokens) if self._backend is not None else None
        )
        self.ids: list[int] = []
        self.text = ""  # every delta returned so far

    def add(self, new_ids: Sequence[int], is_final: bool) -> str:
        new = [int(i) for i in new_ids]
        self.ids += new
        if self._stream is None:  # the stateless rule flushes at the end by itself
            delta = detokenize_delta(
                self.tokenizer, prefix_window(self.ids, len(new)), new, is_final, self.skip_special_tokens
            )
        else:
            delta = self._stream_delta(new)
            if is_final:
                delta += self._held_back(self.text + delta)
        self.text += delta
        return delta

    def _stream_delta(self, new: list[int]) -> str:
        assert self._stream is not None and self._backend is not None
        pieces = []
        try:
            for token in new:
                piece = self._stream.step(self._backend, token)
                if piece:
                    pieces.append(piece)
        except Exception:  # tokenizers raises a bare Exception ("Invalid prefix encountered ...")
            # Refused: catch up with the stateless rule's "emitted so far", and use that rule from here on.
            self._stream = None
            emitted = emitted_text(self.tokenizer, self.ids, self.skip_special_tokens)
            return emitted[len(self.text) :] if emitted.startswith(self.text) else ""
        return "".join(pieces)

    def _held_back(self, sent: str) -> str:
        """At the end: the text the stream still holds (an unfinished character decodes to U+FFFD)."""
        whole = decode_ids(self.tokenizer, self.ids, self.skip_special_tokens)
        return whole[len(sent) :] if whole.startswith(sent) else ""
