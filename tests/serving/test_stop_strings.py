"""The one text-level stop-string matcher (BLS, LLM-API model, OpenAI front)."""

from tritonllm.stop_strings import StopStrings


def test_first_end_is_where_the_earliest_ending_word_ends():
    assert StopStrings(["three", "two"]).first_end("one two three") == len("one two")
    assert StopStrings(["bcd", "bc"]).first_end("abcd") == 3  # "bc" completes before "bcd"
    assert StopStrings(["four", ""]).first_end("one two") is None
    assert StopStrings(["two"]).first_end("two two", start=1) == len("two two")


def test_first_start_is_the_earliest_starting_word_ties_going_to_the_first_in_order():
    assert StopStrings(["cd", "bcd"]).first_start("abcde") == (1, "bcd")
    assert StopStrings(["bcx", "bc"]).first_start("abcd") == (1, "bc")
    assert StopStrings(["ab", "abc"]).first_start("xabc") == (1, "ab")
    assert StopStrings(["z"]).first_start("abc") is None


def test_search_start_reaches_back_one_word_length():
    assert StopStrings(["abc"]).search_start(10) == 8
    assert StopStrings(["abcdef"]).search_start(1) == 0
    assert StopStrings([]).search_start(5) == 6


def test_held_back_is_the_longest_tail_that_may_still_become_a_stop_string():
    stops = StopStrings(["</s>", "END"])
    assert stops.held_back("hello </") == 2
    assert stops.held_back("hello EN") == 2
    assert stops.held_back("hello") == 0
    assert stops.held_back("done </s>") == 0  # a whole stop string is found, not held back
    assert not StopStrings(["", ""]) and StopStrings(["x"])
