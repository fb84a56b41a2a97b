"""Lookahead decoding (Fu et al. 2024): Jacobi iterations over a window of future positions produce n-grams, an
n-gram pool keyed by their first token holds them, and the pool's n-grams for the last committed token are
verified, all in one forward of the target model.

One step feeds, after the committed context: the root (last committed token), the verification tree (a trie of
up to G pooled (N-1)-grams for the root) and the window: up to N-1 levels of W guessed tokens. Level l, column c
sits at position root + 1 + c + l and sees the root, level 0's columns 0..c and column c of levels 1..l: a
coherent sequence, so its output is a real next-token guess. The top level's outputs become a new level; once
N-1 levels exist, each column (level 0 .. top, new) is an N-gram for the pool, and level 0 is dropped.

The model forward is a callable (`TreeForward`): the embedded engine passes its own
(engine/embedded/speculation/methods.py), the tests an oracle."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .acceptance import Verdict, greedy_accept
from .config import LookaheadConfig
from .tree import DraftTree

POOL_PER_KEY = 8  # n-grams kept per key token; the G whose context fits best are verified

# forward(context_tokens, new_tokens, new_positions, mask [T, T] over the new tokens) -> logits [T, vocab]
TreeForward = Callable[[Sequence[int], Sequence[int], Sequence[int], torch.Tensor], torch.Tensor]


class NGramPool:
    """Continuations ((N-1)-grams) by key token, at most `max_per_key` per key, least recently added dropped.
    Each remembers the tokens just before its key where it was seen (`CONTEXT` of them, none for the window's
    n-grams): `candidates` puts those whose context matches the text before the root first."""

    CONTEXT = 2

    def __init__(self, ngram_size: int, max_per_key: int):
        self.ngram_size = ngram_size
        self.max_per_key = max_per_key
        self._grams: dict[int, OrderedDict[tuple[int, ...], tuple[int, ...]]] = {}

    def add(self, key: int, continuation: Sequence[int], before: Sequence[int] = ()) -> None:
        grams = self._grams.setdefault(int(key), OrderedDict())
        gram = tuple(int(t) for t in continuation)
        grams.pop(gram, None)
        grams[gram] = tuple(int(t) for t in before[-self.CONTEXT :])
        while len(grams) > self.max_per_key:
            grams.popitem(last=False)

    def add_from(self, tokens: Sequence[int], first: int = 0) -> None:
        """Every complete n-gram of `tokens` starting at `first` or later (the prompt, or newly committed
        text), with the tokens before each."""
        size = self.ngram_size
        for start in range(first, len(tokens) - size + 1):
            self.add(tokens[start], tokens[start + 1 : start + size], tokens[max(0, start - self.CONTEXT) : start])

    def candidates(self, key: int, before: Sequence[int] = ()) -> list[tuple[int, ...]]:
        """Those whose remembered context matches the end of `before` longest first; then most recently
        added first."""
        return [gram for gram, _ in self.ranked(key, before)]

    def ranked(self, key: int, before: Sequence[int] = ()) -> list[tuple[tuple[int, ...], int]]:
        """(continuation, how many tokens of its context match the end of `before`), best first."""
        grams = [
            (gram, _common_suffix(context, before)) for gram, context in reversed(self._grams.get(int(key), {}).items())
        ]
        return sorted(grams, key=lambda item: -item[1])  # stable: recency breaks ties

    def extend(self, text: Sequence[int], path: list[int], room: int) -> list[int]:
        """`path` (which follows `text`) continued by the n-gram whose context fully matches its own end, and
        so on, up to `room` tokens: a stretch of copied text is proposed whole, not N - 1 tokens at a time."""
        path = path[:room]
        text = list(text) + path
        while len(path) < room:
            ranked = self.ranked(text[-1], text[-1 - self.CONTEXT : -1])
            if not ranked or ranked[0][1] < self.CONTEXT:
                break
            more = list(ranked[0][0][: room - len(path)])
            path, text = path + more, text + more
        return path


def _common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    count = 0
    while count < min(len(a), len(b)) and a[-1 - count] == b[-1 - count]:
        count += 1
    return count


@dataclass
class LookaheadState:
    """Per-sequence state: the pool and the Jacobi window (levels[l][c])."""

    pool: NGramPool
    levels: list[list[int]] = field(default_factory=list)
    num_pooled: int = 0  # history tokens already added to the pool


@dataclass
class LookaheadStep:
    tokens: list[int]  # root, verification nodes, window tokens (level by level)
    position_offsets: list[int]  # from the root's position
    mask: torch.Tensor  # [T, T] bool
    tree: DraftTree  # rows 0 .. len(tree) of the outputs verify it
    window_start: int
    num_levels: int
    window_size: int

    def top_level_rows(self) -> list[int]:
        first = self.window_start + (self.num_levels - 1) * self.window_size
        return list(range(first, first + self.window_size))


class LookaheadDecoder:
    def __init__(self, config: LookaheadConfig, seed: int = 0, pool_from_history: bool = True):
        self.config = config
        self.pool_from_history = pool_from_history
        self._random = random.Random(seed)

    def new_state(self, history: Sequence[int]) -> LookaheadState:
        """Level 0 starts as tokens drawn from the history (as the reference does from the prompt)."""
        c = self.config
        state = LookaheadState(NGramPool(c.max_ngram_size, max(c.max_verification_set_size, POOL_PER_KEY)))
        state.levels = [[self._random.choice(list(history)) for _ in range(c.max_window_size)]]
        self.observe(state, history)
        return state

    def observe(self, state: LookaheadState, history: Sequence[int]) -> None:
        """Pool the n-grams of committed tokens not seen yet (prompt lookup for free)."""
        if not self.pool_from_history:
            return
        state.pool.add_from(history, max(0, state.num_pooled - self.config.max_ngram_size + 1))
        state.num_pooled = len(history)

    def build_step(
        self, state: LookaheadState, root: int, max_draft: Optional[int] = None, before: Sequence[int] = ()
    ) -> LookaheadStep:
        """`before`: the committed tokens before the root (their end ranks the pool's candidates)."""
        tree = self.verification_tree(state.pool, root, max_draft, before)
        window = state.levels
        size = 1 + len(tree) + len(window) * len(window[0])
        mask = torch.zeros(size, size, dtype=torch.bool)
        mask[: len(tree) + 1, : len(tree) + 1] = tree.attention_mask()
        window_start = len(tree) + 1
        offsets = tree.position_offsets() + _window_offsets(len(window), len(window[0]))
        _fill_window_mask(mask, window_start, len(window), len(window[0]))
        tokens = [root] + tree.tokens + [t for level in window for t in level]
        return LookaheadStep(tokens, offsets, mask, tree, window_start, len(window), len(window[0]))

    def verification_tree(
        self, pool: NGramPool, root: int, max_draft: Optional[int] = None, before: Sequence[int] = ()
    ) -> DraftTree:
        """A trie of the G best pooled continuations for `root` (shared prefixes verified once), at most
        G * (N - 1) tokens. A candidate whose context matches the text before the root fully is extended along
        the pool while that budget lasts (a copied stretch is verified in one step), leaving less for the rest."""
        c = self.config
        budget = c.max_verification_set_size * (c.max_ngram_size - 1)
        budget = budget if max_draft is None else min(budget, max_draft)
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for gram, score in pool.ranked(root, before)[: c.max_verification_set_size]:
            path = list(gram)
            if before and score == pool.CONTEXT:
                path = pool.extend(list(before) + [root], path, budget - len(tokens))
            node = -1
            for token in path:
                child = index.get((node, token))
                if child is None:
                    if len(tokens) >= budget:
                        break
                    child = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    index[(node, token)] = child
                node = child
        return DraftTree(tokens, parents)

    def advance_window(
        self, state: LookaheadState, step: LookaheadStep, argmax: Sequence[int], num_committed: int
    ) -> None:
        """New level from the top level's outputs; harvest n-grams once the window is full; shift the window
        left by the extra tokens committed so each column keeps guessing the same position."""
        new_level = [int(argmax[row]) for row in step.top_level_rows()]
        levels = state.levels
        if len(levels) == self.config.max_ngram_size - 1:
            for column in range(len(new_level)):
                gram = [level[column] for level in levels] + [new_level[column]]
                state.pool.add(gram[0], gram[1:])
            levels = levels[1:]
        levels = levels + [new_level]
        state.levels = [_shift(level, num_committed - 1) for level in levels]

    def finish_greedy_step(self, state: LookaheadState, step: LookaheadStep, argmax: Sequence[int]) -> Verdict:
        verdict = greedy_accept(step.tree, argmax[: len(step.tree) + 1])
        self.advance_window(state, step, argmax, len(verdict.tokens))
        return verdict


def _window_offsets(num_levels: int, width: int) -> list[int]:
    return [1 + column + level for level in range(num_levels) for column in range(width)]


def _fill_window_mask(mask: torch.Tensor, start: int, num_levels: int, width: int) -> None:
    """Level l, column c sees the root, level 0's columns 0..c and column c of levels 1..l (and itself)."""

    def row(level: int, column: int) -> int:
        return start + level * width + column

    for level in range(num_levels):
        for column in range(width):
            r = row(level, column)
            mask[r, 0] = True
            for earlier in range(column + 1):
                mask[r, row(0, earlier)] = True
            for lower in range(1, level + 1):
                mask[r, row(lower, column)] = True


def _shift(level: list[int], by: int) -> list[int]:
    """Drop `by` leading guesses; keep the width by repeating the last one (Jacobi corrects it)."""
    if by <= 0:
        return level
    kept = level[by:] or level[-1:]
    return kept + [kept[-1]] * (len(level) - len(kept))


def lookahead_generate(
    forward: TreeForward,
    prompt: Sequence[int],
    max_new_tokens: int,
    config: LookaheadConfig,
    seed: int = 0,
    pool_from_history: bool = True,
) -> tuple[list[int], int]:
    """Greedy generation with lookahead, one forward per step; returns (tokens, number of forwards).
    The reference loop the engine integration must match (tests compare it with plain greedy)."""
    decoder = LookaheadDecoder(config, seed, pool_from_history)
    state = decoder.new_state(prompt)
    context, root, forwards = list(prompt[:-1]), int(prompt[-1]), 0
    output: list[int] = []
    while len(output) < max_new_tokens:
        step = decoder.build_step(state, root, before=context[-NGramPool.CONTEXT :])
        positions = [len(context) + offset for offset in step.position_offsets]
        argmax = forward(context, step.tokens, positions, step.mask).argmax(dim=-1).tolist()
        forwards += 1
        verdict = decoder.finish_greedy_step(state, step, argmax)
        committed = verdict.tokens[: max_new_tokens - len(output)]
        output += committed
        context += [root] + committed[:-1]
        root = committed[-1]
        decoder.observe(state, context + [root])
    return output, forwards
