"""Block manager and scheduler logic, without a model."""

import pytest

from tritonllm.engine.embedded.block_manager import BlockManager
from tritonllm.engine.embedded.scheduler import Scheduler
from tritonllm.engine.embedded.sequence import Sequence, SequenceStatus
from tritonllm.engine.types import SamplingParams


def make_seq(seq_id, prompt_len, max_tokens=4):
    return Sequence(seq_id, seq_id, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens))


def run_step(scheduler, sample_token=7):
    """Mimic the engine: advance computed tokens and append a token where a sample happens."""
    batch = scheduler.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(sample_token)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                seq.status = SequenceStatus.FINISHED
                scheduler.remove(seq)
    return batch


def test_block_manager_grow_and_free_returns_every_block():
    manager = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(0, 5)
    assert manager.grow(seq, 5) and len(seq.block_table) == 2
    assert manager.grow(seq, 8) and len(seq.block_table) == 2  # still fits
    assert not manager.grow(seq, 17) and len(seq.block_table) == 2  # needs 5 blocks: nothing changes
    manager.free(seq)
    assert manager.num_free_blocks == 4 and seq.block_table == []


def test_prefill_and_decode_share_one_step_budget():
    manager = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(
        manager, max_batch_size=8, max_num_tokens=16, enable_chunked_prefill=False, guaranteed_no_evict=False
    )
    first = make_seq(0, 10)
    scheduler.add(first)
    assert run_step(scheduler).num_new_tokens == [10]
    second, third = make_seq(1, 6), make_seq(2, 9)
    scheduler.add(second)
    scheduler.add(third)
    batch = run_step(scheduler)
    # first decodes 1 token (15 left), second prefills 6 (9 left), third prefills exactly the remaining 9
    assert batch.seqs == [first, second, third] and batch.num_new_tokens == [1, 6, 9]


def test_waiting_prompt_over_remaining_budget_waits_without_chunking():
    manager = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(manager, 8, 12, enable_chunked_prefill=False, guaranteed_no_evict=False)
    a, b = make_seq(0, 10), make_seq(1, 8)
    scheduler.add(a)
    scheduler.add(b)
    assert run_step(scheduler).seqs == [a]
    assert run_step(scheduler).seqs == [a, b]


def test_chunked_prefill_splits_a_long_prompt():
    manager = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(manager, 8, 8, enable_chunked_prefill=True, guaranteed_no_evict=False)
    seq = make_seq(0, 20)
    scheduler.add(seq)
    counts = [run_step(scheduler).num_new_tokens for _ in range(3)]
    assert counts == [[8], [8], [4]] and seq.output_token_ids == [7]


def test_max_batch_size_limits_running_sequences():
    manager = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(
        manager, max_batch_size=2, max_num_tokens=100, enable_chunked_prefill=False, guaranteed_no_evict=False
    )
    seqs = [make_seq(i, 3) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert run_step(scheduler).seqs == seqs[:2]


def test_preemption_when_blocks_run_out_then_resume():
    manager = BlockManager(num_blocks=4, block_size=2)
    scheduler = Scheduler(manager, 8, 100, enable_chunked_prefill=False, guaranteed_no_evict=False)
    a, b = make_seq(0, 3, max_tokens=3), make_seq(1, 3, max_tokens=3)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)  # both prefilled: 2 blocks each, all 4 used
    batch = run_step(scheduler)  # a needs a 3rd block at 5 tokens? a has 4 tokens -> needs blocks for 4: fits
    batch = run_step(scheduler)  # now 5 tokens each: one must be preempted
    assert b in batch.preempted and b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    while scheduler.has_work:
        run_step(scheduler)
    assert len(a.output_token_ids) == 3 and len(b.output_token_ids) == 3
    assert manager.num_free_blocks == 4


