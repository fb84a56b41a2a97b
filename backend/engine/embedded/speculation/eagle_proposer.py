"""EAGLE speculation: the draft layer (eagle.py, or eagle3.py) with its own one-layer paged KV cache, fed with the
target's final-norm hidden states (EAGLE-1/2) or the outputs of some of its layers (EAGLE-3, whose draft maps them
through its `fc` and scores drafts with its own head).

Each target sequence has a shadow here whose KV slot k holds draft position `first_position + k`; draft position
j is computed from (token j + 1, the target's hidden state at j). The engine hands over the hidden state of every
position it computes (prompt chunks, plain decode rows, verification roots) and of every accepted draft node
(`observe`); they wait as `pending` until the next proposal. Proposing first computes the pending positions (the
stable KV: only ever built from the target's hidden states), whose last row gives the root's draft distribution,
then feeds the drafted tree depth by depth (each node with its parent's draft-layer output as feature) in slots
after the stable ones, which are dropped again once the tree is built: rejected drafts leave nothing behind. A
depth whose fed nodes form a chain is fed causally, one new node; otherwise every fed node is fed again under its
ancestor mask (attention's tail masks cover whole query tails), which costs a few rows on small trees.

A shadow starts at the first position it sees a hidden state for (0, or the end of a reused prefix: the draft then
attends to a shorter context). A sequence that is preempted or finishes is forgotten; one whose positions stop
lining up with the shadow's (anything unexpected) starts a new shadow. None of this affects what the target
commits: drafts are only proposals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional
from typing import Sequence as Seq

import torch

from tritonllm.spec_decode.proposer import ProposalInput, draft_budget
from tritonllm.spec_decode.tree import DraftTree, TreeTemplate

from ...types import SamplingParams
from ..attention import step_metadata, zero_blocks
from ..block_manager import BlockManager
from ..sequence import Sequence
from .methods import ProposerMethod

_SHADOW_PARAMS = SamplingParams(max_tokens=1)


@dataclass(eq=False)
class _Shadow:
    slots: Sequence  # holds the block table; num_computed_tokens = stable KV slots
    first_position: int
    pending: list[torch.Tensor] = field(default_factory=list)  # target hidden rows for the positions after
    num_pending: int = 0

    @property
    def num_stable(self) -> int:
        return self.slots.num_computed_tokens

    @property
    def next_position(self) -> int:
        """The position whose target hidden state comes next."""
        return self.first_position + self.num_stable + self.num_pending


@dataclass(eq=False)
class _Plan:
    """One sequence's proposal in progress. Static trees know their nodes' ranks (`paths`) up front and take each
    token from its parent's top-k; dynamic trees add nodes with explicit tokens and scores as they grow."""

    shadow: _Shadow
    tokens: list[int]  # the committed tokens
    paths: list[tuple[int, ...]]  # static: tree nodes (ranks from the root), parents first
    parents: list[int]
    depths: list[int] = field(default_factory=list)
    budget: int = 0  # dynamic: the most nodes the final tree may keep
    node_tokens: list[int] = field(default_factory=list)  # dynamic: each node's token
    scores: list[float] = field(default_factory=list)  # dynamic: each node's cumulative draft log-probability
    fed: list[int] = field(default_factory=list)  # nodes fed so far, in slot order
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # node (-1 = root) -> draft-layer output
    top: dict[int, list[int]] = field(default_factory=dict)  # node (-1 = root) -> its top-k draft tokens

    def __post_init__(self) -> None:
        if not self.depths:
            self.depths = [len(path) for path in self.paths]

    def node_token(self, node: int) -> int:
        if self.node_tokens:
            return self.node_tokens[node]
        return self.top[self.parents[node]][self.paths[node][-1]]

    def add(self, token: int, parent: int, score: float) -> int:
        self.node_tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(score)
        return len(self.node_tokens) - 1

    def ancestors(self, node: int) -> set[int]:
        found = set()
        while node >= 0:
            found.add(node)
            node = self.parents[node]
        return found

    @property
    def root_position(self) -> int:
        return len(self.tokens) - 1


