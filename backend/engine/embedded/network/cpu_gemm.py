"""Prepacked oneDNN matmuls for fp32 models on CPU.

PyTorch's default CPU matmul (MKL sgemm) re-lays-out the whole weight on every call once the input has more than one
row, which is exactly what decode batches and speculative verification feed it: on a 2-core AVX2 machine SmolLM2's
layer stack cost 53-61 ms at 2-16 rows against 30 ms at one row, while weights packed once for oneDNN cost 19-39 ms
over the same rows (docs/benchmarks.md). The packed op is the one PyTorch's own compiler emits for CPU linears;
where it is missing or fails its probe, callers keep the plain path."""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

log = logging.getLogger(__name__)


@functools.cache
def packing_available() -> bool:
    """True when this PyTorch build can pack fp32 weights for oneDNN and the packed product matches F.linear."""
    try:
        weight, x = torch.randn(8, 4), torch.randn(3, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        ok = torch.allclose(packed_linear(x, packed, None), torch.nn.functional.linear(x, weight), atol=1e-5)
    except (AttributeError, RuntimeError) as error:
        log.info("oneDNN weight packing unavailable (%s); CPU linears use the default matmul", error)
        return False
    return bool(ok)


def pack_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`weight` ([out, in]) packed for `packed_linear`, or None where packing does not apply (not CPU fp32)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not packing_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ weight.T (+ bias) with a weight from `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
