"""RoPE and the KV store in one launch (kv_store.rotate_and_store_kv): bit for bit what fused_ops.rotary_inplace of
q and k followed by store_kv gives, on views of one fused qkv output, GQA and odd head counts, scattered slots and
FP8 caches; and an engine with triton_backend.ROTATE_WHILE_STORING on answering as with it off. On CPU the
kernels run in Triton's interpreter."""

import os
import sys

import pytest
import torch

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonllm.engine.embedded.attention import (  # noqa: E402
    kv_store,
    paged_attention,
    step_metadata,
    triton_backend,
    triton_kernels,
)
from tritonllm.engine.embedded.attention.fp8_cache import FP8_DTYPE  # noqa: E402
from tritonllm.engine.embedded.network import fused_ops  # noqa: E402
from tritonllm.engine.embedded.network.layers import apply_rotary  # noqa: E402

if not CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kv_store._rotate_store_kv_kernel, InterpretedFunction):
        pytest.skip(
            f"no CUDA, and the Triton kernels were compiled without TRITON_INTERPRET=1 (triton imported "
            f"first: {'triton' in sys.modules}); set TRITON_INTERPRET=1 before triton is imported",
            allow_module_level=True,
        )

DEVICE = torch.device("cuda" if CUDA else "cpu")
TOKENS, BLOCKS, BLOCK_SIZE = 5, 6, 4
SLOTS = [3, 17, 4, 22, 9]  # scattered over the blocks, out of order


