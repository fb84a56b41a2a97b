"""Fills one token budget per step (vLLM v1's rule): every scheduled sequence's computed tokens catch up with its
known tokens. Running sequences go first (a decode is one token, a chunked prefill a slice of its prompt), then
waiting ones are admitted by priority (request `priority`, higher first), then arrival order, while the batch, the
token budget and the KV cache allow. A decode's speculative draft rides along in the budget that is left once
every later running sequence has its token: cut to its first nodes, or dropped where it cannot be cut.

When blocks run out, the most recently admitted running sequence of the lowest priority is preempted: its blocks
are freed and it goes back to the front of the queue to be recomputed. With GUARANTEED_NO_EVICT a sequence is
admitted only when blocks for its whole output are available on top of what the running ones may still need, so
preemption does not happen; MAX_UTILIZATION admits as soon as the prompt fits."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, blocks_for
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def phase(self) -> str:
        """ "prefill" when some sequence still computes prompt tokens, else "decode" (a profile's step label)."""
        if any(seq.num_computed_tokens < len(seq.prompt_token_ids) for seq in self.seqs):
            return "prefill"
        return "decode"

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_tokens)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_batch_size: int,
        max_num_tokens: int,
        enable_chunked_prefill: bool,
        guaranteed_no_evict: bool,
        max_loras: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_loras = max_loras  # distinct LoRA adapters among running sequences (so in any step)
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.guaranteed_no_evict = guaranteed_no_evict
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue `seq` behind every waiting sequence of the same or higher priority (FIFO within a priority)."""
        for position, queued in enumerate(self.waiting):
            if queued.priority < seq.priority:
                self.waiting.insert(position, seq)
                return
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_tokens)
        if not batch.preempted:
            self._admit_waiting(batch, budget)
        if batch.is_empty and self.waiting and self.running and not any(s.pending_tokens for s in self.running):
            self._requeue_stalled()
            self._admit_waiting(batch, self.max_num_tokens)
        return batch

    def _requeue_stalled(self) -> None:
        """Every running sequence is a beam waiting for sibling beams that wait for blocks the running ones hold.
        Send them all back and queue every waiting sequence by request, oldest first, so that the oldest beam
        search gets all its beams in (one always fits: the engine checks that) and moves on."""
        for seq in list(self.running):
            self.running.remove(seq)
            self.block_manager.free(seq)
            seq.context_logits.clear()
            seq.status = SequenceStatus.WAITING
            seq.metrics.num_preemptions += 1
            self.waiting.append(seq)
        self.waiting = deque(
            sorted(self.waiting, key=lambda s: (-s.priority, s.metrics.arrival_time_ns, s.request_id, s.index))
        )

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        running = [seq for seq in self.running if seq.status is SequenceStatus.RUNNING]
        for position, seq in enumerate(running):
            # Preempted for an earlier one, or its last token is sampled and on its way (overlap scheduler).
            if budget <= 0 or seq.status is not SequenceStatus.RUNNING or seq.final_pending:
                continue
            if seq.draft is None and seq.num_tokens - seq.num_computed_tokens == 1:
                num_tokens = 1  # a plain decode, the common case: its one token
            else:  # a draft is an optional extra: it may not take the one token each later running one needs
                num_tokens = self._tokens_to_schedule(
                    seq, budget, first=batch.is_empty, draft_budget=budget - (len(running) - position - 1)
                )
            if num_tokens == 0:
                continue
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + num_tokens, batch):
                continue
            batch.add(seq, num_tokens)
            budget -= num_tokens
        return budget

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        while not self.block_manager.grow(seq, num_tokens):
            # The most recently admitted of the lowest priority gives its blocks back.
            victim = min(reversed(self.running), key=lambda s: s.priority)
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        if seq in batch.seqs:
            position = batch.seqs.index(seq)
            del batch.seqs[position], batch.num_new_tokens[position]
        self.block_manager.free(seq)
        seq.draft = None
        seq.context_logits.clear()  # recomputed with the prompt
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if seq.pending_tokens:  # preempted before its last sampled token reached the host: wait for it
                break
            # Context logits need every prompt position computed, so such a request reuses nothing.
            reusable = not seq.block_table and not seq.params.return_context_logits
            matched = manager.match_prefix(seq, seq.cache_key) if reusable else []
            computed = len(matched) * manager.block_size if matched else seq.num_computed_tokens
            num_tokens = self._tokens_to_schedule(seq, budget, first=batch.is_empty, computed=computed)
            if num_tokens == 0 or not self._fits(seq, computed + num_tokens, matched) or not self._adapter_fits(seq):
                break
            if matched:
                manager.reuse(seq, matched)
            manager.grow(seq, seq.num_computed_tokens + num_tokens)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_tokens)
            budget -= num_tokens

    def _tokens_to_schedule(
        self, seq: Sequence, budget: int, first: bool, computed: int | None = None, draft_budget: int | None = None
    ) -> int:
        known = seq.num_tokens - (seq.num_computed_tokens if computed is None else computed)
        room = (budget if draft_budget is None else min(budget, draft_budget)) - known
        if seq.draft is not None and seq.num_draft_tokens > room:
            seq.draft = seq.draft.truncated(room)  # cut to the room left, or None where it cannot be cut
        wanted = known + seq.num_draft_tokens
        if wanted <= budget:
            return wanted
        if self.enable_chunked_prefill:
            return budget
        # Without chunking a prompt runs whole; one that outgrew the budget (recompute after preemption) may
        # still run alone, or it would never run again.
        return wanted if first else 0

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether admitting `seq` keeps the running sequences within `max_loras` distinct adapters."""
        key = seq.adapter_key
        if key is None or self.max_loras is None:
            return True
        running = {s.adapter_key for s in self.running if s.adapter_key is not None}
        return key in running or len(running) < self.max_loras

    def _fits(self, seq: Sequence, num_tokens: int, matched: list[int]) -> bool:
        """Whether `seq` can be admitted to hold `num_tokens` tokens, starting from the `matched` cached blocks."""
        manager = self.block_manager
        free = manager.num_free_after_reuse(matched)
        target = seq.max_total_tokens if self.guaranteed_no_evict else num_tokens
        needed = max(0, blocks_for(target, manager.block_size) - len(seq.block_table) - len(matched))
        if self.guaranteed_no_evict:
            needed += sum(manager.blocks_needed(s, s.max_total_tokens) for s in self.running)
        return needed <= free
