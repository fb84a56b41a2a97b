"""Stop strings on streamed text: cut where the first one begins, never sent, never taken back."""

from __future__ import annotations

import pytest

from tritonllm.openai_api.stop_text import StopTrimmer


def stream(pieces, stops) -> tuple[list[str], bool]:
    trimmer = StopTrimmer(stops)
    sent = [trimmer.feed(piece) for piece in pieces]
    sent.append(trimmer.flush())
    return sent, trimmer.stopped


@pytest.mark.parametrize(
    "pieces",
    [
        ["Hello wor", "ld. STOP here"],
        ["Hello world. S", "T", "OP here"],
        ["H", "ello world. ST", "OP", " here"],
        ["Hello world. STOP here"],
    ],
)
def test_text_ends_before_the_stop_string_however_it_is_split(pieces):
    sent, stopped = stream(pieces, ["STOP"])
    assert "".join(sent) == "Hello world. " and stopped


def test_a_held_back_prefix_that_is_no_stop_is_sent_later():
    sent, stopped = stream(["abc ST", "ART", " end"], ["STOP"])
    assert sent[0] == "abc " and "".join(sent) == "abc START end" and not stopped


def test_the_earliest_of_several_stop_strings_wins():
    sent, _ = stream(["one two three"], ["three", "two"])
    assert "".join(sent) == "one "


def test_nothing_after_a_stop_and_nothing_held_without_stops():
    trimmer = StopTrimmer(["x"])
    assert trimmer.feed("axb") == "a" and trimmer.feed("more") == "" and trimmer.flush() == ""
    assert stream(["a", "b"], [])[0] == ["a", "b", ""]


def test_a_stop_string_that_begins_in_text_already_sent_is_not_possible_to_miss():
    # "ab" was held back (it could start "abc"), then "c" completes it
    sent, stopped = stream(["xx ab", "c yy"], ["abc"])
    assert "".join(sent) == "xx " and stopped
