"""EAGLE-1/2 speculation: the draft layer (tritonllm.spec_decode.eagle) with its own one-layer paged KV cache,
fed with the target's final-norm hidden states.

Each target sequence has a shadow here whose KV slot k holds draft position `first_position + k`; draft position
j is computed from (token j + 1, the target's hidden state at j). The engine hands over the hidden state of every
position it computes (prompt chunks, plain decode rows, verification roots) and of every accepted draft node
(`observe`); they wait as `pending` until the next proposal. Proposing first computes the pending positions (the
stable KV: only ever built from the target's hidden states), whose last row gives the root's draft distribution,
then feeds the drafted tree depth by depth (each node with its parent's draft-layer output as feature) in slots
after the stable ones, which are dropped again once the tree is built: rejected drafts leave nothing behind.

A shadow starts at the first position it sees a hidden state for (0, or the end of a reused prefix: the draft then
attends to a shorter context). A sequence that is preempted or finishes is forgotten; one whose positions stop
lining up with the shadow's (anything unexpected) starts a new shadow. None of this affects what the target
commits: drafts are only proposals."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence as Seq

import torch

from tritonllm.spec_decode.proposer import ProposalInput, draft_budget
from tritonllm.spec_decode.tree import DraftTree, TreeTemplate

from ..types import SamplingParams
from .attention import AttentionMetadata, build_decode_mask
from .block_manager import BlockManager, blocks_for
from .sequence import Sequence
from .spec_methods import ProposerMethod

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
    """One sequence's proposal in progress."""
    shadow: _Shadow
    tokens: list[int]  # the committed tokens
    paths: list[tuple[int, ...]]  # tree nodes (ranks from the root), parents first
    parents: list[int]
    fed: list[int] = field(default_factory=list)  # nodes fed so far, in slot order
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # node (-1 = root) -> draft-layer output
    top: dict[int, list[int]] = field(default_factory=dict)  # node (-1 = root) -> its top-k draft tokens

    def node_token(self, node: int) -> int:
        return self.top[self.parents[node]][self.paths[node][-1]]

    @property
    def root_position(self) -> int:
        return len(self.tokens) - 1


