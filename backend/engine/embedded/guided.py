"""Guided decoding in the embedded engine (`guided_decoding_backend: xgrammar`).

One grammar compiler per engine, built from the model's tokenizer with the logits' width as its vocabulary (ids
past the tokenizer's are never allowed). Compiled grammars are cached per (guide type, guide): requests with the
same schema share one. Each guided sequence gets its own matcher when its request is added; before a sampling step
its row of the token bitmask is filled and the logits of the tokens the grammar forbids become -inf, and every
token the sequence takes advances its matcher. A matcher that accepted a stop token has terminated: the engine then
ends the sequence as at its end token. Speculative verification masks each draft row after committing the tokens
before it (speculator.py), so only grammar-valid tokens are ever committed and no matcher needs a rollback."""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..types import GuidedDecodingParams, InvalidRequestError

if TYPE_CHECKING:
    from .sequence import Sequence

log = logging.getLogger("tritonllm.engine")

# xgrammar's errors start with "[time] /path/file.cc:line: "; the rest is the message worth showing.
_NATIVE_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*")
# Whitespace xgrammar lets a JSON output put between two elements: enough to pretty-print a few levels deep, too few
# for a weak model to spend its whole budget on blanks (unbounded, it often does).
JSON_MAX_WHITESPACE = 20
# xgrammar 0.2.8 writes a length-bounded JSON string (minLength / maxLength) as a run of one class that lets raw
# control characters through (invalid JSON: a strict parser rejects them) and no escapes. Such schemas compile from
# their EBNF with that class replaced by JSON's own string character: a plain character or an escape.
_BOUNDED_STRING_CHAR = r"(([^\"\\\r\n]))"
_JSON_STRING_CHAR = r'(([^\0-\x1f\"\\]) | ("\\" basic_escape))'
# From this many guided rows on, their masks are filled on xgrammar's thread pool rather than one by one.
BATCH_FILL_ROWS = 4
_GUIDE_NAMES = {
    "json": "guided_decoding.json_object",
    "json_schema": "guided_decoding.json (JSON schema)",
    "regex": "guided_decoding.regex",
    "ebnf_grammar": "guided_decoding.grammar (EBNF)",
    "structural_tag": "guided_decoding.structural_tag",
}


