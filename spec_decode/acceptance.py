"""Verification: which draft tokens the target accepts, and the one token it adds after them.

Inputs are the target's outputs at the root and at every draft node of one forward (row 0 = root, row i+1 =
node i): argmax tokens for greedy requests, probabilities (after the request's temperature / top-k / top-p) for
sampled ones. Every function returns `Verdict(accepted_nodes, tokens)`: the accepted node indices along one
root-to-node path and the tokens to commit (the accepted drafts plus one target token), so a step always makes
progress.

Greedy acceptance is exact: the output equals plain greedy decoding. Sampling uses rejection sampling (Leviathan
et al. 2023; Chen et al. 2023), which keeps the target distribution: a draft token d drawn from q is accepted with
probability min(1, p(d)/q(d)); on rejection the token is drawn from norm(max(0, p - q)); after a fully accepted
chain the extra token is drawn from p. Drafts without probabilities (n-gram, lookahead, argmax heads) are
one-hot q: d is accepted with probability p(d), else drawn from p with d removed. On a tree the children of a
node are tried in turn, each rejection removing that child's token from p (again exact for one-hot drafts)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .tree import DraftTree


@dataclass
class Verdict:
    accepted_nodes: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_nodes)


# ---- greedy ---------------------------------------------------------------------------------------------------

def greedy_accept(tree: DraftTree, target_tokens: Sequence[int]) -> Verdict:
    """`target_tokens[0]` is the target's argmax after the root, `target_tokens[i+1]` after node i. Follows the
    child whose token equals the target's choice while one exists (the longest accepted path)."""
    if len(target_tokens) != len(tree) + 1:
        raise ValueError(f"need {len(tree) + 1} target tokens for {len(tree)} draft nodes, got {len(target_tokens)}")
    children = _children_by_token(tree)
    accepted: list[int] = []
    node = -1
    while True:
        wanted = int(target_tokens[node + 1])
        child = children.get((node, wanted))
        if child is None:
            return Verdict(accepted, [tree.tokens[i] for i in accepted] + [wanted])
        accepted.append(child)
        node = child


def _children_by_token(tree: DraftTree) -> dict[tuple[int, int], int]:
    index: dict[tuple[int, int], int] = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        index.setdefault((parent, token), i)  # a duplicate sibling can never be reached first
    return index


# ---- sampling -------------------------------------------------------------------------------------------------

def rejection_sample_chain(draft_tokens: Sequence[int], target_probs: torch.Tensor,
                           draft_probs: Optional[torch.Tensor], generator: torch.Generator) -> Verdict:
    """target_probs: [k+1, vocab] (row i = after i drafts); draft_probs: [k, vocab], the distributions the drafts
    were drawn from, or None for deterministic drafts."""
    k = len(draft_tokens)
    _check_rows(target_probs, k + 1, "target_probs")
    if draft_probs is not None:
        _check_rows(draft_probs, k, "draft_probs")
    accepted: list[int] = []
    for i, token in enumerate(draft_tokens):
        p = target_probs[i]
        q = None if draft_probs is None else draft_probs[i]
        if _accept(p, q, int(token), generator):
            accepted.append(i)
            continue
        return Verdict(accepted, list(draft_tokens[:i]) + [_draw(_residual(p, q, int(token)), generator)])
    return Verdict(accepted, list(draft_tokens) + [_draw(target_probs[k], generator)])


def rejection_sample_tree(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """Deterministic drafts on a tree; target_probs: [n+1, vocab], row 0 after the root, row i+1 after node i."""
    if tree.draft_probs is not None and not tree.is_chain:
        raise ValueError("trees with draft probabilities are not supported; verify a chain")
    _check_rows(target_probs, len(tree) + 1, "target_probs")
    accepted: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1].clone()
        child = _accept_one_child(tree, node, p, generator)
        if child is None:
            tokens = [tree.tokens[i] for i in accepted]
            return Verdict(accepted, tokens + [_draw(p, generator)])
        accepted.append(child)
        node = child


def _accept_one_child(tree: DraftTree, node: int, p: torch.Tensor, generator: torch.Generator) -> Optional[int]:
    """Try the children in order; each rejected child's token is removed from `p` (in place, renormalised)."""
    for child in tree.children(node):
        token = tree.tokens[child]
        if _accept(p, None, token, generator):
            return child
        p.copy_(_residual(p, None, token))
    return None


def accept_or_resample(p: torch.Tensor, q: Optional[torch.Tensor], token: int, generator: torch.Generator,
                       threshold: Optional[float] = None) -> tuple[bool, int]:
    """One step of rejection sampling for draft `token` (drawn from q; None: deterministic): (accepted, the token
    to commit). With a `threshold` the draft is kept when min(1, p/q) reaches it (a fixed rule, as TensorRT-LLM's
    acceptance threshold) instead of against a uniform draw; a rejection draws from norm(max(0, p - q)) either way."""
    if threshold is None:
        accepted = _accept(p, q, token, generator)
    else:
        proposal = 1.0 if q is None else float(q[token])
        accepted = proposal > 0.0 and min(1.0, float(p[token]) / proposal) >= threshold
    return (True, token) if accepted else (False, _draw(_residual(p, q, token), generator))


def _accept(p: torch.Tensor, q: Optional[torch.Tensor], token: int, generator: torch.Generator) -> bool:
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


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.float(), 1, generator=generator)[0])


def _check_rows(tensor: torch.Tensor, rows: int, name: str) -> None:
    if tensor.dim() != 2 or tensor.shape[0] != rows:
        raise ValueError(f"{name} must be [{rows}, vocab], got {list(tensor.shape)}")