def test_guaranteed_no_evict_admits_only_what_can_finish():
    manager = BlockManager(num_blocks=4, block_size=2)
    scheduler = Scheduler(manager, 8, 100, enable_chunked_prefill=False, guaranteed_no_evict=True)
    a, b = make_seq(0, 3, max_tokens=3), make_seq(1, 3, max_tokens=3)  # each needs 3 blocks at its end
    scheduler.add(a)
    scheduler.add(b)
    assert run_step(scheduler).seqs == [a]
    preempted = []
    while scheduler.has_work:
        preempted += run_step(scheduler).preempted
    assert preempted == [] and manager.num_free_blocks == 4


@pytest.mark.parametrize("chunked", [False, True])
def test_remove_frees_blocks_of_waiting_and_running(chunked):
    manager = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(manager, 8, 8, enable_chunked_prefill=chunked, guaranteed_no_evict=False)
    a, b = make_seq(0, 12), make_seq(1, 4)
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler)
    scheduler.remove(a)
    scheduler.remove(b)
    assert manager.num_free_blocks == 16 and not scheduler.has_work


def make_prioritised(seq_id, priority, prompt_len=4):
    return Sequence(seq_id, seq_id, 0, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=2, priority=priority))


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    manager = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(
        manager, max_batch_size=1, max_num_tokens=64, enable_chunked_prefill=False, guaranteed_no_evict=False
    )
    low, default, high, default_later = (
        make_prioritised(0, 0.1),
        make_prioritised(1, None),
        make_prioritised(2, 0.9),
        make_prioritised(3, 0.5),
    )
    for seq in (low, default, high, default_later):
        scheduler.add(seq)
    order = []
    while scheduler.has_work:
        batch = run_step(scheduler)
        order += [s.seq_id for s in batch.seqs if s.seq_id not in order]
    assert order == [2, 1, 3, 0]


def test_preemption_takes_the_lowest_priority_first():
    manager = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(
        manager, max_batch_size=8, max_num_tokens=64, enable_chunked_prefill=False, guaranteed_no_evict=False
    )
    low, high = make_prioritised(0, 0.2, prompt_len=8), make_prioritised(1, 0.8, prompt_len=8)
    scheduler.add(high)
    scheduler.add(low)
    run_step(scheduler)  # both admitted: 2 blocks each, the cache is full
    assert scheduler.running == [high, low]
    batch = run_step(scheduler)  # both need a third block: the low-priority one gives its blocks back
    assert batch.preempted == [low] and batch.seqs == [high]


def decoding_with_drafts(num_seqs, draft_len, max_num_tokens, window=()):
    """A scheduler whose `num_seqs` sequences have their prompts computed and each a draft chain of `draft_len`."""
    from tritonllm.engine.embedded.speculation.methods import StepDraft
    from tritonllm.spec_decode.tree import DraftTree

    scheduler = Scheduler(
        BlockManager(num_blocks=64, block_size=4),
        max_batch_size=8,
        max_num_tokens=max_num_tokens,
        enable_chunked_prefill=False,
        guaranteed_no_evict=False,
    )
    seqs = [make_seq(i, 2, max_tokens=16) for i in range(num_seqs)]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler)  # prefill; each has one known, uncomputed token now
    for seq in seqs:
        seq.draft = StepDraft(DraftTree.chain(range(100, 100 + draft_len)), window=list(window))
    return scheduler, seqs


def test_a_draft_over_the_budget_is_cut_to_what_is_left():
    scheduler, (seq,) = decoding_with_drafts(1, draft_len=6, max_num_tokens=4)
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [4] and seq.draft.tree.tokens == [100, 101, 102]


def test_drafts_leave_every_later_running_sequence_its_token():
    scheduler, (a, b, c) = decoding_with_drafts(3, draft_len=6, max_num_tokens=8)
    batch = scheduler.schedule()
    # a keeps 5 draft tokens (1 + 5), leaving one token each for b and c, whose drafts go
    assert batch.seqs == [a, b, c] and batch.num_new_tokens == [6, 1, 1]
    assert len(a.draft.tree) == 5 and b.draft is None and c.draft is None


def test_a_lookahead_draft_that_does_not_fit_is_dropped_not_cut():
    scheduler, (seq,) = decoding_with_drafts(1, draft_len=2, max_num_tokens=4, window=[7, 8])
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [1] and seq.draft is None
