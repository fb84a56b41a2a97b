"""The quantized linear layer: a projection's weight in one internal format (formats.py) as buffers, its bias (if
any) a parameter in the model dtype, and forward() through kernels.py. LoRA deltas still add to its output (the
decoder layers call lora.apply after the projection, whatever it is)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..attention.kv_store import RotaryStore
from .formats import FP8_DTYPE, INT4_SYMMETRIC_ZERO
from .gate_up_runs import mark_activated
from .norm_fold import NormFold, fold_result, folded_input_of, unfold
from .quantize import quantize_fp8, quantize_int4, quantize_int8

KINDS = ("fp8", "int8", "int4")
_OPTIONAL_BUFFERS = ("input_scale", "weight_zero", "qweight")
_GROUP_MAJOR = ("weight_scale", "weight_zero")  # int4's, stored [groups, out] (allocate)
INT4_SCALES_GROUP_MAJOR = True  # False: int4's stored [out, groups] (bench-quant's w4a16-1-rowscales, ci/)


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W quantized. Built on the meta device like Linear; `allocate` gives it storage.

    `weight` is the quantized weight for fp8 and int8; for int4 (whose tensor is `qweight`) it is a meta tensor of
    the dense shape [out, in] that is never allocated: the checkpoint slot builders read a projection's `weight`
    for its shape, and checkpoint.py replaces those slots with the format's own."""

    defer_scales = False  # FP8: the fused norm after it applies its output's scales (quant/fusion.py sets it)
    norm_fold: Optional[NormFold] = None  # int4: the norm after it begins in its one-row GEMV (quant/fusion.py)
    gate_up_runs = 0  # int4 gate_up: its rows in runs, its one-row GEMV applying the SiLU (gate_up_runs.py)
    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: Optional[torch.Tensor]
    weight_zero: Optional[torch.Tensor]
    qweight: Optional[torch.Tensor]

    def __init__(self, in_features: int, out_features: int, bias: bool, kind: str, group_size: int, static_input: bool):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown quantized weight kind {kind!r}; known: {KINDS}")
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.group_size = in_features if kind == "fp8" else group_size
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.static_input = static_input and kind == "fp8"
        specs = self._tensor_specs(torch.float32)
        for name in _OPTIONAL_BUFFERS:
            if name not in specs:
                self.register_buffer(name, None)  # absent in this kind: reads as None
        for name, (shape, _) in specs.items():
            self.register_buffer(name, torch.empty(shape, device="meta"))
        if kind == "int4":
            self.weight = torch.empty(out_features, in_features, device="meta")

    @property
    def groups(self) -> int:
        return self.in_features // self.group_size

    def _tensor_specs(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each buffer's shape and dtype, the scales of int8 and int4 in the model dtype."""
        out, cols, groups = self.out_features, self.in_features, self.groups
        if self.kind == "fp8":
            specs = {"weight": ((out, cols), FP8_DTYPE), "weight_scale": ((out,), torch.float32)}
            return {**specs, "input_scale": ((), torch.float32)} if self.static_input else specs
        if self.kind == "int8":
            return {"weight": ((out, cols), torch.int8), "weight_scale": ((out, groups), dtype)}
        return {
            "qweight": ((out, cols // 2), torch.uint8),
            "weight_scale": ((out, groups), dtype),
            "weight_zero": ((out, groups), torch.uint8),
        }

    def allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        """Storage for every buffer: zeros (a static input scale is the max over fused parts, so it starts at 0),
        and int4 zero points at 8 (symmetric checkpoints store none). int4's scales and zero points are [out, groups]
        views of group-major storage: a program of consecutive rows then reads a group's scales as one vector, and
        Triton keeps them in the layout of the products they scale (the one-row GEMV, int4_decode_kernel's EVEN_N)."""
        for name, (shape, buffer_dtype) in self._tensor_specs(dtype).items():
            if self.kind == "int4" and name in _GROUP_MAJOR and INT4_SCALES_GROUP_MAJOR:
                storage = torch.zeros(shape[::-1], dtype=buffer_dtype, device=device).t()
            else:
                storage = torch.zeros(shape, dtype=buffer_dtype, device=device)
            if name == "weight_zero":
                storage.fill_(INT4_SYMMETRIC_ZERO)
            setattr(self, name, storage)

    def store_rows(self, start: int, dense: torch.Tensor) -> None:
        """Quantize dense rows [rows, in] (round to nearest) into rows start : start + rows."""
        rows = dense.shape[0]
        scale_dtype = self.weight_scale.dtype
        if self.kind == "fp8":
            parts = dict(zip(("weight", "weight_scale"), quantize_fp8(dense)))
        elif self.kind == "int8":
            parts = dict(zip(("weight", "weight_scale"), quantize_int8(dense, self.group_size, scale_dtype)))
        else:
            names = ("qweight", "weight_scale", "weight_zero")
            parts = dict(zip(names, quantize_int4(dense, self.group_size, scale_dtype)))
        with torch.no_grad():
            for name, value in parts.items():
                getattr(self, name).narrow(0, start, rows).copy_(value)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, rotary: Optional[RotaryStore] = None
    ) -> torch.Tensor:
        """`residual`: the residual stream the norm after this projection adds to, given where that norm may
        be folded into it (norm_fold.py; `norm_fold` set); otherwise unused. `rotary`: an int4 qkv_proj's one
        row is rotated and stored into the KV caches as well (qkv_rotary.py; fusion.py says where it may)."""
        from . import kernels  # the qkern branch's Triton kernels live there; imported on first use

        folded_input = folded_input_of(x)
        if folded_input is not None or rotary is not None or (residual is not None and self.norm_fold is not None):
            return self._folded(x, residual, folded_input, rotary)
        if self.kind == "fp8":
            return kernels.fp8_linear(
                x, self.weight, self.weight_scale, self.bias, self.input_scale, defer_scales=self.defer_scales
            )
        if self.kind == "int8":
            return kernels.int8_linear(x, self.weight, self.weight_scale, self.bias, self.group_size)
        assert self.qweight is not None and self.weight_zero is not None
        return kernels.int4_linear(x, self.qweight, self.weight_scale, self.weight_zero, self.bias, self.group_size)

    def _folded(self, x: torch.Tensor, residual: Optional[torch.Tensor], folded_input, rotary=None) -> torch.Tensor:
        """One row through the int4 decode kernel with norm_fold.py's halves (and qkv's rotation); anything else
        unfolded."""
        from . import kernels

        if self.kind != "int4" or x.numel() != x.shape[-1]:
            if rotary is not None:
                raise ValueError(f"qkv's rotation folds into one row of an int4 projection, not {self.kind} {x.shape}")
            return self.forward(unfold(x, folded_input) if folded_input is not None else x)
        folding = None
        if self.norm_fold is not None and residual is not None and residual.shape == (1, self.out_features):
            folding = self.norm_fold.output(residual.contiguous())
        assert self.qweight is not None and self.weight_zero is not None
        runs = self.gate_up_runs if folding is None else 0
        out = kernels.int4_one_row(
            x,
            self.qweight,
            self.weight_scale,
            self.weight_zero,
            self.bias,
            self.group_size,
            folded_input,
            folding,
            runs,
            rotary,
        )
        if runs:
            return mark_activated(out)
        return out if folding is None else fold_result(out, folding)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, kind={self.kind}, group_size={self.group_size}"
