"""SequenceText: the cumulative text of a generated sequence (LLM-API model) with complete characters only, cut at
stop strings, every response a prefix of the final text."""

from __future__ import annotations

import pytest

from tritonllm.checkpoints.tiny import build_tiny_model
from tritonllm.tokenizer import decode_ids, load_tokenizer
from tritonllm.triton.llmapi_text import SequenceText

TEXT = "The lamp turned and turned: naïve café 🙂 again"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(build_tiny_model(tmp_path_factory.mktemp("tiny"))))


def feed(tokenizer, text: str, stop=()) -> tuple[SequenceText, list[str]]:
    """Feed the tokens of `text` one at a time, as a stream would; the texts a response could carry meanwhile."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    sequence = SequenceText(tokenizer, stop)
    seen = []
    for count in range(1, len(ids) + 1):
        sequence.add(ids[:count], is_final=count == len(ids))
        seen.append(sequence.text(final=count == len(ids)))
    return sequence, seen


def test_streamed_texts_only_grow_hold_no_broken_character_and_end_as_the_whole_decode(tokenizer):
    sequence, seen = feed(tokenizer, TEXT)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the test text must split a character over tokens"
    assert seen[-1] == decode_ids(tokenizer, ids, skip_special_tokens=True) == TEXT
    for before, after in zip(seen, seen[1:]):
        assert after.startswith(before)
    assert not any("\ufffd" in text for text in seen)
    assert not sequence.stopped


def test_a_stop_string_ends_the_text_before_it(tokenizer):
    sequence, seen = feed(tokenizer, TEXT, stop=["turned:"])
    assert sequence.stopped_by == "turned:"
    assert seen[-1] == "The lamp turned and "
    assert all(TEXT.startswith(text) for text in seen)


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    sequence, seen = feed(tokenizer, TEXT, stop=["café", "and"])
    assert sequence.stopped_by == "and"
    assert seen[-1] == "The lamp turned "


def test_text_that_may_start_a_stop_string_is_held_back_until_the_next_tokens_tell(tokenizer):
    ids = tokenizer.encode("The lamp turned", add_special_tokens=False)
    sequence = SequenceText(tokenizer, ["mp tu"])
    lamp = next(i for i in range(1, len(ids) + 1) if tokenizer.decode(ids[:i]).endswith("lamp"))
    sequence.add(ids[:lamp], is_final=False)
    assert sequence.text(final=False) == "The la"  # "mp" may begin "mp tu"
    sequence.add(ids, is_final=False)
    assert sequence.stopped_by == "mp tu"
    assert sequence.text(final=True) == "The la"


def test_a_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop_string(tokenizer):
    sequence, seen = feed(tokenizer, "The lamp turned", stop=["mp tx"])
    assert not sequence.stopped
    assert seen[-1] == "The lamp turned"


def test_tokens_after_a_stop_string_are_ignored(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    sequence = SequenceText(tokenizer, ["lamp"])
    sequence.add(ids[:4], is_final=False)
    stopped_text = sequence.text(final=True)
    sequence.add(ids, is_final=True)
    assert sequence.text(final=True) == stopped_text == "The "


def test_empty_stop_strings_are_ignored(tokenizer):
    sequence, seen = feed(tokenizer, "The lamp", stop=[""])
    assert not sequence.stopped and seen[-1] == "The lamp"
