"""The FP8 KV cache (attention/fp8_cache.py): attention over a float8 cache equals the same attention over a
full-precision cache that holds the same rounded values, in the portable path and in the Triton kernels (on CPU
through Triton's interpreter, tiny shapes); the store kernel writes what write_kv writes; and the rounding costs
little against the unquantized cache. Engine-level checks are in test_fp8_kv_engine.py."""

import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonllm.engine.embedded.attention import (  # noqa: E402
    prefill_kernels,  # noqa: E402
    step_metadata,
    write_kv,
)
from tritonllm.engine.embedded.attention import triton_kernels as tk  # noqa: E402
from tritonllm.engine.embedded.attention.fp8_cache import FP8_DTYPE, FP8_MAX, dequantize, quantize  # noqa: E402
from tritonllm.engine.embedded.attention.portable import portable_attention, zero_blocks  # noqa: E402
from tritonllm.engine.embedded.block_manager import blocks_for  # noqa: E402

INTERPRETED = False
if not CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    INTERPRETED = isinstance(prefill_kernels._prefill_kernel, InterpretedFunction)

needs_kernels = pytest.mark.skipif(
    not CUDA and not INTERPRETED,
    reason=f"no CUDA, and triton was imported without TRITON_INTERPRET=1 first ({'triton' in sys.modules})",
)
DEVICE = torch.device("cuda" if CUDA else "cpu")
SCALE = 0.37
HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4
# Keys and values ~ N(0, 20): with these scales some stored magnitudes pass 448 and are clamped.
K_SCALE, V_SCALE = 0.05, 0.125
SPREAD = 20.0


