"""Tokenization for the Triton models: prompts, word lists, embedding bias and incremental detokenization.

Everything here works on a `LoadedTokenizer`: a Hugging Face tokenizer plus the few numbers the models need on
every request (vocabulary size, end and pad ids), computed once at load. Computing `len(tokenizer.vocab)` per
request costs tens of milliseconds on large vocabularies (pain point P13), so nothing here does it per call.

Streaming text is produced by `detokenize_delta`, which is stateless: the caller passes the few tokens that precede
the new ones (`prefix_window`), so a stateless postprocessing model can emit text deltas that never split a
multi-byte character (P1) and never drop the space a SentencePiece `▁` stands for (P2).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

# How many already-streamed tokens travel with each new chunk. Decoding them again gives the new tokens their
# context (a leading `▁` becomes a space only after another token; the first bytes of a character may sit in an
# earlier token). A UTF-8 character has at most 4 bytes, so 8 leaves room for a partial character plus context.
DETOKENIZE_PREFIX_TOKENS = 8

# A Hugging Face tokenizer folder holds at least one of these (fast tokenizer, SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")
# Vocabulary files under other names (sentencepiece.bpe.model, source.spm, qwen.tiktoken): a folder with one of
# these is left to transformers, so the check below never refuses a tokenizer that would load.
_VOCABULARY_SUFFIXES = (".model", ".spm", ".tiktoken")

REPLACEMENT_CHARACTER = "\ufffd"
# A UTF-8 character spans at most 4 byte tokens, so at most 3 of them continue a character begun earlier.
_MAX_CHARACTER_TOKENS = 4


@dataclass(frozen=True)
class LoadedTokenizer:
    """A Hugging Face tokenizer with the per-model constants the Triton models need."""

    hf: Any
    vocab_size: int  # len(tokenizer): base vocabulary plus added tokens, the size of an embedding-bias vector
    end_id: int  # id of eos_token; -1 (the executor's "no end id") when the tokenizer has none
    pad_id: int  # id of pad_token, which defaults to eos_token

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(
        self, ids: Sequence[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
    ) -> str:
        return self.hf.decode(
            [int(i) for i in ids],
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=clean_up_tokenization_spaces,
        )


def wrap_tokenizer(hf_tokenizer: Any) -> LoadedTokenizer:
    """Wrap an already constructed Hugging Face tokenizer (pad_token := eos_token when it has none)."""
    if hf_tokenizer.pad_token is None and hf_tokenizer.eos_token is not None:
        hf_tokenizer.pad_token = hf_tokenizer.eos_token
    end_id = hf_tokenizer.eos_token_id
    end_id = -1 if end_id is None else int(end_id)
    pad_id = hf_tokenizer.pad_token_id
    pad_id = (end_id if end_id >= 0 else 0) if pad_id is None else int(pad_id)
    return LoadedTokenizer(hf=hf_tokenizer, vocab_size=len(hf_tokenizer), end_id=end_id, pad_id=pad_id)


class TokenizerFolderError(ValueError):
    """A tokenizer folder that does not exist or holds no tokenizer file."""


def tokenizer_folder_problem(tokenizer_dir: str) -> Optional[str]:
    """What is wrong with a tokenizer folder before anything tries to load it, or None. Without this check a
    folder with no tokenizer file fails deep inside transformers, with a message about sentencepiece."""
    path = os.path.abspath(os.path.expanduser(str(tokenizer_dir)))
    if not os.path.isdir(path):
        return f"the folder {path} does not exist"
    names = os.listdir(path)
    if not any(name in TOKENIZER_FILES or name.endswith(_VOCABULARY_SUFFIXES) for name in names):
        return f"the folder {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    return None


def load_tokenizer(tokenizer_dir: str) -> LoadedTokenizer:
    """Load a Hugging Face tokenizer from a local directory, offline; cached per absolute path.
    TokenizerFolderError when the folder is missing or holds no tokenizer file."""
    problem = tokenizer_folder_problem(tokenizer_dir)
    if problem is not None:
        raise TokenizerFolderError(problem)
    return _load_cached(os.path.abspath(os.path.expanduser(str(tokenizer_dir))))


@functools.lru_cache(maxsize=8)
def _load_cached(tokenizer_dir: str) -> LoadedTokenizer:
    from transformers import AutoTokenizer  # heavy import, paid only by the models that tokenize

    # trust_remote_code stays off: a model repository must not run code from a tokenizer folder.
    hf_tokenizer = AutoTokenizer.from_pretrained(
        tokenizer_dir, legacy=False, padding_side="left", trust_remote_code=False, local_files_only=True
    )
    return wrap_tokenizer(hf_tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# Prompts, word lists, embedding bias (preprocessing)
# ---------------------------------------------------------------------------------------------------------------


def encode_prompts(
    tokenizer: LoadedTokenizer, texts: Sequence[str], add_special_tokens: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [B, Lmax] int32, right-padded with the pad id, and the true lengths [B] int32."""
    rows = [tokenizer.encode(text, add_special_tokens) for text in texts]
    lengths = np.array([len(row) for row in rows], dtype=np.int32)
    width = int(lengths.max()) if len(rows) else 0
    ids = np.full((len(rows), width), tokenizer.pad_id, dtype=np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, lengths


def to_word_list_format(tokenizer: LoadedTokenizer, words_per_row: Sequence[Sequence[str]]) -> np.ndarray:
    """Stop/bad words as the executor's [B, 2, L] int32 format.

    Row b is `[flat ids of all its words, padded with 0], [cumulative end offset of each word, padded with -1]`.
    Words that encode to nothing (e.g. the `""` an HTTP client sends for "no stop words") are skipped; when no
    row has a word the result is [B, 2, 0]."""
    flat_rows, offset_rows = [], []
    for words in words_per_row:
        encoded = [tokenizer.encode(word, add_special_tokens=False) for word in words]
        encoded = [ids for ids in encoded if ids]
        flat_rows.append([token for ids in encoded for token in ids])
        offset_rows.append(np.cumsum([len(ids) for ids in encoded]).tolist())
    width = max((len(flat) for flat in flat_rows), default=0)
    result = np.zeros((len(flat_rows), 2, width), dtype=np.int32)
    result[:, 1, :] = -1
    for b, (flat, offsets) in enumerate(zip(flat_rows, offset_rows)):
        result[b, 0, : len(flat)] = flat
        result[b, 1, : len(offsets)] = offsets
    return result


def embedding_bias(
    tokenizer: LoadedTokenizer,
    words_per_row: Sequence[Sequence[str]],
    weights_per_row: Optional[Sequence[Sequence[float]]],
    words_name: str = "EMBEDDING_BIAS_WORDS",
    weights_name: str = "EMBEDDING_BIAS_WEIGHTS",
) -> np.ndarray:
    """Dense logit bias [B, vocab_size] float32, or [B, 0] when no row has a word.

    Each word adds its weight to every id it encodes to. Words are encoded WITH special tokens, as the anchor
    does, so a BOS the tokenizer prepends gets the weight too; clients tuned against the anchor rely on it."""
    batch = len(words_per_row)
    has_words = any(word for words in words_per_row for word in words)
    if weights_per_row is None:
        if has_words:
            raise ValueError(f"input '{weights_name}' is required when '{words_name}' is given")
        return np.zeros((batch, 0), dtype=np.float32)
    _check_same_lengths(words_per_row, weights_per_row, words_name, weights_name)
    if not has_words:
        return np.zeros((batch, 0), dtype=np.float32)
    bias = np.zeros((batch, tokenizer.vocab_size), dtype=np.float32)
    for b, (words, weights) in enumerate(zip(words_per_row, weights_per_row)):
        for word, weight in zip(words, weights):
            if word:
                ids = [i for i in tokenizer.encode(word, add_special_tokens=True) if 0 <= i < tokenizer.vocab_size]
                np.add.at(bias[b], ids, np.float32(weight))  # add.at: a word may repeat an id
    return bias


def _check_same_lengths(words_per_row, weights_per_row, words_name: str, weights_name: str) -> None:
    if len(words_per_row) != len(weights_per_row):
        raise ValueError(
            f"inputs '{words_name}' and '{weights_name}' must have the same batch size, "
            f"got {len(words_per_row)} and {len(weights_per_row)}"
        )
    for b, (words, weights) in enumerate(zip(words_per_row, weights_per_row)):
        if len(words) != len(weights):
            raise ValueError(
                f"inputs '{words_name}' and '{weights_name}' must have the same length, "
                f"got {len(words)} words and {len(weights)} weights in batch row {b}"
            )


# ---------------------------------------------------------------------------------------------------------------
# Detokenization (postprocessing)
# ---------------------------------------------------------------------------------------------------------------


def decode_ids(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    """Decode with the settings every decode here shares; `clean_up_tokenization_spaces` stays off because it
    rewrites text across token boundaries (" ." -> "."), which would make streamed and whole decodes differ."""
    return tokenizer.decode(
        [int(i) for i in ids], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def prefix_window(sequence_ids: Sequence[int], new_count: int, k: int = DETOKENIZE_PREFIX_TOKENS) -> list[int]:
    """The up to `k` tokens just before the last `new_count` tokens of `sequence_ids` (which include the new ones)."""
    if not 0 <= new_count <= len(sequence_ids):
        raise ValueError(f"new_count {new_count} must be between 0 and the sequence length {len(sequence_ids)}")
    end = len(sequence_ids) - new_count
    return [int(i) for i in sequence_ids[max(0, end - k) : end]]


def detokenize_delta(
    tokenizer: Any, prefix_ids: Sequence[int], new_ids: Sequence[int], is_final: bool, skip_special_tokens: bool = True
) -> str:
    """The text that `new_ids` add after `prefix_ids`, the up to DETOKENIZE_PREFIX_TOKENS tokens before them.

    Stateless: "emitted so far" is recomputed from the prefix with the same rule that chose what to emit before,
    so the deltas of a stream concatenate to the whole decode. An unfinished multi-byte character at the end is
    held back (it would decode to U+FFFD) and comes out with the call that completes it, or with `is_final`."""
    prefix = [int(i) for i in prefix_ids]
    new = [int(i) for i in new_ids]
    prefix = _drop_partial_character(tokenizer, prefix, new, skip_special_tokens)
    before = emitted_text(tokenizer, prefix, skip_special_tokens)
    sequence = prefix + new
    after = (
        decode_ids(tokenizer, sequence, skip_special_tokens)
        if is_final
        else emitted_text(tokenizer, sequence, skip_special_tokens)
    )
    return after[len(before) :]


def emitted_text(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool) -> str:
    """The text a stream may have sent once it has seen `ids`: their decode without an unfinished character.

    Normally that is the decode with its trailing U+FFFD run removed. Byte-fallback decoders (Llama, Mistral)
    turn a whole run of byte tokens into U+FFFD when its last character is unfinished, hiding characters that
    were complete a token earlier; decoding without the last few tokens recovers them. The longer of the two
    is used: both are prefixes of the final text, and taking the longer keeps "emitted so far" growing."""
    text = decode_ids(tokenizer, ids, skip_special_tokens)
    if not text.endswith(REPLACEMENT_CHARACTER):
        return text
    complete = text.rstrip(REPLACEMENT_CHARACTER)
    for cut in range(1, min(_MAX_CHARACTER_TOKENS, len(ids)) + 1):
        shorter = decode_ids(tokenizer, ids[: len(ids) - cut], skip_special_tokens)
        if not shorter.endswith(REPLACEMENT_CHARACTER):
            return shorter if len(shorter) > len(complete) else complete
    return complete


def _drop_partial_character(tokenizer: Any, prefix: list[int], new: list[int], skip_special_tokens: bool) -> list[int]:
    """Drop the leading prefix tokens that continue a character begun before the window, where they spoil it.

    Such tokens decode to U+FFFD. A byte-fallback decoder also turns the complete characters after them (in the
    same run of byte tokens) into U+FFFD, so they must go; their text was emitted with earlier chunks. Where
    decoding is local (byte-level BPE) they are kept: their U+FFFD is the same in both decodes and cancels, and
    at the start of a stream of invalid bytes it is text that still has to be emitted."""
    if not prefix:
        return prefix
    tokens = prefix + new
    for start in range(min(_MAX_CHARACTER_TOKENS - 1, len(prefix)) + 1):
        length = _character_length(tokenizer, tokens[start : start + _MAX_CHARACTER_TOKENS], skip_special_tokens)
        if length:
            break
    else:
        return prefix  # nothing looks like a character start (invalid bytes): keep the window as it is
    if start == 0:
        return prefix
    # Compare only up to the end of that first character: a later unfinished one spoils the rest of its run.
    head = decode_ids(tokenizer, tokens[:start], skip_special_tokens)
    character = decode_ids(tokenizer, tokens[start : start + length], skip_special_tokens)
    local = decode_ids(tokenizer, tokens[: start + length], skip_special_tokens) == head + character
    return prefix if local else prefix[start:]


def _character_length(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> int:
    """How many of the first tokens it takes to decode to text that does not start with U+FFFD (0: none do)."""
    for count in range(1, len(ids) + 1):
        if not decode_ids(tokenizer, ids[:count], skip_special_tokens).startswith(REPLACEMENT_CHARACTER):
            return count
    return 0
