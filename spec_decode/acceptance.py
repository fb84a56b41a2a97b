"""Verification: which draft tokens the target accepts, and the one token it adds after them. One rule, which the
embedded engine (tritonllm.engine.embedded.speculation.speculator) and the tests both run.

`walk` goes down the draft tree from the root: at each node the target picks the next token (row 0 of a
verification forward follows the root, row i+1 node i), which is committed; the walk goes on to the child holding
that token while there is one. The accepted nodes are one root-to-node path, and a step always commits at least
one token (`Verdict(accepted_nodes, tokens)`: the accepted drafts plus the target's token after them).

How the target picks a row's token:
- Greedy requests: its argmax (`greedy_accept`). The output equals plain greedy decoding.
- Sampled requests, drafts without probabilities (n-gram, lookahead, Medusa and EAGLE trees, argmax chains): a
  token drawn from the target's distribution p, as a plain decode step draws it (the engine uses the request's own
  sampler). The output keeps p: a draft d is accepted with probability p(d), and otherwise the token comes from p
  without d; the children of a tree node compete alike, one draw deciding between them. That is rejection sampling
  with a one-hot draft distribution, done in one draw.
- Sampled requests, a chain with draft probabilities q (`DraftTree.draft_probs`, external `draft_logits`):
  rejection sampling (Leviathan et al. 2023; Chen et al. 2023, `accept_or_resample`), which keeps p: the draft
  d ~ q of the next node (`draft_child`) is accepted with probability min(1, p(d) / q(d)), or, with an acceptance
  threshold, when that ratio reaches it; on rejection the token is drawn from norm(max(0, p - q)). After the last
  draft the token is drawn from p.
`rejection_sample` runs the sampled rule on given target probabilities."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .tree import DraftTree


@dataclass
class Verdict:
    accepted_nodes: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


def walk(tree: DraftTree, choose: Callable[[int], int], finished: Optional[Callable[[], bool]] = None) -> Verdict:
    """The verification walk. `choose(node)` is the target's token after `node` (-1: the root), committed by the
    caller; the walk follows the child holding it while there is one and `finished()` (the request ended with that
    token: end id, stop word, max_tokens) is not true."""
    children = _children_by_token(tree)
    accepted: list[int] = []
    tokens: list[int] = []
    node = -1
    while True:
        token = choose(node)
        tokens.append(token)
        child = children.get((node, token))
        if child is None or (finished is not None and finished()):
            return Verdict(accepted, tokens)
        accepted.append(child)
        node = child


def _children_by_token(tree: DraftTree) -> dict[tuple[int, int], int]:
    index: dict[tuple[int, int], int] = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        index.setdefault((parent, token), i)  # a duplicate sibling can never be reached first
    return index


# ---- greedy ---------------------------------------------------------------------------------------------------


def greedy_accept(tree: DraftTree, target_tokens: Sequence[int]) -> Verdict:
    """`target_tokens[0]` is the target's argmax after the root, `target_tokens[i+1]` after node i. Follows the
    child whose token equals the target's choice while one exists (the longest accepted path)."""
    if len(target_tokens) != len(tree) + 1:
        raise ValueError(f"need {len(tree) + 1} target tokens for {len(tree)} draft nodes, got {len(target_tokens)}")
    return walk(tree, lambda node: int(target_tokens[node + 1]))


# ---- sampling -------------------------------------------------------------------------------------------------


def draft_child(tree: DraftTree, node: int) -> Optional[int]:
    """The node whose draft probabilities decide the token after `node`: the next node of a chain with draft
    probabilities (only chains have them); None where the token is drawn from the target's distribution alone (no
    draft probabilities, or past the last draft)."""
    child = node + 1
    return None if tree.draft_probs is None or child >= len(tree) else child


def rejection_sample(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator, threshold: Optional[float] = None
) -> Verdict:
    """The sampled rule on given probabilities: target_probs [n+1, vocab], row 0 after the root, row i+1 after
    node i (after the request's temperature / top-k / top-p); the tree's draft_probs, if any, are q."""
    _check_rows(target_probs, len(tree) + 1, "target_probs")
    if tree.draft_probs is not None:
        if not tree.is_chain:
            raise ValueError("trees with draft probabilities are not supported; verify a chain")
        _check_rows(tree.draft_probs, len(tree), "draft_probs")

    def choose(node: int) -> int:
        p, child = target_probs[node + 1], draft_child(tree, node)
        if child is None:
            return _draw(p, generator)
        assert tree.draft_probs is not None  # draft_child finds a child only in a tree with draft probabilities
        return accept_or_resample(p, tree.draft_probs[child], tree.tokens[child], generator, threshold)[1]

    return walk(tree, choose)


def accept_or_resample(
    p: torch.Tensor,
    q: Optional[torch.Tensor],
    token: int,
    generator: Optional[torch.Generator],
    threshold: Optional[float] = None,
) -> tuple[bool, int]:
    """One step of rejection sampling for draft `token` (drawn from q; None: deterministic): (accepted, the token
    to commit). With a `threshold` the draft is kept when min(1, p/q) reaches it (a fixed rule, as TensorRT-LLM's
    acceptance threshold) instead of against a uniform draw; a rejection draws from norm(max(0, p - q)) either way.
    `generator` None: torch's default generator."""
    if threshold is None:
        accepted = _accept(p, q, token, generator)
    else:
        proposal = 1.0 if q is None else float(q[token])
        accepted = proposal > 0.0 and min(1.0, float(p[token]) / proposal) >= threshold
    return (True, token) if accepted else (False, _draw(_residual(p, q, token), generator))


def _accept(p: torch.Tensor, q: Optional[torch.Tensor], token: int, generator: Optional[torch.Generator]) -> bool:
    target = float(p[token])
    proposal = 1.0 if q is None else float(q[token])
    if proposal <= 0.0:  # the draft could not have produced this token; never trust it
        return False
    u = float(torch.rand((), generator=generator))
    return u < min(1.0, target / proposal)


def _residual(p: torch.Tensor, q: Optional[torch.Tensor], token: int) -> torch.Tensor:
    """norm(max(0, p - q)); q None means one-hot at `token`."""
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = float(residual.sum())
    if total <= 0.0:  # only when p == q up to rounding, where rejection has probability ~0; p is then right
        return p
    return residual / total


def _draw(probs: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    return int(torch.multinomial(probs.float(), 1, generator=generator)[0])


def _check_rows(tensor: torch.Tensor, rows: int, name: str) -> None:
    if tensor.dim() != 2 or tensor.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows}, vocab], got {list(tensor.shape)}")
