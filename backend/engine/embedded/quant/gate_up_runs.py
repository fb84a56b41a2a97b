"""SiLU in gate_up_proj's one-row int4 GEMV, instead of a launch of its own after it.

A one-row GEMV program computes BLOCK_N output rows of gate_up. To apply silu(gate) * up itself it needs both
halves of the same columns, so the weight's rows are reordered once, at load: gate and up alternate in runs of
R = BLOCK_N / 2 rows (gate rows 0 .. R-1, up rows 0 .. R-1, gate rows R .. 2R-1, ...). The program's first R
products are then gates and its last R the ups of the same R columns of the activation; it stores those R
values, in order, and the MLP's input is ready.

Any other product of the reordered weight (several rows: a prompt, a batch) comes out in that run order, and the
SiLU launch reads it so (fused_ops.silu_and_mul's `runs`, layers.split_gate_up). The one-row output carries
`activated` for GatedMLP, which then skips the SiLU. The SiLU rounds as the unfused pair does: the product to
the activations' dtype first, then silu(gate) * up in fp32, rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..network.fused_ops import silu_times
from ..network.layers import ACTIVATED
from ..rounding import round_to


@triton.jit
def store_activated(y, out, block, size, HALF: tl.constexpr, ROUND_BF16: tl.constexpr):
    """One program's end: y [2 HALF] fp32, HALF gates then the HALF ups of activation columns block * HALF ..;
    stores silu(gate) * up there, in out's dtype (`size` columns in all)."""
    dtype = out.dtype.element_ty
    rounded = y.to(dtype).to(tl.float32)  # gate_up's output as stored unfused
    gate, up = tl.split(tl.trans(tl.reshape(rounded, (2, HALF))))
    cols = block * HALF + tl.arange(0, HALF)
    tl.store(out + cols, round_to(silu_times(gate, up), dtype, ROUND_BF16), mask=cols < size)


def run_order(size: int, runs: int) -> torch.Tensor:
    """The rows of a [2 * size, ...] gate_up weight in run order: new row r is old row run_order[r]."""
    if runs <= 0 or size % runs:
        raise ValueError(f"gate_up's {size} columns do not split into runs of {runs}")
    gate = torch.arange(size).view(-1, runs)
    return torch.cat([gate, gate + size], dim=1).reshape(-1)


def reorder_rows(tensors: list[torch.Tensor | None], runs: int) -> None:
    """Put the rows of a gate_up projection's tensors (packed weight, scales, zero points, bias: [2 * size, ...]
    each, None skipped) in run order, in place."""
    present = [t for t in tensors if t is not None]
    order = run_order(present[0].shape[0] // 2, runs).to(present[0].device)
    with torch.no_grad():
        for tensor in present:
            tensor.copy_(tensor[order])


def mark_activated(out: torch.Tensor) -> torch.Tensor:
    """`out`, marked as holding silu(gate) * up for GatedMLP (layers.ACTIVATED)."""
    setattr(out, ACTIVATED, True)
    return out
