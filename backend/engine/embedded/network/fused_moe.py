"""The experts of a mixture-of-experts layer as two grouped GEMMs in Triton: what moe.experts_portable computes.

The (token, expert) pairs of a step are sorted by expert, each expert's run padded to a multiple of BLOCK_M rows,
so that every BLOCK_M-row tile belongs to one expert. One launch then computes silu(x W_gate^T) * (x W_up^T) for
all tiles (each tile reading its own expert's weights, its rows gathered from the tokens), and a second the down
projection times the router weight, one output row per pair; the top-k rows of a token are summed at the end.

Everything stays on the device (sort, counts, offsets: no host sync, no shape that depends on the routing), so a
CUDA graph captures it: the grid is sized for the worst padding, and tiles past the real end return at once.

Tile sizes come from a table keyed by the number of (token, expert) pairs (`tiles_for`), measured on an H200 with
`ci/gpu_moe_kernel.py --sweep`: few pairs want narrow column blocks and the down projection split along its long K
(more programs in flight to stream the weights), many pairs want tall tiles (each weight tile read once for more
rows). A split down projection adds its partial sums atomically, so its fp32 sums are not bit-reproducible.

On CPU the kernels run in Triton's interpreter, whose low-precision arithmetic is wrong: there (UPCAST) every
loaded value is converted to fp32 first. fp32 dots use IEEE precision (no tf32), so an fp32 model computes fp32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..attention.tile_ops import dot  # the paged-attention kernels' fp32-accumulating dot
from ..rounding import DTYPES
from .fused_ops import silu_times


@triton.jit
def _gate_up_kernel(
    x,
    w,
    out,
    sorted_pairs,
    tile_experts,
    num_padded,
    num_pairs,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_or,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (tile, column block): out[row] = silu(x[token] W_g[e]^T) * (x[token] W_u[e]^T) for the tile's rows,
    W_g and W_u rows [0, inter) and [inter, 2 inter) of w[e]."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_padded):
        return
    expert = tl.load(tile_experts + tile).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs + rows)
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_expert = w + expert * stride_we
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x + token[:, None] * stride_xt + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        gate_w = tl.load(w_expert + cols[None, :] * stride_wn + ks[:, None], mask=w_ok, other=0.0)
        up_w = tl.load(w_expert + (cols[None, :] + inter) * stride_wn + ks[:, None], mask=w_ok, other=0.0)
        if UPCAST:
            a, gate_w, up_w = a.to(tl.float32), gate_w.to(tl.float32), up_w.to(tl.float32)
        acc_gate += dot(a, gate_w, IEEE)
        acc_up += dot(a, up_w, IEEE)
    hidden_act = silu_times(acc_gate, acc_up)
    out_ptrs = out + rows.to(tl.int64)[:, None] * stride_or + cols[None, :]
    tl.store(out_ptrs, hidden_act.to(out.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h,
    w,
    out,
    sorted_pairs,
    tile_experts,
    num_padded,
    router_weights,
    num_pairs,
    hidden,
    inter,
    stride_hr,
    stride_we,
    stride_wn,
    stride_op,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (tile, column block, K part): out[pair] = router_weight[pair] * h[row] W_d[e]^T, in fp32; with
    SPLIT_K > 1 each program adds its part of the K sum to `out` (zeroed by the caller)."""
    tile = tl.program_id(0)
    if tile * BLOCK_M >= tl.load(num_padded):
        return
    expert = tl.load(tile_experts + tile).to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs + rows)
    valid = pair < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_expert = w + expert * stride_we
    k_part = tl.cdiv(tl.cdiv(inter, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = tl.program_id(2) * k_part
    for k0 in range(k_start, k_start + k_part, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(
            h + rows.to(tl.int64)[:, None] * stride_hr + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        down_w = tl.load(
            w_expert + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0
        )
        if UPCAST:
            a, down_w = a.to(tl.float32), down_w.to(tl.float32)
        acc += dot(a, down_w, IEEE)
    weight = tl.load(router_weights + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out + pair.to(tl.int64)[:, None] * stride_op + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=valid[:, None] & col_ok[None, :])
    else:
        tl.atomic_add(out_ptrs, acc, mask=valid[:, None] & col_ok[None, :])


def align_by_expert(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """expert_ids [T, k] -> (sorted_pairs, tile_experts, num_padded): the pairs (index token * k + slot) sorted by
    expert, each expert's run padded with the sentinel T * k to a multiple of block_m; each tile's expert; and
    the padded length (a one-element device tensor). Sized for the worst padding, so nothing depends on the
    routing's values on the host."""
    flat = expert_ids.flatten().long()
    num_pairs = flat.numel()
    max_padded = num_pairs + num_experts * (block_m - 1)
    num_tiles = triton.cdiv(max_padded, block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_ends = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    run_starts = torch.cumsum(counts, 0) - counts
    padded_starts = padded_ends - (counts + block_m - 1) // block_m * block_m
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - run_starts[sorted_experts]
    sorted_pairs = torch.full((num_tiles * block_m,), num_pairs, dtype=torch.long, device=flat.device)
    sorted_pairs[padded_starts[sorted_experts] + rank] = order
    tile_starts = torch.arange(num_tiles, device=flat.device) * block_m
    tile_experts = torch.searchsorted(padded_ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, tile_experts, padded_ends[-1:]


@dataclass(frozen=True)
class Launch:
    """One kernel's column and K blocks, K split (the down kernel only), warps and pipeline stages."""

    n: int = 64
    k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeTiles:
    """Launch shape of the two kernels: rows per tile (one expert each, shared by both) and each kernel's own."""

    block_m: int
    gate_up: Launch = Launch()
    down: Launch = Launch()


# (largest number of pairs, tiles), in ascending order; the last row covers every larger count. From the sweep of
# 2026-12-02 on an H200 (Mixtral-8x7B's layer, bf16; docs/gpu-runs.md): each row the fastest shape measured at
# 1, 8, 64, 256 and 1024 tokens of top-2 routing (2 to 2,048 pairs).
TILE_TABLE: tuple[tuple[int, MoeTiles], ...] = (
    (4, MoeTiles(16, Launch(128, 128), Launch(64, 64, split_k=8))),
    (64, MoeTiles(16, Launch(64, 128, num_stages=4), Launch(32, 128))),
    (256, MoeTiles(64, Launch(128, 64, num_warps=8, num_stages=4), Launch(64, 64))),
    (1024, MoeTiles(64, Launch(64, 64, num_stages=4), Launch(64, 64))),
    (1 << 62, MoeTiles(128, Launch(128, 64, num_warps=8), Launch(128, 64))),
)


def tiles_for(num_pairs: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> MoeTiles:
    """The table's tiles for `num_pairs`. The table's shapes fill a Hopper SM's shared memory at 16-bit widths,
    so fp32 (parity runs) takes the plain 64 x 64 blocks at rows of at most 64 (the widest of them overflows 227 KB
    in fp32); on CPU (the interpreter, which cannot add atomically in order) never a split K."""
    tiles = next(t for limit, t in TILE_TABLE if num_pairs <= limit)
    if dtype == torch.float32:
        tiles = MoeTiles(min(tiles.block_m, 64))
    if device.type != "cuda" and tiles.down.split_k != 1:
        tiles = dataclasses.replace(tiles, down=dataclasses.replace(tiles.down, split_k=1))
    return tiles


def _fit(block: int, size: int) -> int:
    """A block no wider than the next power of two of `size` (and at least 16, tl.dot's least)."""
    return max(16, min(block, triton.next_power_of_2(size)))


def fused_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    router_weights: torch.Tensor,
    expert_ids: torch.Tensor,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H] (gate rows then up rows); w_down [E, H, I]; router_weights, expert_ids
    [T, k]. Returns sum over k of router_weight * down(silu(gate(x)) * up(x)) of each chosen expert, [T, H] in x's
    dtype (the k terms summed in fp32). `tiles`: the launch shape (default: tiles_for the pair count)."""
    _check(x, w_gate_up, w_down, router_weights, expert_ids)
    num_tokens = x.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * expert_ids.shape[1]
    tiles = tiles or tiles_for(num_pairs, x.device, x.dtype)
    sorted_pairs, tile_experts, num_padded = align_by_expert(expert_ids, w_down.shape[0], tiles.block_m)
    routing = (sorted_pairs, tile_experts, num_padded)
    activated = gate_up_rows(x, w_gate_up, routing, expert_ids.shape[1], tiles)
    per_pair = down_pairs(activated, w_down, routing, router_weights.contiguous(), num_pairs, tiles)
    return per_pair.view(num_tokens, -1, x.shape[1]).sum(dim=1).to(x.dtype)


def _flags(x: torch.Tensor) -> dict:
    """UPCAST on the interpreter (see the module's docstring); IEEE dots for fp32."""
    return {"UPCAST": x.device.type != "cuda", "IEEE": x.dtype == torch.float32}


def gate_up_rows(x, w_gate_up, routing, top_k: int, tiles: MoeTiles) -> torch.Tensor:
    """silu(gate) * up of every padded row, [tiles * block_m, I]."""
    sorted_pairs, tile_experts, num_padded = routing
    hidden, inter = x.shape[1], w_gate_up.shape[1] // 2
    launch = tiles.gate_up
    block_n, block_k = _fit(launch.n, inter), _fit(launch.k, hidden)
    num_tiles = tile_experts.shape[0]
    activated = torch.empty((num_tiles * tiles.block_m, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n))](
        x,
        w_gate_up,
        activated,
        sorted_pairs,
        tile_experts,
        num_padded,
        top_k * x.shape[0],  # the number of pairs
        hidden,
        inter,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        activated.stride(0),
        TOP_K=top_k,
        BLOCK_M=tiles.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **_flags(x),
    )
    return activated


def down_pairs(activated, w_down, routing, router_weights, num_pairs: int, tiles: MoeTiles) -> torch.Tensor:
    """router_weight * down(row) of every pair, [pairs, H] in fp32."""
    sorted_pairs, tile_experts, num_padded = routing
    hidden, inter = w_down.shape[1], w_down.shape[2]
    launch = tiles.down
    block_n, block_k = _fit(launch.n, hidden), _fit(launch.k, inter)
    make = torch.zeros if launch.split_k > 1 else torch.empty  # split parts add into it
    per_pair = make((num_pairs, hidden), dtype=torch.float32, device=activated.device)
    _down_kernel[(tile_experts.shape[0], triton.cdiv(hidden, block_n), launch.split_k)](
        activated,
        w_down,
        per_pair,
        sorted_pairs,
        tile_experts,
        num_padded,
        router_weights,
        num_pairs,
        hidden,
        inter,
        activated.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        per_pair.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=launch.split_k,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        **_flags(activated),
    )
    return per_pair


def _check(x, w_gate_up, w_down, router_weights, expert_ids) -> None:
    if x.dim() != 2 or x.dtype not in DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be a 2-D {DTYPES} tensor with a contiguous last dimension, got {tuple(x.shape)}")
    num_experts, two_inter, hidden = w_gate_up.shape
    if hidden != x.shape[1] or two_inter % 2 or w_down.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(
            f"expert weights gate_up {tuple(w_gate_up.shape)} and down {tuple(w_down.shape)} do not fit x "
            f"{tuple(x.shape)} (wanted [E, 2I, H] and [E, H, I])"
        )
    for name, w in (("gate_up", w_gate_up), ("down", w_down)):
        if w.dtype != x.dtype or w.stride(2) != 1:
            raise ValueError(f"{name} weights must be in x's dtype with a contiguous last dimension")
    if expert_ids.shape != router_weights.shape or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"router weights {tuple(router_weights.shape)} and expert ids {tuple(expert_ids.shape)} must both be "
            f"[tokens, top_k] with tokens = {x.shape[0]}"
        )