class Inputs:
    """q, k, v as views of one [T, (heads + 2 kv_heads) * head_dim] output, random cos and sin tables (their two
    halves differ, unlike RoPE's: a kernel pairing the wrong halves shows), caches full of random values."""

    def __init__(self, seed, dtype, heads, kv_heads, head_dim, cache_dtype, spread=1.0):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        width = (heads + 2 * kv_heads) * head_dim
        self.qkv = (torch.randn(TOKENS, width, generator=gen) * spread).to(dtype).to(DEVICE)
        self.cos, self.sin = (torch.randn(TOKENS, head_dim, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
        shape = (BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
        self.caches = [(torch.randn(shape, generator=gen) * spread).to(cache_dtype).to(DEVICE) for _ in range(2)]
        self.slots = torch.tensor(SLOTS, device=DEVICE)

    def copies(self):
        """A fresh (qkv, q, k, v, caches) to rotate and store into."""
        qkv = self.qkv.clone()
        q, k, v = qkv.view(TOKENS, -1, self.head_dim).split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        return qkv, q, k, v, [cache.clone() for cache in self.caches]


def two_launches(inputs, scales):
    qkv, q, k, v, caches = inputs.copies()
    fused_ops.rotary_inplace(q, inputs.cos, inputs.sin)
    fused_ops.rotary_inplace(k, inputs.cos, inputs.sin)
    kv_store.store_kv(k, v, *caches, inputs.slots, *scales)
    return qkv, caches


def one_launch(inputs, scales, cos=None):
    qkv, q, k, v, caches = inputs.copies()
    cos = inputs.cos if cos is None else cos
    kv_store.rotate_and_store_kv(q, k, v, cos, inputs.sin, *caches, inputs.slots, *scales)
    return qkv, caches


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# dtype, heads, kv_heads, head_dim, cache dtype, (k_scale, v_scale), spread of the values
CASES = {
    "fp32, GQA 8/2, head 64": (torch.float32, 8, 2, 64, torch.float32, (1.0, 1.0), 1.0),
    "bf16, GQA 6/3, head 32": (torch.bfloat16, 6, 3, 32, torch.bfloat16, (1.0, 1.0), 1.0),
    "bf16, MHA 3/3, head 24 (half not a power of two)": (torch.bfloat16, 3, 3, 24, torch.bfloat16, (1.0, 1.0), 1.0),
    "bf16 into FP8, GQA 6/3, head 32, clamped": (torch.bfloat16, 6, 3, 32, FP8_DTYPE, (0.05, 0.125), 20.0),
    "fp32 into FP8, GQA 8/2, head 64": (torch.float32, 8, 2, 64, FP8_DTYPE, (0.5, 0.25), 1.0),
}


@pytest.mark.parametrize("name", CASES)
def test_one_launch_equals_rotary_then_store(name):
    """q and k rotated, and both caches written, bit for bit as the two launches do (v untouched in place); cos
    with its halves swapped gives other queries and keys (the check can fail)."""
    dtype, heads, kv_heads, head_dim, cache_dtype, scales, spread = CASES[name]
    inputs = Inputs(len(name), dtype, heads, kv_heads, head_dim, cache_dtype, spread)
    want_qkv, want_caches = two_launches(inputs, scales)
    got_qkv, got_caches = one_launch(inputs, scales)
    assert not torch.equal(want_qkv, inputs.qkv)  # the reference did rotate
    assert same_bits(got_qkv, want_qkv)
    for got, want, before in zip(got_caches, want_caches, inputs.caches):
        assert not same_bits(want, before)  # the reference did store
        assert same_bits(got, want)
    swapped = inputs.cos.roll(head_dim // 2, dims=1)
    wrong_qkv, wrong_caches = one_launch(inputs, scales, cos=swapped)
    q_and_k = (heads + kv_heads) * head_dim
    assert not torch.equal(wrong_qkv[:, :q_and_k], want_qkv[:, :q_and_k])
    assert not same_bits(wrong_caches[0], want_caches[0]) and same_bits(wrong_caches[1], want_caches[1])


def test_no_tokens_is_a_no_op():
    inputs = Inputs(1, torch.float32, 4, 2, 16, torch.float32)
    qkv, q, k, v, caches = inputs.copies()
    empty = slice(0, 0)
    tables = (inputs.cos[empty], inputs.sin[empty])
    kv_store.rotate_and_store_kv(q[empty], k[empty], v[empty], *tables, *caches, inputs.slots[empty])
    assert torch.equal(qkv, inputs.qkv) and all(torch.equal(a, b) for a, b in zip(caches, inputs.caches))


def test_bad_inputs_are_refused_by_name():
    inputs = Inputs(2, torch.float32, 4, 2, 16, torch.float32)
    _, q, k, v, caches = inputs.copies()
    with pytest.raises(ValueError, match="^cos .*wanted a float"):
        kv_store.rotate_and_store_kv(q, k, v, inputs.cos[:, :8], inputs.sin, *caches, inputs.slots)
    with pytest.raises(ValueError, match="^sin "):
        kv_store.rotate_and_store_kv(q, k, v, inputs.cos, inputs.sin.long(), *caches, inputs.slots)
    with pytest.raises(ValueError, match="^k has dtype torch.float64"):
        kv_store.rotate_and_store_kv(q, k.double(), v.double(), inputs.cos, inputs.sin, *caches, inputs.slots)
    with pytest.raises(ValueError, match=r"q \(torch.float32\) and k \(torch.bfloat16\) need one dtype"):
        kv_store.rotate_and_store_kv(q, k.bfloat16(), v.bfloat16(), inputs.cos, inputs.sin, *caches, inputs.slots)
    with pytest.raises(ValueError, match="^cos .* does not fit k"):
        kv_store.rotate_and_store_kv(q, k[:2], v[:2], inputs.cos, inputs.sin, *caches, inputs.slots)
    with pytest.raises(ValueError, match="do not fit the caches"):
        kv_store.rotate_and_store_kv(q, k, v[:, :1], inputs.cos, inputs.sin, *caches, inputs.slots)


# (q_lens, ctx_lens) of a step over two sequences: decode rows (the decode kernel), or prompts and a chunk over a
# cached prefix (the prefill kernel)
STEPS = {"decode": ([1, 1], [5, 9]), "prefill": ([3, 2], [3, 7])}


@pytest.mark.parametrize("backend", ["portable", "triton"])
@pytest.mark.parametrize("step", STEPS)
def test_paged_attention_rotates_what_it_is_told_to(backend, step):
    """paged_attention(..., rotary=(cos, sin)) on unrotated q and k answers, and fills the caches, as on q and k
    rotated first (the portable path by layers.apply_rotary, the kernels by fused_ops.rotary_inplace); the same
    call without rotary answers otherwise (the check can fail)."""
    q_lens, ctx_lens = STEPS[step]
    tables = [[2, 0], [5, 1, 3]]
    slots = [
        t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for t, q, c in zip(tables, q_lens, ctx_lens)
        for p in range(c - q, c)
    ]
    kernels = triton_backend.TritonAttention(4, 2, BLOCK_SIZE, DEVICE) if backend == "triton" else None
    starts, tails = [0, q_lens[0]], [None, None]
    meta = step_metadata(
        slots, tables, starts, q_lens, ctx_lens, BLOCK_SIZE, tails, DEVICE, torch.float32, kernels=kernels
    )
    inputs = Inputs(3, torch.float32, 4, 2, 16, torch.float32)
    tokens = sum(q_lens)
    cos, sin = inputs.cos[:tokens], inputs.sin[:tokens]
    _, q, k, v, caches = inputs.copies()
    q, k, v = q[:tokens], k[:tokens], v[:tokens]
    out = paged_attention(q, k, v, *caches, meta, 0.3, rotary=(cos, sin))
    _, q_ref, k_ref, v_ref, ref_caches = inputs.copies()
    q_ref, k_ref, v_ref = q_ref[:tokens], k_ref[:tokens], v_ref[:tokens]
    if backend == "triton":
        fused_ops.rotary_inplace(q_ref, cos, sin)
        fused_ops.rotary_inplace(k_ref, cos, sin)
    else:
        q_ref, k_ref = apply_rotary(q_ref, cos, sin), apply_rotary(k_ref, cos, sin)
    want = paged_attention(q_ref, k_ref, v_ref, *ref_caches, meta, 0.3)
    assert torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches))
    _, q, k, v, caches = inputs.copies()
    unrotated = paged_attention(q[:tokens], k[:tokens], v[:tokens], *caches, meta, 0.3)
    assert not torch.allclose(unrotated, want, atol=1e-3)


# ---- the engine ----


def run_engine(model_dir, prompts, graphs=False):
    """Greedy tokens and (context logits, generation logits) of each prompt: Triton attention, fused kernels;
    graphs: decode steps in CUDA graphs (the engine's default there)."""
    from tritonllm.engine.config import EngineConfig
    from tritonllm.engine.embedded.engine import EmbeddedEngine
    from tritonllm.engine.types import SamplingParams

    config = EngineConfig.from_dict(
        {
            "model": str(model_dir),
            "dtype": "float32",
            "device": "cuda" if CUDA else "cpu",
            "attn_backend": "TRITON",
            **({} if graphs else {"cuda_graph_config": None}),
            "max_num_tokens": 64,
            "kv_cache_config": {"tokens_per_block": 4, "max_tokens": 256},
        }
    )
    params = SamplingParams(max_tokens=3, ignore_eos=True, return_context_logits=True, return_generation_logits=True)
    engine = EmbeddedEngine(config)
    try:
        assert engine.core.model.layers[0].self_attn.fused
        outputs = [h.result() for h in [engine.generate_async(ids, params) for ids in prompts]]
    finally:
        engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
    return tokens, [(o.context_logits, o.outputs[0].generation_logits) for o in outputs]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tritonllm.checkpoints.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("llama"), seed=1, arch="llama")


def test_the_engine_answers_the_same_rotating_while_storing(tiny_llama, monkeypatch):
    """Two prompts at once (a prefill step, then decode steps of two rows): tokens and logits as with the switch
    off, every layer's rotation done by the store (and none when off); the store's tables swapped for one another
    move the logits (the comparison can fail)."""
    from tritonllm.engine.embedded import engine_core

    monkeypatch.setattr(engine_core, "fused_kernels_wanted", lambda backend, device: True)
    calls, swap, real = [], [False], triton_kernels.rotate_and_store_kv

    def counted(q, k, v, cos, sin, *rest):
        calls.append(q.shape[0])
        real(q, k, v, *((sin, cos) if swap[0] else (cos, sin)), *rest)

    monkeypatch.setattr(triton_kernels, "rotate_and_store_kv", counted)
    prompts = [[5, 17, 3, 44, 9, 12], [7, 7, 30]]
    monkeypatch.setattr(triton_backend, "ROTATE_WHILE_STORING", False)
    tokens_off, logits_off = run_engine(tiny_llama, prompts)
    assert calls == []
    monkeypatch.setattr(triton_backend, "ROTATE_WHILE_STORING", True)
    tokens_on, logits_on = run_engine(tiny_llama, prompts)
    assert len(calls) >= 3 * 2 and len(calls) % 2 == 0  # the tiny model's 2 layers: a prefill, 2 decode steps
    assert tokens_on == tokens_off and all(len(t) == 3 for t in tokens_on)
    for on, off in zip(logits_on, logits_off):
        for got, want in zip(on, off):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    swap[0] = True
    _, logits_wrong = run_engine(tiny_llama, prompts[:1])
    assert not torch.allclose(logits_wrong[0][0], logits_off[0][0], atol=1e-3)


@pytest.mark.parametrize(
    "graphs", [False, pytest.param(True, marks=pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU"))]
)
def test_the_engine_answers_the_same_with_both_decode_launches_cut(tiny_llama, monkeypatch, graphs):
    """RoPE rotated by the store and decode's splits merged by the last of them (decode_kernels.
    MERGE_IN_LAST_SPLIT): the tokens and logits of neither, eager or replayed in CUDA graphs. Splits of 4 keys,
    so that these short decodes split (2 to 4 ways); no merge launch runs once the splits merge themselves."""
    from tritonllm.engine.embedded import engine_core
    from tritonllm.engine.embedded.attention import decode_kernels

    monkeypatch.setattr(engine_core, "fused_kernels_wanted", lambda backend, device: True)
    monkeypatch.setattr(decode_kernels, "MIN_SPLIT_KEYS", 4)
    merges, splits, real_merge, real_splits = [], [], decode_kernels._decode_merge_kernel, decode_kernels.decode_splits

    class CountedMerge:
        def __getitem__(self, grid):
            merges.append(grid)
            return real_merge[grid]

    def counted_splits(*args):
        splits.append(real_splits(*args))
        return splits[-1]

    monkeypatch.setattr(decode_kernels, "_decode_merge_kernel", CountedMerge())
    monkeypatch.setattr(decode_kernels, "decode_splits", counted_splits)
    prompts = [[5, 17, 3, 44, 9, 12], [7, 7, 30]]
    monkeypatch.setattr(triton_backend, "ROTATE_WHILE_STORING", False)
    monkeypatch.setattr(decode_kernels, "MERGE_IN_LAST_SPLIT", False)
    tokens_off, logits_off = run_engine(tiny_llama, prompts, graphs)
    assert max(splits) > 1 and merges
    merges.clear()
    monkeypatch.setattr(triton_backend, "ROTATE_WHILE_STORING", True)
    monkeypatch.setattr(decode_kernels, "MERGE_IN_LAST_SPLIT", True)
    tokens_on, logits_on = run_engine(tiny_llama, prompts, graphs)
    assert merges == [] and tokens_on == tokens_off
    for on, off in zip(logits_on, logits_off):
        for got, want in zip(on, off):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