class EagleProposer:
    """Proposes a chain of `max_draft_len` tokens (top-1 at each depth), the `eagle_choices` tree (each node's
    children are the top-k of its own draft-layer output), or with `dynamic_top_k` EAGLE-2's dynamic tree: each
    depth expands the top-k children of the k best nodes of the depth before (by cumulative draft
    log-probability), `max_draft_len` deep, and the `total_tokens` best nodes overall are drafted."""

    def __init__(
        self,
        draft,
        target,
        max_draft_len: int,
        choices,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        dynamic_top_k: Optional[int] = None,
        total_tokens: Optional[int] = None,
    ):
        self.draft = draft
        self.target = target  # the target model: its embedding and LM head
        self.head = draft.make_head(target)  # the target's LM head (EAGLE-1/2) or the draft's own (EAGLE-3)
        paths = [tuple(p) for p in choices] if choices else [(0,) * depth for depth in range(1, max_draft_len + 1)]
        self.template = TreeTemplate.from_choices(paths)
        self.max_nodes = len(self.template.paths)
        self.dynamic_top_k = dynamic_top_k
        self.max_depth = max_draft_len
        if dynamic_top_k:
            self.max_nodes = total_tokens or dynamic_top_k * max_draft_len
        self.blocks = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.device = device
        config = draft.config
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_cache = (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        self.shadows: dict[int, _Shadow] = {}

    # -- hidden states from the engine ------------------------------------------------------------------------

    def observe(self, seq_id: int, position: int, hidden: torch.Tensor) -> None:
        """The target's final-norm hidden states of positions `position ...` (rows of `hidden`)."""
        if hidden.shape[0] == 0:
            return
        shadow = self.shadows.get(seq_id)
        if shadow is not None and not shadow.first_position <= position <= shadow.next_position:
            self.release(seq_id)  # a gap, or a restart before the shadow's start: begin again
            shadow = None
        if shadow is None:
            slots = Sequence(seq_id, seq_id, 0, [], _SHADOW_PARAMS)
            shadow = self.shadows[seq_id] = _Shadow(slots, position)
        skip = shadow.next_position - position  # rows already held (a recomputed prefix)
        if skip < hidden.shape[0]:
            shadow.pending.append(hidden[skip:])
            shadow.num_pending += hidden.shape[0] - skip

    def retain(self, seq_ids: set[int]) -> None:
        """Forget the shadows of sequences not running (preempted ones are recomputed from scratch)."""
        for seq_id in [s for s in self.shadows if s not in seq_ids]:
            self.release(seq_id)

    def release(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id, None)
        if shadow is not None:
            self.blocks.free(shadow.slots)

    # -- proposing --------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, batch: Seq[ProposalInput]) -> list[DraftTree]:
        plans = [self._plan(item) for item in batch]
        active = [plan for plan in plans if plan is not None]
        if active:
            self._catch_up(active)
            if self.dynamic_top_k:
                self._grow_dynamic(active)
            else:
                for depth in range(1, max(plan.depths[-1] for plan in active)):
                    feeding = [(plan, nodes) for plan in active for nodes in [self._feed_list(plan, depth)] if nodes]
                    if feeding:
                        outputs = self._feed([plan for plan, _ in feeding], [nodes for _, nodes in feeding])
                        tops = iter(self._top_k(torch.cat(outputs)))
                        for (plan, nodes), out in zip(feeding, outputs):
                            for node, hidden in zip(nodes, out):
                                plan.outputs[node], plan.top[node] = hidden, next(tops)
            for plan in active:  # the drafted slots are dropped: only the stable KV stays
                self.blocks.trim(plan.shadow.slots, plan.shadow.num_stable)
        return [DraftTree() if plan is None else self._tree(plan) for plan in plans]

    def _tree(self, plan: _Plan) -> DraftTree:
        if not self.dynamic_top_k:
            return DraftTree([plan.node_token(i) for i in range(len(plan.paths))], list(plan.parents))
        # The best nodes by score (a child never scores above its parent, and ties go to the shallower node, so
        # every kept node's parent is kept), then ordered by depth so that parents come first.
        best = sorted(range(len(plan.scores)), key=lambda n: (-plan.scores[n], plan.depths[n], n))[: plan.budget]
        kept = sorted(best, key=lambda n: (plan.depths[n], n))
        index = {node: i for i, node in enumerate(kept)}
        return DraftTree(
            [plan.node_tokens[n] for n in kept], [-1 if plan.parents[n] < 0 else index[plan.parents[n]] for n in kept]
        )

    def _grow_dynamic(self, plans: list[_Plan]) -> None:
        """EAGLE-2: the root's top-k, then per depth the top-k children of the k best nodes of the last depth."""
        k = self.dynamic_top_k
        assert k is not None  # called for dynamic trees only
        frontier = {}
        values, indices = self._log_top_k(torch.stack([plan.outputs[-1] for plan in plans]), k)
        for plan, scores, tokens in zip(plans, values, indices):
            frontier[id(plan)] = [plan.add(t, -1, v) for v, t in zip(scores, tokens)]
        for _ in range(1, self.max_depth):
            outputs = self._feed(plans, [frontier[id(plan)] for plan in plans])
            values, indices = self._log_top_k(torch.cat(outputs), k)
            row = 0
            for plan in plans:
                children = []
                for node in frontier[id(plan)]:
                    children += [plan.add(t, node, plan.scores[node] + v) for v, t in zip(values[row], indices[row])]
                    row += 1
                frontier[id(plan)] = sorted(children, key=lambda n: -plan.scores[n])[:k]

    def _plan(self, item: ProposalInput) -> Optional[_Plan]:
        budget = draft_budget(self.max_nodes, item)
        shadow = self.shadows.get(item.seq_id)
        tokens = list(item.token_ids)
        if budget <= 0 or shadow is None:
            return None
        if shadow.next_position != len(tokens) - 1 or shadow.num_pending == 0:
            self.release(item.seq_id)  # out of step with the target (should not happen): start again later
            return None
        if self.dynamic_top_k:
            paths, parents = [], []
            fed = self.dynamic_top_k * (self.max_depth - 1)
        else:
            paths = list(self.template.paths[:budget])
            parents = list(self.template.parents[:budget])
            has_children = set(parents)
            fed = sum(1 for i in range(len(paths)) if i in has_children)
        if not self.blocks.grow(shadow.slots, shadow.num_stable + shadow.num_pending + fed):
            self.release(item.seq_id)  # the draft cache is full: this sequence decodes plainly
            return None
        return _Plan(shadow, tokens, paths, parents, budget=budget)

    def _feed_list(self, plan: _Plan, depth: int) -> list[int]:
        """Nodes at `depth` whose draft-layer output is needed (those with children)."""
        has_children = set(plan.parents)
        return [i for i, node_depth in enumerate(plan.depths) if node_depth == depth and i in has_children]

    def _catch_up(self, plans: list[_Plan]) -> None:
        """Compute every pending position (causal, into stable slots); the last row drafts the root's children."""
        rows = []
        for plan in plans:
            shadow = plan.shadow
            start = shadow.first_position + shadow.num_stable
            end = start + shadow.num_pending  # == root position
            features = torch.cat(shadow.pending) if len(shadow.pending) > 1 else shadow.pending[0]
            rows.append(
                _Rows(plan, plan.tokens[start + 1 : end + 1], features, list(range(start, end)), shadow.num_stable)
            )
        outputs = self._forward(rows)
        last = torch.stack([out[-1] for out in outputs])
        top = self._top_k(last)
        for row, out, candidates in zip(rows, outputs, top):
            plan, shadow = row.plan, row.plan.shadow
            shadow.slots.num_computed_tokens += shadow.num_pending
            shadow.pending, shadow.num_pending = [], 0
            plan.outputs[-1], plan.top[-1] = out[-1], candidates

    def _feed(self, plans: list[_Plan], new_nodes: list[list[int]]) -> list[torch.Tensor]:
        """Feed each plan's `new_nodes` (one depth); returns their draft-layer outputs, per plan."""
        rows = []
        for plan, nodes in zip(plans, new_nodes):
            fed = plan.fed + nodes
            # Earlier fed nodes that are all ancestors of the new ones (a chain): feed only the new node, causally.
            # Otherwise refeed every fed node with the tree's mask among them (their slots are rewritten alike).
            chain = len(nodes) == 1 and set(plan.fed) <= plan.ancestors(nodes[0])
            feed = nodes if chain else fed
            first_slot = plan.shadow.num_stable + (len(plan.fed) if chain else 0)
            tokens = [plan.node_token(n) for n in feed]
            features = torch.stack([plan.outputs[plan.parents[n]] for n in feed])
            positions = [plan.root_position - 1 + plan.depths[n] for n in feed]
            mask = None if chain else _ancestor_mask(plan, feed)
            rows.append(_Rows(plan, tokens, features, positions, first_slot, mask))
            plan.fed = fed
        outputs = self._forward(rows)
        new_outputs = [out[-len(nodes) :] for out, nodes in zip(outputs, new_nodes)]  # new nodes come last
        for plan, nodes, out in zip(plans, new_nodes, new_outputs):
            for node, hidden in zip(nodes, out):
                plan.outputs[node] = hidden
        return new_outputs

    def _log_top_k(self, hidden: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
        logits = self.head.logits(hidden)
        values, indices = torch.log_softmax(logits, dim=-1).topk(min(k, logits.shape[-1]), dim=-1)
        return values.tolist(), self.head.token_ids(indices).tolist()

    def _top_k(self, hidden: torch.Tensor) -> list[list[int]]:
        logits = self.head.logits(hidden)
        indices = logits.topk(min(self.template.max_rank, logits.shape[-1]), dim=-1).indices
        return self.head.token_ids(indices).tolist()

    def _forward(self, rows: list["_Rows"]) -> list[torch.Tensor]:
        """One draft-layer forward over every sequence's rows; returns each one's output rows."""
        zero_blocks(self.kv_cache, self.blocks.take_newly_allocated())
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        contexts: list[int] = []
        masks: list[Optional[torch.Tensor]] = []
        bs = self.block_size
        for row in rows:
            table = row.plan.shadow.slots.block_table
            starts.append(len(ids))
            ids += row.tokens
            positions += row.positions
            slots += [table[s // bs] * bs + s % bs for s in range(row.first_slot, row.first_slot + len(row.tokens))]
            lens.append(len(row.tokens))
            contexts.append(row.first_slot + len(row.tokens))
            masks.append(row.mask)
        attn = step_metadata(
            slots,
            [r.plan.shadow.slots.block_table for r in rows],
            starts,
            lens,
            contexts,
            bs,
            masks,
            self.device,
            self.kv_cache[0].dtype,
        )
        embeds = self.target.embed_tokens(self._long(ids))
        features = torch.cat([row.features for row in rows])
        out = self.draft(embeds, features, self._long(positions), attn, self.kv_cache)
        return [out[start : start + n] for start, n in zip(starts, lens)]

    def _long(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


@dataclass(eq=False)
class _Rows:
    plan: _Plan
    tokens: list[int]
    features: torch.Tensor
    positions: list[int]
    first_slot: int
    mask: Optional[torch.Tensor] = None


def _ancestor_mask(plan: _Plan, nodes: list[int]) -> torch.Tensor:
    """[n, n] bool over `nodes` (in slot order): a node sees itself and its ancestors among them."""
    index = {node: i for i, node in enumerate(nodes)}
    mask = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)
    for i, node in enumerate(nodes):
        while node >= 0:
            if node in index:
                mask[i, index[node]] = True
            node = plan.parents[node]
    return mask


class EagleMethod(ProposerMethod):
    """The engine side: the target's hidden states of every computed position go to the proposer."""

    needs_all_hidden = True

    def __init__(self, proposer: EagleProposer):
        super().__init__(proposer)

    def observe_hidden(self, seq: Sequence, position: int, hidden: torch.Tensor) -> None:
        self.proposer.observe(seq.seq_id, position, hidden)

    def retain(self, seq_ids: set[int]) -> None:
        self.proposer.retain(seq_ids)
