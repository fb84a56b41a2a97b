"""Draft trees: the shape every proposer returns and every verifier walks.

The root is the sequence's last committed token (its KV is not computed yet; it is fed with the drafts). Node i
holds a draft token, its parent (-1 = the root) and its depth (root 0); parents always come before children, so
a chain is simply parents [-1, 0, 1, ...]. In the verification forward the root and the nodes are fed in this
order, node i at position `root_position + depth[i]`, each attending to the committed context, the root and its
own ancestors."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .config import Choices, validate_choices


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # [n, vocab] draft probabilities of each node's token distribution (a sampled chain from a draft model);
    # None for deterministic drafts (n-gram, lookahead, argmax heads), which verification treats as one-hot.
    draft_probs: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come before their children")

    @classmethod
    def chain(cls, tokens: Sequence[int], draft_probs: Optional[torch.Tensor] = None) -> "DraftTree":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), draft_probs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.tokens) - 1))

    @property
    def depths(self) -> list[int]:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = the root), in node order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def attention_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool, row/column 0 the root: True where the row token may attend to the column token
        (itself, the root and its ancestors). The committed context is visible to all and not included."""
        size = len(self.tokens) + 1
        mask = torch.zeros(size, size, dtype=torch.bool)
        mask[:, 0] = True
        for i, parent in enumerate(self.parents):
            row = i + 1
            if parent >= 0:
                mask[row] = mask[parent + 1]
            mask[row, row] = True
        return mask

    def position_offsets(self) -> list[int]:
        """Offsets from the root's position, root first."""
        return [0] + self.depths

    def truncated(self, max_nodes: int) -> "DraftTree":
        """The first `max_nodes` nodes (still a tree, since parents come first)."""
        probs = None if self.draft_probs is None else self.draft_probs[:max_nodes]
        return DraftTree(self.tokens[:max_nodes], self.parents[:max_nodes], probs)


@dataclass(frozen=True)
class TreeTemplate:
    """The fixed shape of a `medusa_choices` / `eagle_choices` tree: node i is the `ranks[i]`-th candidate at
    depth `depths[i]`. `fill` turns it into a DraftTree from per-depth ranked candidates."""

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]

    @classmethod
    def from_choices(cls, choices: Choices) -> "TreeTemplate":
        validate_choices(choices, "choices")
        ordered = sorted(set(choices), key=lambda path: (len(path), path))  # parents first, then by rank
        index = {path: i for i, path in enumerate(ordered)}
        parents = tuple(index[path[:-1]] if len(path) > 1 else -1 for path in ordered)
        return cls(tuple(ordered), parents)

    @property
    def depth(self) -> int:
        return max(len(path) for path in self.paths)

    @property
    def max_rank(self) -> int:
        """How many candidates per depth the tree needs (top-k)."""
        return max(max(path) for path in self.paths) + 1

    def fill(
        self,
        candidates: Sequence[Sequence[int]],
        probabilities: Optional[Sequence[Sequence[float]]] = None,
        min_path_probability: float = 0.0,
    ) -> DraftTree:
        """`candidates[d][r]`: the rank-r token for depth d+1 (e.g. Medusa head d's top-k). With `probabilities`
        (the same layout), nodes whose path probability (the product along the path) is below
        `min_path_probability` are left out; a child is never likelier than its parent, so the rest is a tree."""
        if len(candidates) < self.depth:
            raise ValueError(f"the tree is {self.depth} deep but only {len(candidates)} depths have candidates")
        tokens = [int(candidates[len(path) - 1][path[-1]]) for path in self.paths]
        if probabilities is None or min_path_probability <= 0:
            return DraftTree(tokens, list(self.parents))
        kept: dict[int, int] = {}  # template node -> index in the pruned tree
        path_probability: list[float] = []
        pruned = DraftTree()
        for node, (path, parent) in enumerate(zip(self.paths, self.parents)):
            likelihood = (1.0 if parent < 0 else path_probability[parent]) * probabilities[len(path) - 1][path[-1]]
            path_probability.append(likelihood)
            if likelihood >= min_path_probability and (parent < 0 or parent in kept):
                kept[node] = len(pruned.tokens)
                pruned.tokens.append(tokens[node])
                pruned.parents.append(-1 if parent < 0 else kept[parent])
        return pruned


def default_choices(depth: int, num_nodes: int, top_k: int = 4, decay: float = 0.5) -> Choices:
    """A tree of `num_nodes` paths for `depth` heads when none is configured: grown greedily by an assumed
    acceptance model (rank r at any depth accepted with probability decay**(r+1)), so the likeliest paths win.
    Our own default; TensorRT-LLM's is the 63-node mc_sim_7b_63, too wide for CPU verification."""
    frontier: list[tuple[float, tuple[int, ...]]] = [(-decay, (0,))]
    frontier += [(-(decay ** (r + 1)), (r,)) for r in range(1, top_k)]
    heapq.heapify(frontier)
    chosen: Choices = []
    while frontier and len(chosen) < num_nodes:
        negative_score, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth:
            for rank in range(top_k):
                heapq.heappush(frontier, (negative_score * decay ** (rank + 1), path + (rank,)))
    return chosen
