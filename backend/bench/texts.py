"""The text the accuracy bench scores: short original English passages shipped with the package (a story, a
technical explanation, a dialogue), cut into perplexity windows and generation prompts."""

from __future__ import annotations

from importlib import resources

PASSAGE_NAMES = ("narrative", "technical", "dialogue")


def load_passages() -> dict[str, str]:
    """Each shipped passage by name, in PASSAGE_NAMES order."""
    data = resources.files("tritonllm.bench").joinpath("data")
    return {name: data.joinpath(f"{name}.txt").read_text(encoding="utf-8") for name in PASSAGE_NAMES}


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of at most `size` tokens; a last window of one token is dropped, since
    a window scores every token after its first and one token leaves nothing to score."""
    if size < 2:
        raise ValueError(f"a perplexity window needs at least 2 tokens, got {size}")
    cut = [token_ids[start : start + size] for start in range(0, len(token_ids), size)]
    return [window for window in cut if len(window) >= 2]


def cut_prompts(passages: list[list[int]], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, taken from the passages in turn, each passage's evenly spread from its
    start (the tokens after a prompt are the text the model is asked to continue)."""
    shortest = min(len(ids) for ids in passages)
    if length >= shortest:
        raise ValueError(f"prompts of {length} tokens do not fit the shortest passage ({shortest} tokens)")
    per_passage = [len(range(index, count, len(passages))) for index in range(len(passages))]
    prompts = []
    for number in range(count):
        which, rank = number % len(passages), number // len(passages)
        ids = passages[which]
        start = rank * (len(ids) - length) // per_passage[which]
        prompts.append(ids[start : start + length])
    return prompts
