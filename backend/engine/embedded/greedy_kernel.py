"""Greedy tokens and their log-probs straight from the LM head's output, in two Triton launches.

A plain greedy step needs, per row, the argmax and log_softmax at it, which is -log(sum(exp(x - max))). In torch
that is an fp32 copy of the [rows, vocab] logits, an argmax, and logsumexp's max, subtract, exp and sum passes:
at 256 rows of a 128k vocabulary about 0.3 ms of an H200's step, in every step. Here the first launch reads the
logits once, in their own dtype, in vocabulary chunks spread over the GPU (a row's chunks in parallel, so batch 1
is not one program walking 128k entries): each chunk's max, its first index, and sum(exp(x - chunk max)). The second
launch folds a row's chunks together. The arithmetic is fp32, as on the fp32 copy; ties go to the lowest index,
as torch.argmax's do.

On CPU the kernels run in Triton's interpreter (tests only: sampler.py takes torch's ops off CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # vocabulary entries a first-launch program reads (one load: 32 a thread at 4 warps)


@triton.jit
def _chunk_kernel(logits, maxes, firsts, sums, vocab, stride_row, chunks, CHUNK: tl.constexpr):
    """Program (row, chunk): the chunk's max, the first index holding it, and sum(exp(x - max)) over it."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    best, first = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    # A chunk masked out whole (a grammar's banned tokens: -inf) sums exp(-inf - 0) = 0, not exp(-inf - -inf) = NaN.
    shift = tl.where(best == float("-inf"), 0.0, best)
    total = tl.sum(tl.exp(x - shift), axis=0)
    slot = row * chunks + chunk
    tl.store(maxes + slot, best)
    tl.store(firsts + slot, chunk * CHUNK + first)
    tl.store(sums + slot, total)


@triton.jit
def _fold_kernel(maxes, firsts, sums, tokens, token_floats, logprobs, chunks, CHUNKS: tl.constexpr):
    """Program (row): the row's max over its chunks (the first chunk holding it gives the token, stored as int64 and
    as fp32) and -log(sum over chunks of sum_c * exp(max_c - max))."""
    row = tl.program_id(0).to(tl.int64)
    index = tl.arange(0, CHUNKS)
    ok = index < chunks
    chunk_max = tl.load(maxes + row * chunks + index, mask=ok, other=float("-inf"))
    best, winner = tl.max(chunk_max, axis=0, return_indices=True, return_indices_tie_break_left=True)
    chunk_sum = tl.load(sums + row * chunks + index, mask=ok, other=0.0)
    total = tl.sum(tl.where(ok, chunk_sum * tl.exp(chunk_max - best), 0.0), axis=0)
    token = tl.load(firsts + row * chunks + winner)
    tl.store(tokens + row, token.to(tl.int64))
    tl.store(token_floats + row, token.to(tl.float32))
    tl.store(logprobs + row, -tl.log(total))


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (fp32 / bf16 / fp16, last dim contiguous) -> (argmax int64 [rows],
    log_softmax at it, fp32 [rows]), on the logits' device."""
    tokens, pair = greedy_pair(logits)
    return tokens, pair[1]


def greedy_pair(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_pick's tokens (int64 [rows]) and [2, rows] fp32: the tokens again, then their log-probs, as the host
    copy of a step's choices wants them (sampler.SampledTokens), with no launch to stack them."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be 2-D with a contiguous last dimension, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    tokens = torch.empty((rows,), dtype=torch.int64, device=logits.device)
    pair = torch.empty((2, rows), dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, pair
    chunks = triton.cdiv(vocab, CHUNK)
    partial = torch.empty((2, rows, chunks), dtype=torch.float32, device=logits.device)
    firsts = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _chunk_kernel[(rows, chunks)](
        logits, partial[0], firsts, partial[1], vocab, logits.stride(0), chunks, CHUNK=CHUNK, num_warps=4
    )
    _fold_kernel[(rows,)](
        partial[0],
        firsts,
        partial[1],
        tokens,
        pair[0],
        pair[1],
        chunks,
        CHUNKS=triton.next_power_of_2(chunks),
        num_warps=1,
    )
    return tokens, pair
