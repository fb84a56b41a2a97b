"""The Triton attention kernels equal the portable path (portable_attention) on random paged steps: whole prompts,
chunks over a cached prefix, decode rows, draft trees, GQA and MHA, odd head and block sizes, scattered block
tables. The kernels' caches hold NaN / Inf in every slot no query may see (the reference's hold finite garbage
there), so reading one is an error. On CPU the kernels run in Triton's interpreter; on CUDA compiled, with a few
larger cases and CUDA-graph capture on top."""

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonllm.engine.embedded.attention import (  # noqa: E402
    decode_kernels,
    prefill_kernels,
    step_metadata,
    write_kv,
)
from tritonllm.engine.embedded.attention import triton_kernels as tk  # noqa: E402
from tritonllm.engine.embedded.attention.portable import portable_attention  # noqa: E402
from tritonllm.engine.embedded.block_manager import blocks_for  # noqa: E402

if not CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(prefill_kernels._prefill_kernel, InterpretedFunction):
        pytest.skip(
            f"no CUDA, and the Triton kernels were compiled without TRITON_INTERPRET=1 (triton imported "
            f"first: {'triton' in sys.modules}); set TRITON_INTERPRET=1 before triton is imported",
            allow_module_level=True,
        )

DEVICE = torch.device("cuda" if CUDA else "cpu")
SCALE = 0.37
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
_long = dict(dtype=torch.long, device=DEVICE)
gpu_only = pytest.mark.skipif(not CUDA, reason="large cases and CUDA graphs need a GPU")


