"""What the Triton paged-attention kernels share: their layouts and semantics (below), the device helpers of their
inner loops, and the host checks of their inputs. The kernels are decode (decode_kernels.py: split-KV, one query
a sequence) and prefill / extend (prefill_kernels.py: any number of queries a sequence, draft trees), both reading
K/V in place through the block tables; they compute what the portable path (portable.py) computes.

Layouts (one layer):
- q, out: [T, heads, head_dim], last dim contiguous. Query head h reads KV head h // (heads // kv_heads) (GQA).
- k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim], last dim contiguous. Position p of sequence s
  lives at block `block_tables[s, p // block_size]`, offset `p % block_size`. This step's K/V are already written
  (`write_kv`), so every key is read from the caches.
- block_tables: [S, W] int32 or int64, padded with 0; seq_lens: [S]: sequence s has keys at positions
  0 .. seq_lens[s] - 1. Slots at later positions are never read (they may hold another sequence's data, NaN).

Semantics: softmax(q k^T * scale) v in fp32 (online softmax in base 2), output in q's dtype; with a softcap c
(Gemma 2) the scores are c * tanh(q k^T * scale / c) before anything is hidden. Decode: the query of
sequence s sits at position seq_lens[s] - 1 and sees every key. Prefill: query i of sequence s sits at position
seq_lens[s] - query_lens[s] + i and sees keys at positions <= its own, except in a draft tree (TreeMasks): the last
n queries see every key before the tree and, among the tree's n keys, those their mask row allows.
With a window W (a layer's attention window, attention/windows.py) a query at position p sees, of those, only the
keys at positions > p - W; a draft node's p is its root's position plus its depth (the step's `positions`).

Both kernels group the query heads that share a KV head into the rows of one program, so each K/V tile is loaded
once per KV head, and are CUDA-graph capturable: grids and constexprs depend on shapes and host ints only, scratch
comes from torch.empty, nothing syncs with the host.

FP8 caches (fp8_cache.py): the store quantizes (x / scale, clamped to +-448, rounded to float8 e4m3); the
attention kernels load float8 tiles and widen them to the queries' dtype, with k_scale folded into the score
scale and v_scale applied to the output (both linear), so the inner loop does no extra multiply. Decode widens
them to fp16 instead (FP8_DECODE_IN_FP16), queries and probabilities converted to fp16 too: e4m3 values are
exact in fp16, and the widening is one instruction a pair where bf16's takes several. The scales are
host floats fixed at load, so CUDA graphs capture them.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 before triton is imported). Its bfloat16
arithmetic is wrong, so there (UPCAST) every loaded value is converted to fp32 first and dots run in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_cache import FP8_MAX as _FP8_MAX

LOG2E = 1.4426950408889634
FP8_MAX = tl.constexpr(_FP8_MAX)

# Arguments that change from step to step are not specialised on (Triton compiles a variant per value of 1, per
# multiple of 16 and per 16-byte alignment of a pointer): the step's metadata are views into one uploaded buffer
# at varying offsets, and table widths and counts vary, so specialising recompiled kernels mid-run (a second each).
STEP_ARGS = ["block_tables", "seq_lens", "stride_table", "window"]


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; IEEE: fp32 operands without tf32 rounding."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def tile_scores(queries, k, scale_log2, cap_log2, scale_over_cap, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """q k^T * scale in base 2 (times log2(e)); SOFTCAP: softcap * tanh(q k^T * scale / softcap) in base 2
    (cap_log2 = softcap * log2(e), scale_over_cap = scale / softcap), tanh(x) as 2 sigmoid(2x) - 1."""
    raw = dot(queries, tl.trans(k), IEEE)
    if SOFTCAP:
        scores = (2.0 * tl.sigmoid(2.0 * raw * scale_over_cap) - 1.0) * cap_log2
    else:
        scores = raw * scale_log2
    return scores


@triton.jit
def key_slots(table_row, keys, key_ok, BLOCK_SIZE: tl.constexpr):
    """(block id as int64, offset in block) of each key position, through the sequence's block table row."""
    block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    return block, keys % BLOCK_SIZE


@triton.jit
def load_kv(
    cache, block, offset, kv_head, stride_block, stride_slot, stride_head, d, key_ok, d_ok, UPCAST: tl.constexpr
):
    """[BLOCK_N, BLOCK_D] rows of one KV head at the given slots; masked keys are not read (0)."""
    rows = block * stride_block + offset * stride_slot + kv_head * stride_head
    tile = tl.load(cache + rows[:, None] + d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def online_softmax(scores, v, m, l, acc, IEEE: tl.constexpr):
    """Fold one key tile (base-2 scores, -inf where hidden) into the running max m, sum l and output acc.
    A row that has seen no visible key yet keeps m = -inf, l = 0, acc = 0 (the shift avoids -inf - -inf)."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - shift[:, None])
    alpha = tl.exp2(m - shift)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l, acc


def softcap_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """(cap_log2, scale_over_cap) of the kernels' SOFTCAP scores (unused without a cap)."""
    if softcap is None:
        return 1.0, 1.0
    if softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    return softcap * LOG2E, scale / softcap


def group_size(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {num_kv_heads} KV heads evenly")
    return num_heads // num_kv_heads


def padded_head_dim(head_dim: int) -> int:
    """head_dim padded to a power of two, at least 16 (the smallest dot a GPU runs)."""
    return max(16, triton.next_power_of_2(head_dim))


def check_layouts(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the KV caches need a contiguous last (head_dim) dimension")
    if k_cache.shape != v_cache.shape or k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"the key cache is {k_cache.dtype} but the value cache {v_cache.dtype}")