class Step:
    """Sequences with `ctx_lens` tokens whose last `q_lens` are this step's, on shuffled blocks: the earlier
    tokens' K/V (`prefix`) already in an FP8 cache, this step's (`k`, `v`) not yet written."""

    def __init__(self, seed, q_lens, ctx_lens):
        self.gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.ctx_lens = q_lens, ctx_lens
        self.starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
        counts = [blocks_for(c, BLOCK) for c in ctx_lens]
        order = torch.randperm(sum(counts) + 2, generator=self.gen).tolist()
        self.tables = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
        self.num_blocks = len(order)
        self.prefix_slots = [self.slot(s, p) for s, (q, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c - q)]
        self.slots = [self.slot(s, p) for s, (q, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c - q, c)]
        self.q = self.randn(sum(q_lens), HEADS, DIM)
        self.k, self.v = (self.randn(sum(q_lens), KV_HEADS, DIM) * SPREAD for _ in range(2))
        self.prefix = [self.randn(len(self.prefix_slots), KV_HEADS, DIM) * SPREAD for _ in range(2)]

    def slot(self, seq, position):
        return self.tables[seq][position // BLOCK] * BLOCK + position % BLOCK

    def randn(self, *shape):
        return torch.randn(shape, generator=self.gen).to(DEVICE)

    def caches(self, dtype):
        """(k_cache, v_cache) in `dtype` (zeroed, then the prefix written): FP8_DTYPE quantizes it."""
        shape = (self.num_blocks, BLOCK, KV_HEADS, DIM)
        caches = [torch.empty(shape, dtype=dtype, device=DEVICE) for _ in range(2)]
        zero_blocks(caches, list(range(self.num_blocks)))
        write_kv(*self.prefix, *caches, self.long(self.prefix_slots), K_SCALE, V_SCALE)
        return caches

    def rounded_caches(self):
        """Full-precision caches holding what the FP8 caches stand for."""
        fp8 = self.caches(FP8_DTYPE)
        return [dequantize(c, s, torch.float32) for c, s in zip(fp8, (K_SCALE, V_SCALE))]

    def meta(self):
        tails = [None] * len(self.q_lens)
        return step_metadata(
            self.slots, self.tables, self.starts, self.q_lens, self.ctx_lens, BLOCK, tails, DEVICE, torch.float32
        )

    def long(self, values):
        return torch.tensor(values, dtype=torch.long, device=DEVICE)

    def int_tensor(self, values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    def block_tables(self):
        width = max(len(t) for t in self.tables) + 1
        return self.int_tensor([t + [0] * (width - len(t)) for t in self.tables])


def rounded(values, scale):
    return dequantize(quantize(values, scale), scale, values.dtype)


def relative_error(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# (q_lens, ctx_lens): prompts whole, chunks over a cached prefix, a mixed step, decode-only steps.
CASES = {
    "whole prompts": ([5, 9], [5, 9]),
    "chunks over a prefix": ([3, 6], [11, 14]),
    "decode": ([1, 1, 1], [1, 7, 23]),
}


def test_quantize_clamps_and_rounds_to_e4m3():
    values = torch.tensor([1000.0, -1000.0, 0.3, 447.0, 0.0])
    stored = quantize(values, 2.0)
    assert stored.dtype == FP8_DTYPE
    assert dequantize(stored, 2.0, torch.float32).tolist() == [2 * FP8_MAX, -2 * FP8_MAX, 0.15625 * 2, 448.0, 0.0]
    assert torch.equal(dequantize(values, 2.0, torch.float32), values)  # not an FP8 cache: as it is


@pytest.mark.parametrize("name", CASES)
def test_portable_fp8_cache_equals_full_precision_cache_of_rounded_values(name):
    """Same rounded K/V, same attention: only the storage differs (fp32 throughout, so within 1e-6)."""
    step = Step(len(name), *CASES[name])
    fp8_caches = step.caches(FP8_DTYPE)
    out = portable_attention(step.q, step.k, step.v, *fp8_caches, step.meta(), SCALE, k_scale=K_SCALE, v_scale=V_SCALE)
    k, v = rounded(step.k, K_SCALE), rounded(step.v, V_SCALE)
    ref = portable_attention(step.q, k, v, *step.rounded_caches(), step.meta(), SCALE)
    assert relative_error(out, ref) < 1e-6


@pytest.mark.parametrize("name", CASES)
def test_fp8_cache_stays_close_to_the_unquantized_cache(name):
    """e4m3 keeps 3 mantissa bits (relative rounding <= 1/16): attention moves by a few percent at most (8%
    allowed; measured: 3-4%)."""
    step = Step(len(name), *CASES[name])
    k, v, prefix = step.k / SPREAD, step.v / SPREAD, [p / SPREAD for p in step.prefix]  # N(0, 1): softmax not saturated
    scales = (2**-6, 2**-6)  # N(0, 1) / scale stays well inside +-448: rounding only
    shape = (step.num_blocks, BLOCK, KV_HEADS, DIM)
    fp8_caches = [torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    write_kv(*prefix, *fp8_caches, step.long(step.prefix_slots), *scales)
    out = portable_attention(step.q, k, v, *fp8_caches, step.meta(), SCALE, None, None, *scales)
    full = [torch.zeros(shape, device=DEVICE) for _ in range(2)]
    write_kv(*prefix, *full, step.long(step.prefix_slots))
    ref = portable_attention(step.q, k, v, *full, step.meta(), SCALE)
    assert 0 < relative_error(out, ref) < 0.08


@needs_kernels
@pytest.mark.parametrize("name", ["chunks over a prefix", "whole prompts"])
def test_prefill_kernel_on_fp8_cache_equals_portable(name):
    """The prefill kernel reads the float8 cache the portable path wrote (this step's K/V included)."""
    step = Step(len(name), *CASES[name])
    caches = step.caches(FP8_DTYPE)
    ref = portable_attention(step.q, step.k, step.v, *caches, step.meta(), SCALE, k_scale=K_SCALE, v_scale=V_SCALE)
    tiles = tk.prefill_tiles(step.q_lens, HEADS, KV_HEADS)
    out = tk.prefill_attention(
        step.q,
        *caches,  # portable_attention has written this step's K/V into them
        step.block_tables(),
        step.int_tensor(step.starts),
        step.int_tensor(step.q_lens),
        step.int_tensor(step.ctx_lens),
        SCALE,
        tuple(torch.from_numpy(t).to(DEVICE) for t in tiles),
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    assert relative_error(out, ref) < 1e-5


@needs_kernels
@pytest.mark.parametrize("max_seq_len", [32, 1024])  # one split, and several merged
def test_decode_kernel_on_fp8_cache_equals_portable(max_seq_len):
    step = Step(3, *CASES["decode"])
    caches = step.caches(FP8_DTYPE)
    ref = portable_attention(step.q, step.k, step.v, *caches, step.meta(), SCALE, k_scale=K_SCALE, v_scale=V_SCALE)
    out = tk.decode_attention(
        step.q,
        *caches,
        step.block_tables(),
        step.int_tensor(step.ctx_lens),
        SCALE,
        max_seq_len,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    assert tk.decode_splits(3, KV_HEADS, max_seq_len) == (1 if max_seq_len == 32 else 8)
    assert relative_error(out, ref) < 1e-5


@pytest.mark.skipif(not CUDA, reason="bf16 queries over an FP8 cache take the fp16 tiles only on CUDA")
@pytest.mark.parametrize("max_seq_len", [32, 1024])
def test_decode_kernel_with_bf16_queries_widens_fp8_tiles_to_fp16(max_seq_len):
    """A model's bf16 queries: decode converts them and the float8 tiles to fp16 (FP8_DECODE_IN_FP16); within
    bf16's rounding of the fp32 reference."""
    step = Step(3, *CASES["decode"])
    caches = step.caches(FP8_DTYPE)
    ref = portable_attention(step.q, step.k, step.v, *caches, step.meta(), SCALE, k_scale=K_SCALE, v_scale=V_SCALE)
    out = tk.decode_attention(
        step.q.bfloat16(),
        *caches,
        step.block_tables(),
        step.int_tensor(step.ctx_lens),
        SCALE,
        max_seq_len,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    assert out.dtype == torch.bfloat16 and relative_error(out.float(), ref) < 1e-2


@needs_kernels
def test_store_kernel_writes_what_write_kv_writes_into_fp8_caches():
    """Values on the e4m3 grid (times the power-of-two scales) and out of range ones (clamped): the store divides,
    clamps and places exactly as write_kv does. Off-grid rounding is the hardware's and is left to the GPU check
    (ci/gpu_fp8_kv.py): Triton's interpreter rounds float8 wrongly where rounding carries into the exponent."""
    gen = torch.Generator().manual_seed(11)
    tokens, blocks = 5, 4
    grid = quantize(torch.randn(2, tokens, KV_HEADS, DIM, generator=gen) * 100, 1.0).float()
    grid[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 500.0, -449.0])  # past 448: clamped
    k, v = (grid[0] * K_SCALE).to(DEVICE), (grid[1] * V_SCALE).to(DEVICE)
    slots = torch.tensor([3, 9, 4, 14, 15], device=DEVICE)
    shape = (blocks, BLOCK, KV_HEADS, DIM)
    caches = [torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    expected = [torch.zeros(shape, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    write_kv(k, v, *expected, slots, K_SCALE, V_SCALE)
    tk.store_kv(k, v, *caches, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    for cache, want in zip(caches, expected):
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    assert dequantize(caches[0], K_SCALE, torch.float32)[0, 3, 0, :4].tolist() == pytest.approx(
        [448 * K_SCALE, -448 * K_SCALE, 448 * K_SCALE, -448 * K_SCALE]
    )
