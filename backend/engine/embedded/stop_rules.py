"""The stop rule that plain and beam-search sequences share: stop tokens and stop words. (`end_id` and the length
limits are checked by each caller, which differ in whether the token is already appended.)"""

from __future__ import annotations

from typing import Callable, Optional, Union

from ..types import SamplingParams


def matched_stop(
    params: SamplingParams, last: int, token_ids: Callable[[], list[int]]
) -> Optional[Union[int, list[int]]]:
    """The stop token (`last`) or the stop word that a sequence ending in `last` ends with, else None.
    `token_ids` gives the sequence's tokens up to `last`; it is called only when there are stop words (the hot
    path of a request without any builds no list)."""
    if params.stop_token_ids and last in params.stop_token_ids:
        return last
    if not params.stop_words:
        return None
    tokens = token_ids()
    for word in params.stop_words:
        if tokens[-len(word) :] == word:
            return list(word)
    return None
