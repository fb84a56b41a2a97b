"""The experts of a mixture-of-experts layer as two grouped GEMMs in Triton: what moe.experts_portable computes.

The (token, expert) pairs of a step are sorted by expert, each expert's run padded to a multiple of BLOCK_M rows,
so that every BLOCK_M-row tile belongs to one expert. One launch then computes silu(x W_gate^T) * (x W_up^T) for
all tiles (each tile reading its own expert's weights, its rows gathered from the tokens), and a second the down
projection times the router weight, one output row per pair; the top-k rows of a token are summed at the end.

Everything stays on the device (sort, counts, offsets: no host sync, no shape that depends on the routing), so a
CUDA graph captures it: the grid is sized for the worst padding, and tiles past the real end return at once.

On CPU the kernels run in Triton's interpreter, whose low-precision arithmetic is wrong: there (UPCAST) every
loaded value is converted to fp32 first. fp32 dots use IEEE precision (no tf32), so an fp32 model computes fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention.triton_kernels import _dot  # the paged-attention kernels' fp32-accumulating dot

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
        acc_gate += _dot(a, gate_w, IEEE)
        acc_up += _dot(a, up_w, IEEE)
    hidden_act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
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
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Program (tile, column block): out[pair] = router_weight[pair] * h[row] W_d[e]^T, in fp32."""
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
    for k0 in range(0, inter, BLOCK_K):
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
        acc += _dot(a, down_w, IEEE)
    weight = tl.load(router_weights + pair, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out + pair.to(tl.int64)[:, None] * stride_op + cols[None, :]
    tl.store(out_ptrs, acc, mask=valid[:, None] & col_ok[None, :])


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


def fused_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    router_weights: torch.Tensor,
    expert_ids: torch.Tensor,
) -> torch.Tensor:
    """x [T, H]; w_gate_up [E, 2I, H] (gate rows then up rows); w_down [E, H, I]; router_weights, expert_ids
    [T, k]. Returns sum over k of router_weight * down(silu(gate(x)) * up(x)) of each chosen expert, [T, H] in x's
    dtype (the k terms summed in fp32)."""
    _check(x, w_gate_up, w_down, router_weights, expert_ids)
    num_tokens, hidden = x.shape
    num_experts, inter = w_down.shape[0], w_down.shape[2]
    top_k = expert_ids.shape[1]
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    block_m = 16 if num_pairs <= 256 else 64
    sorted_pairs, tile_experts, num_padded = align_by_expert(expert_ids, num_experts, block_m)
    num_tiles = tile_experts.shape[0]
    upcast = x.device.type != "cuda"
    ieee = x.dtype == torch.float32
    block_k_h = max(16, min(64, triton.next_power_of_2(hidden)))
    block_k_i = max(16, min(64, triton.next_power_of_2(inter)))
    block_n_i = max(16, min(64, triton.next_power_of_2(inter)))
    block_n_h = max(16, min(64, triton.next_power_of_2(hidden)))
    activated = torch.empty((num_tiles * block_m, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n_i))](
        x,
        w_gate_up,
        activated,
        sorted_pairs,
        tile_experts,
        num_padded,
        num_pairs,
        hidden,
        inter,
        x.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        activated.stride(0),
        TOP_K=top_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n_i,
        BLOCK_K=block_k_h,
        UPCAST=upcast,
        IEEE=ieee,
        num_warps=4,
    )
    per_pair = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    _down_kernel[(num_tiles, triton.cdiv(hidden, block_n_h))](
        activated,
        w_down,
        per_pair,
        sorted_pairs,
        tile_experts,
        num_padded,
        router_weights.contiguous(),
        num_pairs,
        hidden,
        inter,
        activated.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        per_pair.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n_h,
        BLOCK_K=block_k_i,
        UPCAST=upcast,
        IEEE=ieee,
        num_warps=4,
    )
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


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
