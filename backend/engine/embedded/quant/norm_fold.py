"""RMSNorms folded into the one-row int4 GEMVs around them: a batch-1 W4A16 decode step without norm launches.

At one token a decode step's RMSNorm is a launch of its own between two GEMVs (o_proj -> post-attention norm ->
gate_up_proj, down_proj -> next input norm -> qkv_proj) that the GEMV after it must wait for. Its work splits:
- The GEMV before it (the producer) ends with the norm's elementwise half. Each program adds the residual to its
  output columns (h, rounded as the norm's add rounds), stores h (the new residual stream) and h * g (g the
  norm's weight) as the next GEMV's input, and adds its share of sum(h^2) into one of SLOTS fp32 slots.
- The GEMV after it (the consumer) reads the slots and scales its output by 1 / rms(h): the norm is linear in its
  input once 1 / rms(h) is known, so W (h * g / rms) = (W (h * g)) / rms.
The only rounding that moves is the normed input's: round(h * g), not round(round(h / rms) * g).

Slots are zero when their producer adds: the folds of a model form a ring in step order, and the producer of fold
i zeroes fold i - 1's slots, which its consumer has read by then (that GEMV ran before this one). Every producer
of a step folds or none does (quant/fusion.py installs all or nothing), so the ring stays whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..rounding import round_to

SLOTS = 32  # sum(h^2) spread over this many fp32 slots: 32 programs' atomic adds share one


@dataclass(frozen=True)
class FoldedInput:
    """x = h * g of a folded norm: the product scales by rsqrt(sum(sums) / K + eps), K the input's width."""

    sums: torch.Tensor  # fp32 [SLOTS]
    eps: float


@dataclass(frozen=True)
class FoldingOutput:
    """The producer's epilogue: out = round(h * weight), h = round(round(x W^T) + residual) into h_out, its
    sum(h^2) into sums, and the previous fold's slots (stale) zeroed."""

    residual: torch.Tensor  # [1, N]
    weight: torch.Tensor  # the norm's, [N]
    eps: float
    h_out: torch.Tensor  # [1, N]
    sums: torch.Tensor  # fp32 [SLOTS]
    stale: torch.Tensor  # fp32 [SLOTS]


@dataclass(frozen=True)
class NormFold:
    """A producer's place in its model's ring: the norm after it and its slots (quant/fusion.py sets it)."""

    weight: torch.Tensor
    eps: float
    sums: torch.Tensor
    stale: torch.Tensor

    def output(self, residual: torch.Tensor) -> FoldingOutput:
        h_out = torch.empty_like(residual)
        return FoldingOutput(residual, self.weight, self.eps, h_out, self.sums, self.stale)


def ring(count: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(sums, stale) of each of `count` folds in step order: fold i's slots and fold i - 1's (cyclically)."""
    if count < 2:
        raise ValueError(f"a ring of folded norms needs two folds at least, got {count}")
    slots = torch.zeros((count, SLOTS), dtype=torch.float32, device=device)
    return [(slots[i], slots[i - 1]) for i in range(count)]


def fold_result(projected: torch.Tensor, folding: FoldingOutput) -> torch.Tensor:
    """Mark the producer's output (h * g) for the norm after it: that norm returns (this, h) as they are
    (layers.RMSNorm reads `folded_residual`), and the projection that reads this scales its output
    (folded_input_of)."""
    projected.folded_input = FoldedInput(folding.sums, folding.eps)  # type: ignore[attr-defined]
    projected.folded_residual = folding.h_out  # type: ignore[attr-defined]
    return projected


def folded_input_of(x: torch.Tensor) -> FoldedInput | None:
    """The pending norm scale of x when a folding producer wrote it, else None (only the very tensor)."""
    return getattr(x, "folded_input", None)


def unfold(x: torch.Tensor, folded: FoldedInput) -> torch.Tensor:
    """x's normed values for a reader that cannot scale its own output: x / rms, rounded to x's dtype."""
    rms_inverse = torch.rsqrt(folded.sums.sum() / x.shape[-1] + folded.eps)
    return (x.float() * rms_inverse).to(x.dtype)


@triton.jit
def folded_scale(sums, K, eps, SLOTS_P: tl.constexpr):
    """1 / rms(h) of a folded norm from its slots (read after the producer has finished: after the PDL wait)."""
    return tl.rsqrt(tl.sum(tl.load(sums + tl.arange(0, SLOTS_P))) / K + eps)


@triton.jit
def fold_epilogue(
    y, residual, cols, col_ok, out, weight, h_out, sums, stale, SLOTS_P: tl.constexpr, ROUND_BF16: tl.constexpr
):
    """The producer's end for one row: y [BLOCK_N] fp32 the product's columns `cols`, residual those of the
    residual stream (fp32). Stores h and h * g, adds this program's sum(h^2) into a slot, and the first program
    zeroes the stale slots. h and h * g round as the fused norm's (rounding.round_to: ROUND_BF16 on the interpreter)."""
    dtype = out.dtype.element_ty
    y = y.to(dtype).to(tl.float32)  # the projection's output as stored unfolded
    h = round_to(y + residual, dtype, ROUND_BF16)
    tl.store(h_out + cols, h, mask=col_ok)
    h = h.to(tl.float32)
    g = tl.load(weight + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(out + cols, round_to(h * g, dtype, ROUND_BF16), mask=col_ok)
    program = tl.program_id(0)
    tl.atomic_add(sums + program % SLOTS_P, tl.sum(tl.where(col_ok, h * h, 0.0), axis=0))
    if program == 0:
        tl.store(stale + tl.arange(0, SLOTS_P), tl.zeros((SLOTS_P,), dtype=tl.float32))
