"""GPTQ (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): a linear layer's weight quantized column after column, each column's rounding error spread over the
columns not yet quantized so that the layer's output on calibration inputs moves as little as possible.

With X the layer's inputs (n rows), the output error of weight change dW is tr(dW H dW^T) / 2 for
H = 2 X^T X / n. Quantizing column j and compensating optimally on columns > j uses row j of the upper Cholesky
factor U of H^-1: err = (w_j - q_j) / U[j, j], and columns > j move by -err * U[j, j:]. Columns go in blocks; a
block's updates of the later columns are applied at once at its end (the paper's lazy batch updates).

The grids are quantization on load's (engine quant/quantize.py), so a GPTQ checkpoint holds values the engine's
formats store exactly: int4 with a scale and zero point per group of `group_size` input columns, computed from
the weights as they stand (error updates included) when the group's first column comes up; or fp8 with one
scale per output row, fixed from the row's largest magnitude before any update.

act_order (the paper's "act-order" heuristic): columns go in order of decreasing Hessian diagonal, the inputs
that matter most first, while their errors can still be spread over the most columns. Its groups stay the
contiguous input columns the engine's formats need (no g_idx), so their scales and zero points are fixed up front
from the weights before any update ("static groups"); the stored values are in the original column order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tritonllm.engine.embedded.quant.formats import FP8_DTYPE
from tritonllm.engine.embedded.quant.quantize import fp8_row_scale, int4_grid, round_fp8, round_int4

BLOCK_SIZE = 128  # columns per lazy batch update (the paper's B)
_DAMP_RETRIES = 4  # a Hessian that is not positive definite is damped ten times more, up to this many times


@dataclass(frozen=True)
class Grid:
    """kind int4 (group_size columns a group; symmetric: zero 8) or fp8 (per output row); scale_dtype: the
    stored dtype of int4 scales (the model's; rounding uses the scale as stored)."""

    kind: str
    group_size: Optional[int] = None
    symmetric: bool = False
    scale_dtype: torch.dtype = torch.float32


@dataclass
class QuantizedWeight:
    """int4: values uint8 [out, in] (0..15), scale [out, groups], zero uint8 [out, groups]; fp8: values
    float8_e4m3fn [out, in], scale float32 [out], zero None. dense: what they dequantize to (float32)."""

    values: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    dense: torch.Tensor


class HessianSum:
    """Accumulates 2 X^T X / n over batches of a layer's inputs (any leading shape, last dim the columns)."""

    def __init__(self, columns: int, device: torch.device):
        self.sum = torch.zeros(columns, columns, dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, inputs: torch.Tensor) -> None:
        x = inputs.detach().reshape(-1, self.sum.shape[0]).to(torch.float32)
        self.sum.addmm_(x.t(), x)
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if not self.rows:
            raise ValueError("no calibration inputs reached this layer")
        return self.sum * (2.0 / self.rows)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    grid: Grid,
    damp: float = 0.01,
    block_size: int = BLOCK_SIZE,
    act_order: bool = False,
) -> QuantizedWeight:
    """weight [out, in], hessian [in, in] (HessianSum's) -> the weight quantized on `grid`. `damp`: the share of
    the mean diagonal added to the diagonal (the paper's lambda), which keeps H invertible. `act_order`: columns
    by decreasing Hessian diagonal, with static groups (above)."""
    w = weight.detach().to(torch.float32).clone()
    rows, cols = w.shape
    if grid.kind == "int4" and (grid.group_size is None or cols % grid.group_size):
        raise ValueError(f"group_size {grid.group_size} does not divide the {cols} input columns")
    h = hessian.to(torch.float32).clone()
    dead = h.diagonal() == 0  # a column no input ever reached: its weight cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    quantizer = _Quantizer(grid, w, static_groups=act_order)
    order = torch.argsort(h.diagonal(), descending=True, stable=True) if act_order else torch.arange(cols)
    if act_order:
        w, h = w[:, order], h[order][:, order]
    u = _upper_inverse_factor(h, damp)
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        block = w[:, start:end].clone()
        errors = torch.zeros_like(block)
        for i in range(end - start):
            column = start + i
            if quantizer.starts_group(column):
                quantizer.fit_group(column, _current_group(w, block, errors, u, start, column, quantizer.size))
            q = quantizer.quantize(int(order[column]), block[:, i])
            err = (block[:, i] - q) / u[column, column]
            block[:, i:] -= err[:, None] * u[column, column:end][None, :]
            errors[:, i] = err
        w[:, end:] -= errors @ u[start:end, end:]
    return quantizer.result()