class EagleProposer:
    """Proposes a chain of `max_draft_len` tokens (top-1 at each depth) or the `eagle_choices` tree (each node's
    children are the top-k of its own draft-layer output)."""

    def __init__(self, draft, target, max_draft_len: int, choices, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.draft = draft
        self.target = target  # the target model: its embedding and LM head
        paths = [tuple(p) for p in choices] if choices else [(0,) * depth for depth in range(1, max_draft_len + 1)]
        self.template = TreeTemplate.from_choices(paths)
        self.max_nodes = len(self.template.paths)
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
            for depth in range(1, max(len(plan.paths[-1]) for plan in active)):
                feeding = [plan for plan in active if self._feed_list(plan, depth)]
                if feeding:
                    self._feed(feeding, depth)
            for plan in active:  # the drafted slots are dropped: only the stable KV stays
                self.blocks.trim(plan.shadow.slots, plan.shadow.num_stable)
        return [DraftTree() if plan is None else
                DraftTree([plan.node_token(i) for i in range(len(plan.paths))], list(plan.parents))
                for plan in plans]

    def _plan(self, item: ProposalInput) -> Optional[_Plan]:
        budget = draft_budget(self.max_nodes, item)
        shadow = self.shadows.get(item.seq_id)
        tokens = list(item.token_ids)
        if budget <= 0 or shadow is None:
            return None
        if shadow.next_position != len(tokens) - 1 or shadow.num_pending == 0:
            self.release(item.seq_id)  # out of step with the target (should not happen): start again later
            return None
        paths = list(self.template.paths[:budget])
        parents = list(self.template.parents[:budget])
        has_children = set(parents)
        fed = sum(1 for i in range(len(paths)) if i in has_children)
        if not self.blocks.grow(shadow.slots, shadow.num_stable + shadow.num_pending + fed):
            self.release(item.seq_id)  # the draft cache is full: this sequence decodes plainly
            return None
        return _Plan(shadow, tokens, paths, parents)

    def _feed_list(self, plan: _Plan, depth: int) -> list[int]:
        """Nodes at `depth` whose draft-layer output is needed (those with children)."""
        has_children = set(plan.parents)
        return [i for i, path in enumerate(plan.paths) if len(path) == depth and i in has_children]

    def _catch_up(self, plans: list[_Plan]) -> None:
        """Compute every pending position (causal, into stable slots); the last row drafts the root's children."""
        rows = []
        for plan in plans:
            shadow = plan.shadow
            start = shadow.first_position + shadow.num_stable
            end = start + shadow.num_pending  # == root position
            features = torch.cat(shadow.pending) if len(shadow.pending) > 1 else shadow.pending[0]
            rows.append(_Rows(plan, plan.tokens[start + 1:end + 1], features, list(range(start, end)),
                              shadow.num_stable))
        outputs = self._forward(rows)
        last = torch.stack([out[-1] for out in outputs])
        top = self._top_k(last)
        for row, out, candidates in zip(rows, outputs, top):
            plan, shadow = row.plan, row.plan.shadow
            shadow.slots.num_computed_tokens += shadow.num_pending
            shadow.pending, shadow.num_pending = [], 0
            plan.outputs[-1], plan.top[-1] = out[-1], candidates

    def _feed(self, plans: list[_Plan], depth: int) -> None:
        """Feed the nodes of `depth` that have children; their outputs draft the next depth."""
        rows, new_nodes = [], []
        for plan in plans:
            nodes = self._feed_list(plan, depth)
            fed = plan.fed + nodes
            # Earlier fed nodes that are all ancestors of the new ones (a chain): feed only the new node, causally.
            # Otherwise refeed every fed node with the tree's mask among them (their slots are rewritten alike).
            chain = len(nodes) == 1 and all(plan.paths[n] == plan.paths[nodes[0]][:len(plan.paths[n])]
                                            for n in plan.fed)
            feed = nodes if chain else fed
            first_slot = plan.shadow.num_stable + (len(plan.fed) if chain else 0)
            tokens = [plan.node_token(n) for n in feed]
            features = torch.stack([plan.outputs[plan.parents[n]] for n in feed])
            positions = [plan.root_position - 1 + len(plan.paths[n]) for n in feed]
            mask = None if chain else _ancestor_mask(plan, feed)
            rows.append(_Rows(plan, tokens, features, positions, first_slot, mask))
            plan.fed = fed
            new_nodes.append(nodes)
        outputs = self._forward(rows)
        new_outputs = [out[-len(nodes):] for out, nodes in zip(outputs, new_nodes)]  # new nodes come last
        tops = self._top_k(torch.cat(new_outputs))
        index = 0
        for row, nodes, out in zip(rows, new_nodes, new_outputs):
            for node, hidden in zip(nodes, out):
                row.plan.outputs[node], row.plan.top[node] = hidden, tops[index]
                index += 1

    def _top_k(self, hidden: torch.Tensor) -> list[list[int]]:
        logits = self.target.compute_logits(hidden)
        return logits.topk(min(self.template.max_rank, logits.shape[-1]), dim=-1).indices.tolist()

    def _forward(self, rows: list["_Rows"]) -> list[torch.Tensor]:
        """One draft-layer forward over every sequence's rows; returns each one's output rows."""
        self._zero(self.blocks.take_newly_allocated())
        ids, positions, slots, starts, lens, contexts, masks = [], [], [], [], [], [], []
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
        max_blocks = max(blocks_for(n, bs) for n in contexts)
        tables = [(r.plan.shadow.slots.block_table + [0] * max_blocks)[:max_blocks] for r in rows]
        attn = AttentionMetadata(slot_mapping=self._long(slots), block_tables=self._long(tables), query_starts=starts,
                                 query_lens=lens, context_lens=contexts, block_size=bs,
                                 tail_masks=masks if any(m is not None for m in masks) else None)
        if all(n == 1 for n in lens):
            attn.decode_mask = build_decode_mask(contexts, bs, max_blocks, self.device, self.kv_cache[0].dtype)
        embeds = self.target.embed_tokens(self._long(ids))
        features = torch.cat([row.features for row in rows])
        out = self.draft(embeds, features, self._long(positions), attn, self.kv_cache)
        return [out[start:start + n] for start, n in zip(starts, lens)]

    def _zero(self, blocks: list[int]) -> None:
        if blocks:  # attention reads whole blocks: no garbage may sit in their unused slots
            index = self._long(blocks)
            for cache in self.kv_cache:
                cache.index_fill_(0, index, 0)

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
