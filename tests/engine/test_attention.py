"""Paged attention over a sequence's cached context (chunked prefill, speculative trees) equals dense attention
computed directly, and reads whole blocks: the key length SDPA sees changes once a block, not every step.
Engines on CUDA turn cuDNN attention off (it builds a plan for every new shape)."""

import pytest
import torch

from tritonllm.engine.embedded.attention import paged_attention, sequence_mask, step_metadata
from tritonllm.engine.embedded.device import avoid_cudnn_attention

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 8, 4


def _dense(q, keys, values, visible, scale):
    """q [Q, H, D], keys/values [C, KV, D], visible [Q, C] bool -> [Q, H, D]."""
    repeat = HEADS // KV_HEADS
    k, v = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    scores = torch.einsum("qhd,chd->hqc", q, k) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqc,chd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("ctx_len", [9, 12, 13])
@pytest.mark.parametrize("tree", [False, True])
def test_queries_over_the_cached_context_equal_dense_attention(ctx_len, tree):
    torch.manual_seed(ctx_len)
    q_len, blocks = 3, [5, 1, 3, 7]  # scattered blocks; stale values in the unused tail must not matter
    k_cache = torch.randn(8, BLOCK, KV_HEADS, DIM)
    v_cache = torch.randn(8, BLOCK, KV_HEADS, DIM)
    keys, values = torch.randn(ctx_len, KV_HEADS, DIM), torch.randn(ctx_len, KV_HEADS, DIM)
    slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx_len)]
    for cache, new in ((k_cache, keys), (v_cache, values)):  # the earlier steps' entries
        cache.view(-1, KV_HEADS, DIM)[slots[: ctx_len - q_len]] = new[: ctx_len - q_len]
    tail = torch.tensor([[True, False, False], [True, True, False], [True, False, True]]) if tree else None
    meta = step_metadata(
        slots[ctx_len - q_len :], [blocks], [0], [q_len], [ctx_len], BLOCK, [tail], "cpu", torch.float32
    )
    q = torch.randn(q_len, HEADS, DIM)
    out = paged_attention(q, keys[-q_len:], values[-q_len:], k_cache, v_cache, meta, scale=0.3)

    visible = torch.arange(ctx_len)[None, :] <= torch.arange(ctx_len - q_len, ctx_len)[:, None]
    if tree:
        visible[:, ctx_len - q_len :] = tail
    assert torch.allclose(out, _dense(q, keys, values, visible, 0.3), atol=1e-5)


def test_masks_cover_whole_blocks_and_hide_the_unwritten_tail():
    mask = sequence_mask(3, 10, None, "cpu", torch.float32, BLOCK)
    assert mask.shape == (1, 1, 3, 12)
    assert torch.isinf(mask[0, 0, :, 10:]).all()
    assert (mask[0, 0, 2, :10] == 0).all() and torch.isinf(mask[0, 0, 0, 8:]).all()
    widths = {sequence_mask(2, ctx, None, "cpu", torch.float32, BLOCK).shape[-1] for ctx in range(5, 9)}
    assert widths == {8}  # four steps, one shape


def test_cuda_engines_turn_cudnn_attention_off_and_cpu_ones_leave_it():
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        avoid_cudnn_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        avoid_cudnn_attention(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(enabled)
