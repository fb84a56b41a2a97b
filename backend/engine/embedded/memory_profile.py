"""How much GPU memory the engine needs besides weights and KV cache, measured before the cache is allocated, so
that `free_gpu_memory_fraction` is a fraction of what is really free for it (as in TensorRT-LLM, where the
fraction applies to the memory left once the model and its activations are accounted for).

One forward of a full token budget (`max_num_tokens` prompt tokens) over a scratch cache, then the LM head and
the sampler's work over a full batch of rows; the peak above the weights is the activations' share. CUDA graphs
keep a pool of their own besides, which is at most another such peak (a graph's step holds fewer tokens)."""

from __future__ import annotations

import logging

import torch

from ..types import SamplingParams
from .block_manager import blocks_for
from .model_runner import ModelRunner
from .scheduler import ScheduledBatch
from .sequence import Sequence

log = logging.getLogger("tritonllm.engine")


@torch.inference_mode()
def activation_bytes(
    model,
    model_config,
    dtype: torch.dtype,
    device: torch.device,
    num_tokens: int,
    max_seq_len: int,
    max_rows: int,
    block_size: int,
    kernels=None,
    cache_dtype: torch.dtype | None = None,
) -> int:
    """Peak bytes allocated, above what is allocated now, by one step of `num_tokens` tokens (in sequences of at
    most `max_seq_len`) and by logits and sampling over `max_rows` rows (the scratch cache in `cache_dtype`, the
    model's `dtype` by default). 0 off CUDA."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    lengths = _split(num_tokens, max_seq_len)
    num_blocks = sum(blocks_for(n, block_size) for n in lengths)
    mc = model_config
    runner = ModelRunner(
        model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks, block_size, dtype, device, cache_dtype
    )
    runner.kernels = kernels
    runner.execute(_dummy_batch(lengths, block_size), [])
    logits = model.compute_logits(torch.zeros(max_rows, mc.hidden_size, dtype=dtype, device=device)).float()
    probs = torch.softmax(logits, dim=-1) / torch.empty_like(logits).exponential_()
    torch.log_softmax(logits, dim=-1).gather(1, probs.argmax(dim=-1)[:, None])
    torch.cuda.synchronize(device)
    # The scratch cache is not part of the activations: the real cache replaces it.
    cache_bytes = sum(c.numel() * c.element_size() for pair in runner.kv_caches for c in pair)
    peak = torch.cuda.max_memory_allocated(device) - baseline - cache_bytes
    del runner, logits, probs
    torch.cuda.empty_cache()
    return max(0, peak)


def _split(num_tokens: int, max_seq_len: int) -> list[int]:
    full, rest = divmod(num_tokens, max_seq_len)
    return [max_seq_len] * full + ([rest] if rest else [])


def _dummy_batch(lengths: list[int], block_size: int) -> ScheduledBatch:
    batch, next_block = ScheduledBatch(), 0
    for index, length in enumerate(lengths):
        seq = Sequence(-1 - index, -1, 0, [0] * length, SamplingParams(max_tokens=1))
        blocks = blocks_for(length, block_size)
        seq.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        batch.add(seq, length)
    return batch
