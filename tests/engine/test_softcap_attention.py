"""Attention logit soft-capping (Gemma 2): the portable path against transformers' eager formula, and the Triton
kernels (prefill and decode, with and without a window) against the portable path, on random paged steps (the
cases and poisoned caches of test_triton_attention.py)."""

import pytest
import torch

from tritonllm.engine.embedded.attention import step_metadata
from tritonllm.engine.embedded.attention import triton_kernels as tk
from tritonllm.engine.embedded.attention.portable import portable_attention

from .test_triton_attention import DEVICE, SCALE, Step, assert_close

SOFTCAP = 2.0  # the random scores reach about 5: tanh bends them hard


def reference(step: Step, window=None, softcap=SOFTCAP) -> torch.Tensor:
    meta = step_metadata(
        step.slots,
        step.tables,
        step.starts,
        step.q_lens,
        step.ctx_lens,
        step.block_size,
        step.tails,
        DEVICE,
        step.q.dtype,
    )
    meta.positions = step.positions()
    return portable_attention(step.q, step.k, step.v, *step.ref_caches, meta, SCALE, window, softcap)


def eager(q, k, v, scale, softcap, window=None):
    """transformers' eager attention: queries [Q, heads, d] at the last Q of the K key positions (GQA by
    repetition)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0], device=q.device)[:, None]
    key_pos = torch.arange(k.shape[0], device=q.device)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1, dtype=torch.float32), v)


def cached(step: Step, cache: torch.Tensor) -> torch.Tensor:
    """One sequence's keys (or values) at positions 0 .. ctx - 1 from the reference cache."""
    slots = torch.tensor([step.slot(0, p) for p in range(step.ctx_lens[0])])
    return cache.flatten(0, 1)[slots]


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("q_len, ctx_len", [(37, 37), (20, 37), (1, 37)], ids=["prompt", "chunk", "decode"])
def test_portable_softcap_is_transformers_eager_attention(window, q_len, ctx_len):
    """A whole prompt, a chunk over a cached prefix (the gathered path) and a decode row."""
    step = Step(3, [q_len], [ctx_len], 4, 2, 16, 4, torch.float32)
    got = reference(step, window)  # writes the step's keys and values into the reference caches
    keys, values = cached(step, step.ref_caches[0]), cached(step, step.ref_caches[1])
    expected = eager(step.q, keys, values, SCALE, SOFTCAP, window)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(reference(step, window, softcap=None), expected, atol=1e-3)


CASES = {  # name: (q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, window)
    "prompts, chunks and decode rows": ([13, 5, 1, 9], [13, 41, 30, 25], 4, 2, 16, 4, None),
    "windowed, over several key tiles": ([70, 1], [150, 90], 4, 2, 16, 16, 40),
}


@pytest.mark.parametrize("name", CASES)
def test_softcapped_prefill_equals_portable(name):
    q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, window = CASES[name]
    step = Step(len(name), q_lens, ctx_lens, heads, kv_heads, head_dim, block_size, torch.float32, window=window)
    tiles = tk.prefill_tiles(q_lens, heads, kv_heads)
    out = tk.prefill_attention(
        step.q,
        *step.caches,
        step.block_tables(),
        step.int_tensor(step.starts),
        step.int_tensor(q_lens),
        step.int_tensor(ctx_lens),
        SCALE,
        tuple(torch.from_numpy(t).to(DEVICE) for t in tiles),
        window=window,
        softcap=SOFTCAP,
    )
    expected = reference(step, window)
    assert_close(out, expected)
    assert_sensitive(step, window, expected)


def assert_sensitive(step: Step, window, expected):
    """The case can fail: a kernel that dropped the cap (or the window) would give other values."""
    assert not torch.allclose(expected, reference(step, window, softcap=None), atol=1e-3)
    if window is not None:
        assert not torch.allclose(expected, reference(step, None), atol=1e-3)


@pytest.mark.parametrize("seq_lens, window", [([40, 3, 77], None), ([300, 64], 50)])
def test_softcapped_decode_equals_portable(seq_lens, window):
    step = Step(7, [1] * len(seq_lens), seq_lens, 4, 2, 16, 4, torch.float32, window=window)
    tables = step.block_tables()
    expected = reference(step, window)
    assert_sensitive(step, window, expected)
    for max_seq_len in (64, tables.shape[1] * 4):  # one split, then several
        out = tk.decode_attention(
            step.q,
            *step.caches,
            tables,
            step.int_tensor(seq_lens),
            SCALE,
            max_seq_len,
            window=window,
            softcap=SOFTCAP,
        )
        assert_close(out, expected)
