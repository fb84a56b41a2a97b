"""Lookahead decoding (Fu et al. 2024): Jacobi iterations over a window of future positions produce n-grams, an
n-gram pool keyed by their first token holds them, and the pool's n-grams for the last committed token are
verified, all in one forward of the target model.

One step feeds, after the committed context: the root (last committed token), the verification tree (a trie of
up to G pooled (N-1)-grams for the root) and the window: up to N-1 levels of W guessed tokens. Level l, column c
sits at position root + 1 + c + l and sees the root, level 0's columns 0..c and column c of levels 1..l: a
coherent sequence, so its output is a real next-token guess. The top level's outputs become a new level; once
N-1 levels exist, each column (level 0 .. top, new) is an N-gram for the pool, and level 0 is dropped.

The model forward is a callable (`TreeForward`), so the engine plugs in later and tests use an oracle."""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .acceptance import Verdict, greedy_accept
from .config import LookaheadConfig
from .tree import DraftTree

# forward(context_tokens, new_tokens, new_positions, mask [T, T] over the new tokens) -> logits [T, vocab]
TreeForward = Callable[[Sequence[int], Sequence[int], Sequence[int], torch.Tensor], torch.Tensor]


class NGramPool:
    """Continuations ((N-1)-grams) by key token, at most `max_per_key` per key, least recently added dropped."""

    def __init__(self, ngram_size: int, max_per_key: int):
        self.ngram_size = ngram_size
        self.max_per_key = max_per_key
        self._grams: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, continuation: Sequence[int]) -> None:
        grams = self._grams.setdefault(int(key), OrderedDict())
        gram = tuple(int(t) for t in continuation)
        grams.pop(gram, None)
        grams[gram] = None
        while len(grams) > self.max_per_key:
            grams.popitem(last=False)

    def add_from(self, tokens: Sequence[int]) -> None:
        """Every complete n-gram of `tokens` (the prompt, or newly committed text)."""
        size = self.ngram_size
        for start in range(len(tokens) - size + 1):
            self.add(tokens[start], tokens[start + 1:start + size])

    def candidates(self, key: int) -> list[tuple[int, ...]]:
        """Most recently added first."""
        return list(reversed(self._grams.get(int(key), ())))


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
        state = LookaheadState(NGramPool(c.max_ngram_size, c.max_verification_set_size))
        state.levels = [[self._random.choice(list(history)) for _ in range(c.max_window_size)]]
        self.observe(state, history)
        return state

    def observe(self, state: LookaheadState, history: Sequence[int]) -> None:
        """Pool the n-grams of committed tokens not seen yet (prompt lookup for free)."""
        if not self.pool_from_history:
            return
        start = max(0, state.num_pooled - self.config.max_ngram_size + 1)
        state.pool.add_from(history[start:])
        state.num_pooled = len(history)

    def build_step(self, state: LookaheadState, root: int, max_draft: Optional[int] = None) -> LookaheadStep:
        tree = self.verification_tree(state.pool, root, max_draft)
        window = state.levels
        size = 1 + len(tree) + len(window) * len(window[0])
        mask = torch.zeros(size, size, dtype=torch.bool)
        mask[:len(tree) + 1, :len(tree) + 1] = tree.attention_mask()
        window_start = len(tree) + 1
        offsets = tree.position_offsets() + _window_offsets(len(window), len(window[0]))
        _fill_window_mask(mask, window_start, len(window), len(window[0]))
        tokens = [root] + tree.tokens + [t for level in window for t in level]
        return LookaheadStep(tokens, offsets, mask, tree, window_start, len(window), len(window[0]))

    def verification_tree(self, pool: NGramPool, root: int, max_draft: Optional[int] = None) -> DraftTree:
        """A trie of the pooled continuations for `root` (shared prefixes verified once)."""
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}
        for gram in pool.candidates(root):
            node = -1
            for token in gram:
                child = index.get((node, token))
                if child is None:
                    if max_draft is not None and len(tokens) >= max_draft:
                        break
                    child = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                    index[(node, token)] = child
                node = child
        return DraftTree(tokens, parents)

    def advance_window(self, state: LookaheadState, step: LookaheadStep, argmax: Sequence[int],
                       num_committed: int) -> None:
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
        verdict = greedy_accept(step.tree, argmax[:len(step.tree) + 1])
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


def lookahead_generate(forward: TreeForward, prompt: Sequence[int], max_new_tokens: int,
                       config: LookaheadConfig, seed: int = 0,
                       pool_from_history: bool = True) -> tuple[list[int], int]:
    """Greedy generation with lookahead, one forward per step; returns (tokens, number of forwards).
    The reference loop the engine integration must match (tests compare it with plain greedy)."""
    decoder = LookaheadDecoder(config, seed, pool_from_history)
    state = decoder.new_state(prompt)
    context, root, output, forwards = list(prompt[:-1]), int(prompt[-1]), [], 0
    while len(output) < max_new_tokens:
        step = decoder.build_step(state, root)
        positions = [len(context) + offset for offset in step.position_offsets]
        argmax = forward(context, step.tokens, positions, step.mask).argmax(dim=-1).tolist()
        forwards += 1
        verdict = decoder.finish_greedy_step(state, step, argmax)
        committed = verdict.tokens[:max_new_tokens - len(output)]
        output += committed
        context += [root] + committed[:-1]
        root = committed[-1]
        decoder.observe(state, context + [root])
    return output, forwards