class Step:
    """One random paged step: sequences with `ctx_lens` cached tokens (after this step's write) whose last
    `q_lens` are this step's queries, on shuffled blocks (plus spare ones), queries packed from row `first_row`.
    `caches` are the kernels' (NaN / Inf in every slot outside a context), `ref_caches` the reference's (finite
    there); both equal everywhere else. New K/V are written into `caches` here; the reference writes its own."""

    def __init__(
        self,
        seed,
        q_lens,
        ctx_lens,
        heads,
        kv_heads,
        head_dim,
        block_size,
        dtype,
        first_row=0,
        tails=None,
        window=None,
    ):
        self.gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.ctx_lens, self.block_size, self.first_row = q_lens, ctx_lens, block_size, first_row
        self.tails = tails or [None] * len(q_lens)
        self.starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
        counts = [blocks_for(c, block_size) for c in ctx_lens]
        num_blocks = sum(counts) + 3
        order = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.tables = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
        self.slots = [
            self.slot(s, p) for s, (q_len, ctx) in enumerate(zip(q_lens, ctx_lens)) for p in range(ctx - q_len, ctx)
        ]
        hidden = torch.ones(num_blocks * block_size, dtype=torch.bool)
        # With a window, keys older than every query's window are poison too: the kernels must not read them.
        oldest = [0 if window is None else max(0, ctx - q - window + 1) for q, ctx in zip(q_lens, ctx_lens)]
        if window is not None and tails:  # a draft node sits at its root's position plus its depth
            oldest = [
                low if t is None else max(0, ctx - q - window + 1 - (q - t.shape[0]))
                for low, t, q, ctx in zip(oldest, tails, q_lens, ctx_lens)
            ]
        hidden[[self.slot(s, p) for s, ctx in enumerate(ctx_lens) for p in range(oldest[s], ctx)]] = False
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.ref_caches = [self.randn(*shape, dtype=dtype) for _ in range(2)]
        self.caches = [_poisoned(cache, hidden) for cache in self.ref_caches]
        self.q = self.randn(sum(q_lens), heads, head_dim, dtype=dtype)
        self.k, self.v = (self.randn(sum(q_lens), kv_heads, head_dim, dtype=dtype) for _ in range(2))
        write_kv(self.k, self.v, *self.caches, torch.tensor(self.slots, device=DEVICE))

    def slot(self, seq, position):
        return self.tables[seq][position // self.block_size] * self.block_size + position % self.block_size

    def randn(self, *shape, dtype):
        return torch.randn(shape, generator=self.gen).to(dtype).to(DEVICE)

    def positions(self) -> torch.Tensor:
        """[T] each query's position: its key's, or in a draft tree its root's plus its depth (mask row sum - 1)."""
        positions = []
        for q_len, ctx, tail in zip(self.q_lens, self.ctx_lens, self.tails):
            size = 0 if tail is None else tail.shape[0]
            positions += range(ctx - q_len, ctx - size)
            if tail is not None:
                positions += [ctx - size + int(row.sum()) - 1 for row in tail]
        return torch.tensor(positions, device=DEVICE)

    def reference(self, window=None) -> torch.Tensor:
        meta = step_metadata(
            self.slots,
            self.tables,
            self.starts,
            self.q_lens,
            self.ctx_lens,
            self.block_size,
            self.tails,
            DEVICE,
            self.q.dtype,
        )
        meta.positions = self.positions()
        return portable_attention(self.q, self.k, self.v, *self.ref_caches, meta, SCALE, window)

    def int_tensor(self, values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    def block_tables(self, extra_columns=1):
        """[S, W] int32, padded with 0 (one spare column: rows wider than any context)."""
        width = max(len(t) for t in self.tables) + extra_columns
        return self.int_tensor([t + [0] * (width - len(t)) for t in self.tables])

    def prefill(self, tree=None, tokens_per_seq=None, rows=None, window=None):
        """prefill_attention over this step; with tokens_per_seq=R, queries are laid out R rows a sequence
        (graph style) and the whole padded [rows, heads, head_dim] output comes back, NaN where nothing wrote."""
        heads, kv_heads = self.q.shape[1], self.caches[0].shape[2]
        if tokens_per_seq is None:
            starts = [self.first_row + s for s in self.starts]
            q = torch.cat([self.randn(self.first_row, *self.q.shape[1:], dtype=self.q.dtype), self.q])
        else:
            starts = [self.first_row + i * tokens_per_seq for i in range(len(self.q_lens))]
            q = self.randn(rows, *self.q.shape[1:], dtype=self.q.dtype)
            q[self.placement(starts)] = self.q
        tiles = tk.prefill_tiles(self.q_lens, heads, kv_heads, tokens_per_seq)
        out = torch.full_like(q, float("nan"))
        tk.prefill_attention(
            q,
            *self.caches,
            self.block_tables(),
            self.int_tensor(starts),
            self.int_tensor(self.q_lens),
            self.int_tensor(self.ctx_lens),
            SCALE,
            tuple(torch.from_numpy(t).to(DEVICE) for t in tiles),
            tree=tree,
            out=out,
            window=window,
            positions=None if window is None else torch.cat([torch.zeros(self.first_row, **_long), self.positions()]),
        )
        return out, starts

    def placement(self, starts):
        return torch.tensor(
            [start + i for start, q_len in zip(starts, self.q_lens) for i in range(q_len)], device=DEVICE
        )


def _poisoned(cache, hidden):
    """A copy of `cache` with NaN, Inf and -Inf in the slots where `hidden` (over flat slots) is set."""
    flat = cache.clone().flatten(0, 1)
    poison = torch.tensor([float("nan"), float("inf"), float("-inf")], device=cache.device).repeat(len(hidden))
    flat[hidden.to(cache.device)] = poison[: len(hidden)][hidden.to(cache.device), None, None].to(cache.dtype)
    return flat.view(cache.shape)


def assert_close(out, ref):
    error = (out.double() - ref.double()).norm() / ref.double().norm()
    assert error < TOLERANCE[ref.dtype], f"relative error {error:.2e}"


def random_tree(gen, size):
    """[size, size] bool: node i (parent before it) sees itself and its ancestors."""
    mask = torch.eye(size, dtype=torch.bool)
    for node in range(1, size):
        parent = int(torch.randint(node, (1,), generator=gen))
        mask[node] |= mask[parent]
    return mask


def random_mask(gen, size):
    """[size, size] bool, any pattern (also keys after the row), each row seeing itself."""
    return (torch.rand(size, size, generator=gen) < 0.5) | torch.eye(size, dtype=torch.bool)


PREFILL_CASES = {  # name: (q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, dtype)
    "one whole prompt": ([37], [37], 4, 2, 16, 16, torch.float32),
    "chunk over a cached prefix, MHA": ([20], [70], 4, 4, 24, 4, torch.float32),
    "prompts, chunks, decode rows, prefix-hit suffixes": (
        [13, 5, 1, 1, 9, 3],
        [13, 41, 30, 1, 25, 3],
        4,
        2,
        24,
        4,
        torch.float32,
    ),
    "GQA 14/2, head 64": ([30, 1, 17], [30, 77, 50], 14, 2, 64, 32, torch.float32),
    "GQA 16/8, head 128": ([12, 4], [12, 100], 16, 8, 128, 16, torch.float32),
    "several tiles of queries and keys": ([200, 64], [260, 64], 2, 2, 16, 16, torch.float32),
    "bf16 mixed": ([13, 5, 1, 9], [13, 41, 30, 25], 4, 2, 24, 4, torch.bfloat16),
    "bf16 GQA 14/2": ([30, 1, 17], [30, 77, 50], 14, 2, 64, 32, torch.bfloat16),
    "fp16 prompt and chunk": ([37, 6], [37, 50], 4, 2, 16, 16, torch.float16),
}


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_equals_portable(name):
    step = Step(len(name), *PREFILL_CASES[name], first_row=2)
    out, starts = step.prefill()
    assert torch.isnan(out[:2]).all()  # rows before the first sequence: no tile covers them
    assert_close(out[2:], step.reference())


TREE_CASES = {  # name: (q_lens, ctx_lens, tree sizes (0: none), arbitrary masks, heads, kv_heads, block_size, dtype)
    "tree only": ([5], [40], [5], False, 4, 2, 4, torch.float32),
    "causal queries before the tree": ([9], [30], [4], False, 4, 2, 16, torch.float32),
    "trees and plain sequences mixed": ([7, 6, 12, 1], [19, 6, 48, 33], [7, 6, 0, 0], False, 4, 2, 4, torch.float32),
    # 16 tokens a tile: tiles cut through the 40-node tree, and key tile 128.. holds tree keys
    "non-causal masks, tiles inside the tree": ([70, 9], [150, 30], [40, 5], True, 16, 2, 16, torch.float32),
    "bf16 trees, GQA 16/8": ([9, 4], [30, 20], [4, 4], False, 16, 8, 16, torch.bfloat16),
}


@pytest.mark.parametrize("name", TREE_CASES)
def test_draft_trees_equal_portable(name):
    q_lens, ctx_lens, sizes, arbitrary, heads, kv_heads, block_size, dtype = TREE_CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    make = random_mask if arbitrary else random_tree
    tails = [make(gen, n) if n else None for n in sizes]
    step = Step(len(name), q_lens, ctx_lens, heads, kv_heads, 16, block_size, dtype, tails=tails)
    out, _ = step.prefill(tree=tk.tree_masks(tails, DEVICE))
    assert_close(out, step.reference())


@pytest.mark.parametrize("heads, kv_heads, rows_per_seq", [(4, 2, 8), (16, 2, 32)])
def test_graph_tiles_zero_padding_rows_and_compute_real_ones(heads, kv_heads, rows_per_seq):
    """R rows reserved a sequence (fewer or more than a tile's tokens); the last sequence has no queries (a padding
    sequence of the graph); rows before the first sequence belong to no tile."""
    q_lens, ctx_lens = [3, rows_per_seq, 1, 0], [20, 40, 9, 1]
    tails = [None, random_tree(torch.Generator().manual_seed(1), 5), None, None]
    step = Step(rows_per_seq, q_lens, ctx_lens, heads, kv_heads, 24, 4, torch.float32, first_row=3, tails=tails)
    rows = 3 + len(q_lens) * rows_per_seq
    out, starts = step.prefill(tree=tk.tree_masks(tails, DEVICE), tokens_per_seq=rows_per_seq, rows=rows)
    real = step.placement(starts)
    assert_close(out[real], step.reference())
    padding = torch.ones(rows, dtype=torch.bool, device=DEVICE)
    padding[:3] = False
    padding[real] = False
    assert (out[padding] == 0).all()
    assert torch.isnan(out[:3]).all()


def test_int64_metadata_and_strided_queries():
    """Tables, lengths and tiles as int64 (the portable metadata's dtype); q a view into a wider projection."""

    def long(values):
        return torch.as_tensor(values, dtype=torch.long, device=DEVICE)

    def strided(q):
        wide = torch.zeros(q.shape[0], 2 * q.shape[1], q.shape[2], dtype=q.dtype, device=DEVICE)
        wide[:, : q.shape[1]] = q
        return wide[:, : q.shape[1]]

    step = Step(5, [6, 1, 4], [30, 19, 4], 4, 2, 16, 4, torch.float32)
    tiles = tuple(long(t) for t in tk.prefill_tiles(step.q_lens, 4, 2))
    out = tk.prefill_attention(
        strided(step.q),
        *step.caches,
        step.block_tables().long(),
        long(step.starts),
        long(step.q_lens),
        long(step.ctx_lens),
        SCALE,
        tiles,
    )
    assert_close(out, step.reference())
    step = Step(6, [1, 1], [30, 19], 4, 2, 16, 4, torch.float32)
    tables = step.block_tables(40).long()
    out = tk.decode_attention(strided(step.q), *step.caches, tables, long(step.ctx_lens), SCALE, tables.shape[1] * 4)
    assert_close(out, step.reference())


@pytest.mark.parametrize(
    "dtype, kv_heads, head_dim", [(torch.float32, 2, 16), (torch.bfloat16, 3, 24), (torch.bfloat16, 8, 128)]
)
def test_store_kv_equals_write_kv(dtype, kv_heads, head_dim):
    """The one-launch store puts exactly what write_kv puts where it puts it, from views of a fused qkv row, and
    nothing anywhere else (padding rows aim at a scratch slot, as in CUDA graphs)."""
    gen = torch.Generator().manual_seed(7)
    tokens, blocks, block_size = 5, 6, 4
    qkv = torch.randn(tokens, 4 + 2 * kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k, v = qkv[:, 4 : 4 + kv_heads], qkv[:, 4 + kv_heads :]
    slots = torch.tensor([3, 17, 4, 22, 23], device=DEVICE)
    caches = [torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    write_kv(k, v, *expected, slots)
    tk.store_kv(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_graph_tiles_are_static_and_cover_reserved_rows():
    tokens = tk.tokens_per_tile(16, 2)  # groups of 8 heads: 16 tokens a tile
    assert tokens == 16 and tk.tokens_per_tile(4, 4) == 128 and tk.tokens_per_tile(4, 2) == 64
    seqs, starts = tk.prefill_tiles([1, 32, 5], 16, 2, tokens_per_seq=32)
    assert seqs.tolist() == [0, 0, 1, 1, 2, 2] and starts.tolist() == [0, 16] * 3
    again = tk.prefill_tiles([7, 2, 30], 16, 2, tokens_per_seq=32)
    assert (again[0] == seqs).all() and (again[1] == starts).all()
    seqs, starts = tk.prefill_tiles([40, 0, 3], 16, 2)
    assert seqs.tolist() == [0, 0, 0, 2] and starts.tolist() == [0, 16, 32, 0]
    assert seqs.dtype == starts.dtype == "int32"


def test_tree_masks_lay_out_each_sequence_row_major():
    first, second = torch.tensor([[True, False], [True, True]]), torch.eye(3, dtype=torch.bool)
    tree = tk.tree_masks([first, None, second], DEVICE)
    assert tree.lens.tolist() == [2, 0, 3] and tree.starts.tolist() == [0, 4, 4]
    assert tree.lens.dtype == tree.starts.dtype == torch.int32
    assert tree.masks[:13].tolist() == [1, 0, 1, 1] + torch.eye(3).flatten().int().tolist()


DECODE_CASES = {  # name: (seq_lens, extra table columns, heads, kv_heads, head_dim, block_size, dtype)
    "one split, GQA 4/2": ([1, 17, 40], 1, 4, 2, 24, 4, torch.float32),
    "one sequence of one token": ([1], 0, 4, 2, 16, 4, torch.float32),
    "many splits, empty ones": ([2100, 5, 1], 1, 4, 1, 16, 32, torch.float32),
    "32 splits, short sequences": ([130, 3], 200, 2, 2, 16, 16, torch.float32),
    "MHA, head 128": ([77, 300], 1, 2, 2, 128, 32, torch.float32),
    "GQA 14/2, head 64": ([50, 129], 1, 14, 2, 64, 16, torch.float32),
    "bf16 GQA 16/8, head 128": ([33, 700], 1, 16, 8, 128, 16, torch.bfloat16),
    "bf16 split, head 24": ([1000, 64], 1, 4, 2, 24, 4, torch.bfloat16),
}


@pytest.fixture(params=[False, True], ids=["merge launch", "last split merges"])
def merging(request, monkeypatch):
    """Decode's splits merged by a launch of their own, or by the last of them to finish (MERGE_IN_LAST_SPLIT)."""
    monkeypatch.setattr(decode_kernels, "MERGE_IN_LAST_SPLIT", request.param)
    return request.param


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_equals_portable(name, merging):
    seq_lens, extra, heads, kv_heads, head_dim, block_size, dtype = DECODE_CASES[name]
    step = Step(len(name), [1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    tables = step.block_tables(extra)
    out = tk.decode_attention(
        step.q, *step.caches, tables, step.int_tensor(seq_lens), SCALE, tables.shape[1] * block_size
    )
    assert_close(out, step.reference())


@pytest.mark.parametrize("max_seq_len", [64, 4096])
def test_decode_of_a_sequence_without_keys_is_zero(max_seq_len, merging):
    """A CUDA graph's padding sequences have no keys: zeros, not NaN, with one split or many."""
    step = Step(8, [1, 1], [40, 1], 4, 2, 16, 4, torch.float32)
    out = tk.decode_attention(step.q, *step.caches, step.block_tables(), step.int_tensor([40, 0]), SCALE, max_seq_len)
    assert (out[1] == 0).all()
    assert_close(out[:1], step.reference()[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_last_split_merges_as_the_merge_launch_and_resets_its_counters(monkeypatch, dtype):
    """Merged by the last split: the merge launch's output (fp32 sums in another order: within 1e-6), every
    counter back at 0 after each launch, and a second launch over the same counters the same output (a counter
    left at 1 would leave every (sequence, KV head) unmerged: empty memory)."""
    seq_lens = [2100, 5, 1, 0, 300]  # the fourth has no keys (a CUDA graph's padding row)
    step = Step(11, [1] * len(seq_lens), [max(1, n) for n in seq_lens], 8, 2, 32, 16, dtype)
    tables, lens = step.block_tables(), step.int_tensor(seq_lens)
    args = (step.q, *step.caches, tables, lens, SCALE, tables.shape[1] * 16)
    assert tk.decode_splits(len(seq_lens), 2, args[-1]) > 1
    monkeypatch.setattr(decode_kernels, "MERGE_IN_LAST_SPLIT", False)
    launched = tk.decode_attention(*args)
    monkeypatch.setattr(decode_kernels, "MERGE_IN_LAST_SPLIT", True)
    counters = decode_kernels.arrival_counters(DEVICE, len(seq_lens) * 2)
    for _ in range(2):
        merged = tk.decode_attention(*args, out=torch.full_like(step.q, float("nan")))
        assert (counters == 0).all()
        torch.testing.assert_close(merged, launched, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=0)
    assert (merged[3] == 0).all()  # no keys


def test_arrival_counters_grow_and_keep_what_graphs_captured():
    device = torch.device("cpu")
    small = decode_kernels.arrival_counters(device, 8)
    assert small.numel() >= decode_kernels.MIN_ARRIVALS and (small == 0).all() and small.dtype == torch.int32
    assert decode_kernels.arrival_counters(device, 8) is small
    grown = decode_kernels.arrival_counters(device, small.numel() + 1)
    assert grown.numel() > small.numel() and any(t is small for t in decode_kernels._OUTGROWN)


def test_decode_splits_fill_the_gpu_within_bounds():
    assert tk.decode_splits(600, 8, 4096) == 1  # enough programs already
    assert tk.decode_splits(64, 8, 2048) == 2
    assert tk.decode_splits(1, 8, 32768) == tk.MAX_DECODE_SPLITS
    assert tk.decode_splits(1, 8, 100) == 1  # too short to split
    assert tk.decode_splits(2, 1, 2112) == 16  # 17 by length, rounded down to a power of two
    assert tk.decode_splits(0, 8, 0) == 1


# ---------------------------------------------------------------------------------------------------------------
# GPU only: sizes of a real model, and CUDA graphs
# ---------------------------------------------------------------------------------------------------------------


@gpu_only
def test_large_decode_on_gpu(merging):
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.randint(1500, 2001, (64,), generator=gen).tolist()
    step = Step(0, [1] * 64, seq_lens, 32, 8, 128, 32, torch.bfloat16)
    tables = step.block_tables()
    out = tk.decode_attention(step.q, *step.caches, tables, step.int_tensor(seq_lens), SCALE, tables.shape[1] * 32)
    assert_close(out, step.reference())


@gpu_only
def test_large_prefill_on_gpu():
    step = Step(0, [2000, 512, 1, 1, 300], [2000, 2012, 1999, 700, 300], 32, 8, 128, 32, torch.bfloat16)
    out, _ = step.prefill()
    assert_close(out, step.reference())


@gpu_only
def test_kernels_replay_in_a_cuda_graph(merging):
    """Captured once, replayed over new lengths and tables written into the same tensors."""
    heads, kv_heads, rows_per_seq = 8, 2, 4
    first = Step(1, [1, 4, 2], [100, 300, 50], heads, kv_heads, 64, 16, torch.bfloat16)
    second = Step(2, [3, 1, 4], [260, 20, 90], heads, kv_heads, 64, 16, torch.bfloat16)
    width = max(len(t) for t in first.tables + second.tables)
    static = dict(
        q=torch.zeros(3 * rows_per_seq, heads, 64, dtype=torch.bfloat16, device=DEVICE),
        tables=torch.zeros(3, width, dtype=torch.int32, device=DEVICE),
        q_lens=torch.zeros(3, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.zeros(3, dtype=torch.int32, device=DEVICE),
    )
    caches = [torch.cat([a, b]) for a, b in zip(first.caches, second.caches)]
    offset = first.caches[0].shape[0]
    starts = torch.arange(0, 3 * rows_per_seq, rows_per_seq, dtype=torch.int32, device=DEVICE)
    tiles = tuple(torch.from_numpy(t).to(DEVICE) for t in tk.prefill_tiles([0] * 3, heads, kv_heads, rows_per_seq))

    def forward():
        prefill = tk.prefill_attention(
            static["q"], *caches, static["tables"], starts, static["q_lens"], static["seq_lens"], SCALE, tiles
        )
        decode = tk.decode_attention(
            static["q"][::rows_per_seq], *caches, static["tables"], static["seq_lens"], SCALE, width * 16
        )
        return prefill, decode

    def load(step, block_offset):
        static["q"].zero_()
        static["q"][step.placement(starts.tolist())] = step.q
        static["tables"].zero_()
        for i, table in enumerate(step.tables):
            static["tables"][i, : len(table)] = torch.tensor(table, device=DEVICE) + block_offset
        static["q_lens"].copy_(step.int_tensor(step.q_lens))
        static["seq_lens"].copy_(step.int_tensor(step.ctx_lens))

    load(first, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefill, decode = forward()
    for step, block_offset in ((first, 0), (second, offset)):
        load(step, block_offset)
        graph.replay()
        eager_prefill, eager_decode = forward()
        assert torch.equal(prefill, eager_prefill) and torch.equal(decode, eager_decode)
        assert_close(prefill[step.placement(starts.tolist())], step.reference())


WINDOW_CASES = {  # name: (q_lens, ctx_lens, tree sizes, heads, kv_heads, block_size, window)
    "a prompt longer than the window": ([37], [37], [0], 4, 2, 4, 8),
    "a chunk over a prefix, windows crossing key tiles": ([90], [300], [0], 4, 2, 16, 70),
    "prompts, chunks, decode rows, prefix-hit suffixes": (
        [13, 5, 1, 1, 9, 3],
        [13, 41, 30, 1, 25, 3],
        [0] * 6,
        4,
        2,
        4,
        6,
    ),
    "a window wider than every context": ([20, 1], [20, 33], [0, 0], 4, 4, 4, 64),
    "draft trees measure from their depth": ([7, 6, 12, 1], [40, 6, 48, 33], [7, 6, 0, 0], 4, 2, 4, 9),
}


@pytest.mark.parametrize("name", WINDOW_CASES)
def test_windowed_prefill_equals_portable(name):
    """Each query sees the keys at positions > its own - window (draft nodes: their root's plus their depth);
    every older key is poison in the kernels' caches."""
    q_lens, ctx_lens, sizes, heads, kv_heads, block_size, window = WINDOW_CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    tails = [random_tree(gen, n) if n else None for n in sizes]
    step = Step(len(name), q_lens, ctx_lens, heads, kv_heads, 16, block_size, torch.float32, 3, tails, window=window)
    tree = tk.tree_masks(tails, DEVICE) if any(n for n in sizes) else None
    out, _ = step.prefill(tree=tree, window=window)
    reference = step.reference(window)
    assert_close(out[3:], reference)
    assert not torch.allclose(reference, step.reference(), atol=1e-3) or window >= max(ctx_lens)


@pytest.mark.parametrize("seq_lens, window", [([40, 3, 77], 5), ([1000, 64], 300), ([9], 9)])
def test_windowed_decode_equals_portable(seq_lens, window, merging):
    """The decode kernel reads only each sequence's last `window` keys, with one split or several."""
    step = Step(window, [1] * len(seq_lens), seq_lens, 4, 2, 16, 4, torch.float32, window=window)
    tables = step.block_tables()
    for max_seq_len in (64, tables.shape[1] * 4):
        out = tk.decode_attention(
            step.q, *step.caches, tables, step.int_tensor(seq_lens), SCALE, max_seq_len, window=window
        )
        assert_close(out, step.reference(window))
