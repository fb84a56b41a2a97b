"""Unpacking the int32 words that AWQ, GPTQ and compressed-tensors pack their 4- and 8-bit values into."""

from __future__ import annotations

import torch

# AutoAWQ's GEMM layout puts output column ORDER[i] of each group of eight into nibble i of the word; this is the
# inverse permutation (nibble of each column), which undoes it.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_INVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 // bits unsigned values each, the first in the lowest bits, packed along `dim`
    (GPTQ's and compressed-tensors' order) -> int32 values, that dim 32 // bits times longer."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32).unsqueeze(-1)
    values = (words >> shifts) & ((1 << bits) - 1)  # [..., per_word] along the last dim
    if dim in (0, -packed.dim()):
        values = values.movedim(-1, 1)  # [words, per_word, cols]
        return values.reshape(packed.shape[0] * per_word, *packed.shape[1:])
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM int32 [rows, cols // 8] -> int32 values [rows, cols] in column order."""
    values = unpack_int32(packed, 4, dim=1).reshape(packed.shape[0], -1, 8)
    return values[:, :, list(AWQ_INVERSE_ORDER)].reshape(packed.shape[0], -1)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """unpack_int32 undone: unsigned values (below 2**bits) -> int32 words of 32 // bits values along `dim` (0 or
    1 of a 2-D tensor), the first in the lowest bits; the dim is zero-padded to a whole number of words."""
    per_word = 32 // bits
    moved = values.to(torch.int64) if dim == 1 else values.to(torch.int64).t()
    pad = -moved.shape[1] % per_word
    moved = torch.nn.functional.pad(moved, (0, pad)).reshape(moved.shape[0], -1, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (moved << shifts).sum(dim=-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return (words if dim == 1 else words.t()).contiguous()