def _upper_inverse_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp * mean(diag H) * I)^-1."""
    mean = float(h.diagonal().mean())
    for attempt in range(_DAMP_RETRIES + 1):
        damped = h + torch.eye(h.shape[0], device=h.device) * (damp * 10**attempt * mean)
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            inverse = torch.cholesky_inverse(lower)
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if int(info) == 0:
                return upper
    raise ValueError(f"the Hessian is not positive definite even damped by {damp * 10**_DAMP_RETRIES} of its mean")


def _current_group(w, block, errors, u, start: int, column: int, size: int) -> torch.Tensor:
    """Columns column : column + size as they stand now: inside the block from `block`; past it from `w` plus the
    block's updates so far, which the lazy batch update has not applied yet."""
    end = start + block.shape[1]
    inside = block[:, column - start : min(column + size, end) - start]
    if column + size <= end:
        return inside
    later = w[:, end : column + size] - errors @ u[start:end, end : column + size]
    return torch.cat((inside, later), dim=1)


class _Quantizer:
    """Rounds one column at a time onto the grid, keeping the integer values and the per-group parameters.
    static_groups: every group's parameters from `w` now, none fitted as columns come."""

    def __init__(self, grid: Grid, w: torch.Tensor, static_groups: bool = False):
        self.grid, self.static = grid, static_groups
        rows, cols = w.shape
        self.values = torch.zeros(rows, cols, device=w.device)
        self.dense = torch.zeros(rows, cols, device=w.device)
        if grid.kind == "fp8":
            self.size = cols
            self.row_scale = fp8_row_scale(w)
            return
        assert grid.group_size is not None
        self.size = grid.group_size
        groups = cols // grid.group_size
        self.scale = torch.zeros(rows, groups, dtype=grid.scale_dtype, device=w.device)
        self.zero = torch.zeros(rows, groups, device=w.device)
        if static_groups:
            self.scale, self.zero = int4_grid(w.reshape(rows, groups, self.size), grid.scale_dtype, grid.symmetric)

    def starts_group(self, column: int) -> bool:
        return self.grid.kind == "int4" and not self.static and column % self.size == 0

    def fit_group(self, column: int, current: torch.Tensor) -> None:
        scale, zero = int4_grid(current[:, None, :], self.grid.scale_dtype, self.grid.symmetric)
        self.scale[:, column // self.size] = scale[:, 0]
        self.zero[:, column // self.size] = zero[:, 0]

    def quantize(self, column: int, w: torch.Tensor) -> torch.Tensor:
        """The dequantized value on the grid of `w`, input column `column` (its stored value kept)."""
        if self.grid.kind == "fp8":
            stored = round_fp8(w, self.row_scale)
            self.values[:, column] = stored.to(torch.float32)
            dense = stored.to(torch.float32) * self.row_scale
        else:
            group = column // self.size
            scale, zero = self.scale[:, group].to(torch.float32), self.zero[:, group]
            level = round_int4(w, scale, zero)
            self.values[:, column] = level
            dense = (level - zero) * scale
        self.dense[:, column] = dense
        return dense

    def result(self) -> QuantizedWeight:
        if self.grid.kind == "fp8":
            return QuantizedWeight(self.values.to(FP8_DTYPE), self.row_scale, None, self.dense)
        return QuantizedWeight(self.values.to(torch.uint8), self.scale, self.zero.to(torch.uint8), self.dense)
