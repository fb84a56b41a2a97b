"""The stateful detokenizer (tokenizers' DecodeStream) gives the same text as the whole decode, on the three
tokenizer kinds of test_tokenizer.py, and falls back to the stateless window where DecodeStream cannot go."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from tritonllm import tokenizer as tok
from tritonllm.decode_stream import StreamDecoder

# The tokenizers and texts of test_tokenizer.py (importlib mode keeps tests/ off sys.path).
_spec = importlib.util.spec_from_file_location("tokenizer_cases", Path(__file__).with_name("test_tokenizer.py"))
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)
BUILDERS, CHUNKINGS, FFFD, STREAM_TEXTS = cases.BUILDERS, cases.CHUNKINGS, cases.FFFD, cases.STREAM_TEXTS


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def loaded(request, tmp_path_factory) -> tok.LoadedTokenizer:
    directory = tmp_path_factory.mktemp(request.param)
    return tok.load_tokenizer(cases.save_tokenizer(BUILDERS[request.param](), directory))


def stream(tokenizer, ids, chunks, skip_special_tokens=True, final_alone=False) -> tuple[StreamDecoder, list[str]]:
    decoder, deltas, sent, index = StreamDecoder(tokenizer, skip_special_tokens), [], 0, 0
    while sent < len(ids):
        new = ids[sent : sent + chunks[index % len(chunks)]]
        index += 1
        sent += len(new)
        deltas.append(decoder.add(new, sent == len(ids) and not final_alone))
    if final_alone:
        deltas.append(decoder.add([], True))
    return decoder, deltas


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=lambda c: "chunks" + "-".join(map(str, c)))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_the_whole_decode_and_never_split_a_character(loaded, chunks, skip_special_tokens):
    for text in STREAM_TEXTS + [" ".join(STREAM_TEXTS)]:
        ids = loaded.hf.encode(text, add_special_tokens=True) + [loaded.end_id]
        decoder, deltas = stream(loaded, ids, chunks, skip_special_tokens)
        assert "".join(deltas) == loaded.hf.decode(ids, skip_special_tokens=skip_special_tokens), text
        assert not any(FFFD in delta for delta in deltas), text
        assert decoder._stream is not None, "valid text must not need the stateless fallback"


def test_an_unfinished_character_is_held_back_and_flushed_at_the_end(loaded, request):
    if request.node.callspec.params["loaded"] == "metaspace":
        pytest.skip("this tokenizer has every character as a whole token")
    emoji = loaded.hf.encode("🎉", add_special_tokens=False)
    assert len(emoji) > 1
    ids = loaded.hf.encode("ok", add_special_tokens=False) + emoji[:-1]  # truncated by max_tokens
    _, deltas = stream(loaded, ids, [1], final_alone=True)
    assert FFFD not in "".join(deltas[:-1])
    assert "".join(deltas) == loaded.hf.decode(ids) and deltas[-1].endswith(FFFD)


def test_random_tokens_match_the_whole_decode_falling_back_where_decode_stream_refuses(loaded, request):
    """Random-weight models emit invalid byte runs and special tokens anywhere. DecodeStream refuses some of them
    on a byte-fallback decoder; the decoder then goes on with the stateless rule, without raising."""
    rng = random.Random(7)
    fell_back = 0
    for _ in range(100):
        ids = [rng.randrange(loaded.vocab_size) for _ in range(rng.randint(1, 30))]
        decoder, deltas = stream(loaded, ids, [rng.randint(1, 3) for _ in range(4)])
        fell_back += decoder._stream is None
        whole = loaded.hf.decode(ids, skip_special_tokens=True)
        if request.node.callspec.params["loaded"] == "metaspace_byte_fallback":
            continue  # a byte-fallback decode of an invalid run takes back earlier characters: no stream can match
        assert "".join(deltas) == whole, ids
    if request.node.callspec.params["loaded"] == "metaspace_byte_fallback":
        assert fell_back > 0, "DecodeStream refused none of the invalid runs: the fallback went untested"


def test_a_slow_tokenizer_uses_the_stateless_window(loaded):
    class Slow:  # a Hugging Face tokenizer without a Rust backend
        def decode(self, ids, **kwargs):
            return loaded.hf.decode(ids, **kwargs)

    ids = loaded.hf.encode(STREAM_TEXTS[3], add_special_tokens=False)
    decoder, deltas = stream(Slow(), ids, [2])
    assert decoder._stream is None and "".join(deltas) == loaded.hf.decode(ids)