class GuidedDecoder:
    """Compiler, grammar cache and the live sequences' matchers. `compile` may run on any thread (a request is
    checked on its caller's); the rest runs on the engine thread."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = 256):
        import xgrammar

        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # Our cache stands in for xgrammar's (bounded by entries, and shared by the guide types alike).
        threads = min(8, os.cpu_count() or 1)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # grown to the widest batch, then reused
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and logs
        self.matchers: dict[int, Any] = {}  # seq_id -> the sequence's GrammarMatcher

    # -- grammars -----------------------------------------------------------------------------------------------

    def compile(self, guide: GuidedDecodingParams) -> Any:
        """The compiled grammar of `guide` (cached); InvalidRequestError naming the guide if it does not compile."""
        key = guide.guide()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(*key)  # outside the lock: a long compile must not hold up the engine thread
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, guide_type: str, guide: str) -> Any:
        compiler = self._compiler
        try:
            if guide_type == "json":
                # Any JSON object (xgrammar's built-in JSON grammar also allows a top-level array).
                return compiler.compile_json_schema(
                    '{"type": "object"}', strict_mode=False, max_whitespace_cnt=JSON_MAX_WHITESPACE
                )
            if guide_type == "json_schema":
                return self._compile_json_schema(guide)
            if guide_type == "regex":
                return compiler.compile_regex(guide)
            if guide_type == "ebnf_grammar":
                return compiler.compile_grammar(guide)
            return compiler.compile_structural_tag(guide)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _NATIVE_PREFIX.sub("", str(exc)).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise InvalidRequestError(f"{_GUIDE_NAMES[guide_type]} does not compile: {message}") from None

    def _compile_json_schema(self, schema: str) -> Any:
        grammar = self._xgr.Grammar.from_json_schema(schema, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        text = str(grammar)
        if _BOUNDED_STRING_CHAR not in text or "basic_escape ::=" not in text:
            return self._compiler.compile_grammar(grammar)
        return self._compiler.compile_grammar(text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))

    # -- matchers -----------------------------------------------------------------------------------------------

    def start(self, seq: Sequence) -> None:
        """A matcher for a guided sequence, stopping at the request's end id (else the tokenizer's end tokens), past
        the prompt's last `guided_prefix_len` tokens (output of an earlier request it continues)."""
        guide = seq.params.guided_decoding
        assert guide is not None  # only guided sequences get a matcher
        end_id = seq.params.end_id
        stop = [end_id] if end_id is not None and 0 <= end_id < self.vocab_size else None
        matcher = self._xgr.GrammarMatcher(self.compile(guide), override_stop_tokens=stop)
        prefix = seq.params.guided_prefix_len
        for token in seq.prompt_token_ids[len(seq.prompt_token_ids) - prefix :] if prefix else ():
            if not matcher.accept_token(token):  # check_prefix passed it: this cannot happen
                log.error("the grammar of request %d rejected its prefix token %d", seq.request_id, token)
                break
        self.matchers[seq.seq_id] = matcher

    def check_prefix(self, guide: GuidedDecodingParams, tokens: list[int]) -> None:
        """InvalidRequestError unless `tokens` (an earlier output the request continues) follow the guide."""
        matcher = self._xgr.GrammarMatcher(self.compile(guide))
        for position, token in enumerate(tokens):
            if not matcher.accept_token(token):
                raise InvalidRequestError(
                    f"guided_prefix_len: token {token} at position {position} of the continued output does not "
                    "follow the guide (guided_decoding)"
                )

    def release(self, seq: Sequence) -> None:
        self.matchers.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """A beam's child continues from its parent's grammar state (with a matcher of its own)."""
        if parent.seq_id in self.matchers:
            self.matchers[child.seq_id] = self.matchers[parent.seq_id].fork()

    def ends_with(self, seq: Sequence, token: int) -> bool:
        """Whether `token` is one of the stop tokens that end a guided sequence's grammar (beams check a token
        before any matcher takes it; the mask allows a stop token only where the grammar may end)."""
        matcher = self.matchers.get(seq.seq_id)
        return matcher is not None and token in matcher.stop_token_ids

    def advance(self, seq: Sequence, token: int) -> Optional[bool]:
        """Feed the sequence's new token to its matcher: True when the grammar has ended with it (a stop token),
        False when it goes on, None when the grammar rejects the token (the mask was not applied to its row)."""
        matcher = self.matchers[seq.seq_id]
        if not matcher.accept_token(token):
            return None
        return bool(matcher.is_terminated())

    # -- the sampler's side -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def mask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set to -inf, in place, the logits the grammar forbids, in the rows of guided sequences (logits: [N, vocab],
        one row per sequence in `seqs`); other rows stay as they are."""
        rows = [row for row, seq in enumerate(seqs) if seq.seq_id in self.matchers]
        if not rows:
            return
        if self._bitmask.shape[0] < len(seqs):
            self._bitmask = self._xgr.allocate_token_bitmask(len(seqs), self.vocab_size)
        bitmask = self._bitmask[: len(seqs)]
        matchers = [self.matchers[seqs[row].seq_id] for row in rows]
        if len(rows) >= BATCH_FILL_ROWS:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        else:
            for row, matcher in zip(rows, matchers):
                matcher.fill_next_token_bitmask(bitmask, row)
        apply_bitmask(logits, bitmask, rows, self.vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Forbidden tokens (bit 0 in `bitmask`, a host int32 [N, ceil(vocab / 32)]) of `rows` to -inf in `logits`: with
    xgrammar's kernel on the host, elsewhere by unpacking the bits with torch (no kernel to build)."""
    if logits.device.type == "cpu":
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
    else:
        mask_with_torch(logits, bitmask, rows, vocab_size)


def mask_with_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """`apply_bitmask` on any device: the rows' packed words (32x smaller than the mask) go to the logits' device,
    are unpacked there and applied in place."""
    index = torch.tensor(rows, dtype=torch.long)
    words = bitmask.index_select(0, index).to(logits.device, non_blocking=True)
    index = index.to(logits.device, non_blocking=True)
    allowed = unpack_bitmask(words, vocab_size)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, words] int32 bitmask -> [R, vocab_size] bool (True: allowed); bit j of word w is token 32 * w + j."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def build_guided_decoder(backend: Optional[str], tokenizer_dir: str, vocab_size: int) -> Optional[GuidedDecoder]:
    """The engine's guided decoder for `guided_decoding_backend` (None: off), from the tokenizer in `tokenizer_dir`."""
    if backend is None:
        return None
    try:
        import xgrammar  # noqa: F401
    except ImportError as exc:
        raise InvalidRequestError(
            f"guided_decoding_backend={backend!r} needs the xgrammar package (pip install xgrammar): {exc}"
        ) from None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(
            f"guided_decoding_backend={backend!r} needs the model's tokenizer, which does not load from "
            f"{tokenizer_dir}: {exc}"
        ) from None
    decoder = GuidedDecoder(tokenizer, vocab_size)
    log.info("guided decoding with %s over a vocabulary of %d tokens", backend, vocab_size)
    return decoder
