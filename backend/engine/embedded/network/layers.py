"""Building blocks of Llama-family decoders: RMSNorm, rotary position embedding, SiLU-gated MLP.

All work on flat token batches: `[T, ...]`, no batch dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..rotary_ops import apply_rotary
from .cpu_gemm import pack_weight, packed_linear
from .model_config import RopeConfig
from .rope import rope_frequencies


class Linear(nn.Module):
    """y = x W^T (+ b). Parameters start uninitialised: the loader always fills them, and building the model on
    the meta device then allocates nothing and runs no random init."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # the weight prepacked for oneDNN on CPU (see cpu_gemm)

    def pack_for_cpu(self) -> None:
        """Pack the loaded weight once for CPU matmuls (a no-op off CPU / fp32); the weight must not change after."""
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


def use_fused_kernels(model: nn.Module) -> None:
    """Run the norms, rotary embeddings and gated activations of `model` as the Triton kernels of fused_ops.py
    (one launch each instead of several small ones; the same values up to rounding). Needs Triton's runtime:
    CUDA, or its interpreter on CPU."""
    for module in model.modules():
        if hasattr(type(module), "fused"):  # the modules that have a fused path declare it
            module.fused = True  # type: ignore[assignment]  # torch types Module attributes as tensors or modules


class RMSNorm(nn.Module):
    fused = False  # see use_fused_kernels
    fp8_rows = False  # the fused kernel also writes the output's FP8 rows (quant/fusion.py sets it)
    identity_weight = 1.0  # the weight that scales by one (dummy weights use it)

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`: (norm(x + residual), x + residual), the sum in x's dtype. Where the projection
        before has done the add and begun the norm (quant/norm_fold.py), x and that sum as they are."""
        folded_sum = getattr(x, "folded_residual", None)
        if folded_sum is not None and residual is not None:
            return x, folded_sum
        if self.fused and x.dim() == 2 and x.stride(-1) == 1:
            from . import fused_ops

            return fused_ops.rms_norm(x, self.weight, self.eps, residual, self.fp8_rows)
        if residual is None:
            return self._norm(x)
        total = x + residual
        return self._norm(total), total

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel; the same values as the steps below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32, then scale in the model's dtype, so low-precision runs round where HF's do.
        original_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(original_dtype)


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), all in fp32, then casts back (as transformers does). No fused
    kernel: the fused one scales by the weight itself."""

    identity_weight = 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._offset_norm(x)
        total = x + residual
        return self._offset_norm(total), total

    def _offset_norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


# A step's cos and sin come from a table of every position up to the engine's context, one gather a step where
# computing them took eight small launches (~14 us of a decode step on a GPU); past this many positions the table
# (~128 MB at head_dim 128 in bf16) is not worth its memory and they are computed each step.
MAX_TABLE_POSITIONS = 1 << 18


class RotaryEmbedding(nn.Module):
    """Rotates pairs (i, i + head_dim/2) of each head by position * frequency; angles are computed in fp32."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        self.context_len: int | None = None  # None: as transformers starts, before it has seen a sequence
        inv_freq, self.attention_factor = rope_frequencies(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.tables: dict[torch.dtype, torch.Tensor] = {}  # [positions, 2 * head_dim]: cos then sin, by dtype

    def reset_frequencies(self, device) -> None:
        """Recompute the fp32 frequencies on `device` (after the module was built on the meta device)."""
        inv_freq, _ = rope_frequencies(self.rope, self.head_dim, self.context_len)
        self.inv_freq = inv_freq.to(device)
        self.tables.clear()

    def set_context_length(self, context_len: int) -> None:
        """The longest sequence the engine runs, before the first forward. Only longrope (Phi-3) depends on it:
        transformers picks the long factors once a sequence outgrows original_max_position_embeddings and then
        rotates every key again with them (it drops its cache); a paged cache whose blocks may be shared cannot
        rotate its keys again, so the engine fixes one set for its lifetime: the long set when max_seq_len allows
        sequences past that length, the short set otherwise (see docs on Phi-3). It also bounds the positions
        table (`forward`)."""
        self.context_len = context_len
        self.reset_frequencies(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> (cos, sin), each [T, head_dim] in `dtype` (views of one [T, 2 * head_dim] tensor)."""
        table = self._table(dtype)
        if table is None:
            both = self._rotations(positions, dtype)
        else:  # positions past the table (a lookahead window's, past max_seq_len) never commit: its last row
            both = table[positions.clamp(max=table.shape[0] - 1)]
        return both[:, : self.head_dim], both[:, self.head_dim :]

    def _rotations(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[T, 2 * head_dim]: cos then sin of each position's angles, in fp32, rounded once to dtype."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.float()[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        both = torch.cat((angles.cos(), angles.sin()), dim=-1)
        if self.attention_factor != 1.0:
            both = both * self.attention_factor
        return both.to(dtype)

    def _table(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Every position's rotations up to the context (built on first use, never while a CUDA graph is being
        captured: the graphs' warm-up runs build it), or None: no context set yet, or too long a one."""
        table = self.tables.get(dtype)
        if table is not None or self.context_len is None or self.context_len >= MAX_TABLE_POSITIONS:
            return table
        device = self.inv_freq.device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        positions = torch.arange(self.context_len + 1, device=device)
        self.tables[dtype] = table = self._rotations(positions, dtype)
        return table


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
    """apply_rotary; fused: in place, in one kernel (x [T, heads, head_dim] may be a view of a wider tensor)."""
    if fused and x.stride(-1) == 1:
        from . import fused_ops

        return fused_ops.rotary_inplace(x, cos, sin)
    return apply_rotary(x, cos, sin)


# A gate_up output that already holds silu(gate) * up carries this attribute (an int4 one-row GEMV that applied
# the SiLU itself, quant/gate_up_runs.py); a gate_up projection whose rows alternate gate and up in runs has
# `gate_up_runs` set (split_gate_up).
ACTIVATED = "activated"


def split_gate_up(gate_up: torch.Tensor, size: int, runs: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of a gate_up output [..., 2 * size]: its two halves, or with `runs`, rows that
    alternate runs of `runs` gates and `runs` ups."""
    if not runs:
        gate, up = gate_up.split(size, dim=-1)
        return gate, up
    paired = gate_up.unflatten(-1, (size // runs, 2, runs))
    return paired[..., 0, :].flatten(-2), paired[..., 1, :].flatten(-2)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul; act is SiLU (Llama) or tanh-approximated
    GELU (`gelu_pytorch_tanh`, Gemma's GeGLU)."""

    fused = False  # see use_fused_kernels
    fp8_rows = False  # the fused SiLU also writes its output's FP8 rows, for down_proj (quant/fusion.py)

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: str = "silu"):
        super().__init__()
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported MLP activation {activation!r}")
        self.activation = activation
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, lora=None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`lora`: the layer's LoRA view (tritonllm.lora.layers.LayerLora), which adds its deltas in place.
        `residual`: for a down_proj that folds the norm after it (quant/norm_fold.py)."""
        gate_up = self.gate_up_proj(x)
        runs = getattr(self.gate_up_proj, "gate_up_runs", 0)  # (never with LoRA, whose deltas are in halves)
        if lora is not None:
            lora.apply("gate_up", x, gate_up)
        if getattr(gate_up, ACTIVATED, False):
            hidden = gate_up
        elif self.fused and gate_up.dim() == 2 and self.activation == "silu":
            from . import fused_ops

            hidden = fused_ops.silu_and_mul(gate_up, self.fp8_rows, runs)
        else:
            gate, up = split_gate_up(gate_up, self.intermediate_size, runs)
            hidden = (F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")) * up
        out = self.down_proj(hidden) if residual is None else self.down_proj(hidden, residual=residual)
        return out if lora is None else lora.apply("down", hidden, out)
