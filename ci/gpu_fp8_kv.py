"""The FP8 KV cache on one GPU (attention/fp8_cache.py): the Triton kernels over float8 caches against the portable
path, then decode attention time over an fp8 cache against a bf16 one at long contexts. Prints one JSON line a
check; exits 1 if a check fails. Run by `bash ci/gpu_session.sh fp8-kv`; CI never runs it (no GPU there).

1. store: store_kv of random bf16 K/V (scales 0.37 and 1.0, values past 448 * scale among them) writes exactly
   write_kv's bytes. The interpreter cannot check this off the e4m3 grid (its float8 rounding is wrong).
2. kernels: decode (one split and several) and prefill (chunks over a cached prefix) over fp8 caches written by
   the portable path, bf16 queries, against portable_attention over the same caches.
3. graph: store + decode over fp8 caches captured in a CUDA graph and replayed equal the eager launch.
4. timing: decode_attention over fp8 against bf16 caches (Llama-3-8B's heads: 32 query, 8 KV, head 128), batch 256
   at contexts 256 and 1k (a throughput run's decode) and batch 8 and 32 at 8k and 32k; fp8 tiles widened to fp16
   (the default) and to bf16; CUDA events, the median of repeats. Memory-bound, so fp8 should take about
   half the time of bf16 at long contexts.
`--sweep-decode` instead times decode's tile width, warps and stages (sweep_decode)."""

from __future__ import annotations

import itertools
import json
import sys

import torch
from gpu_timing import graphed, timed_ms

from tritonllm.engine.embedded.attention import decode_kernels, step_metadata, write_kv
from tritonllm.engine.embedded.attention import triton_kernels as tk
from tritonllm.engine.embedded.attention.fp8_cache import FP8_DTYPE
from tritonllm.engine.embedded.attention.portable import portable_attention

DEV = torch.device("cuda")
HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 32
SCALE = DIM**-0.5
K_SCALE, V_SCALE = 0.37, 0.11
TOLERANCE = 2e-2  # bf16 queries and output: relative (norm) error against the portable path


def report(check: str, ok: bool, **values) -> bool:
    print(json.dumps({"check": check, "ok": ok, **values}), flush=True)
    return ok


def relative(out, ref) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def check_store() -> bool:
    ok = True
    for k_scale, v_scale in ((K_SCALE, V_SCALE), (1.0, 1.0)):
        gen = torch.Generator(device=DEV).manual_seed(1)
        tokens, blocks = 300, 16
        k, v = (torch.randn(tokens, KV_HEADS, DIM, generator=gen, device=DEV).mul(60).bfloat16() for _ in range(2))
        slots = torch.randperm(blocks * BLOCK, device=DEV)[:tokens]
        shape = (blocks, BLOCK, KV_HEADS, DIM)
        caches = [torch.zeros(shape, dtype=FP8_DTYPE, device=DEV) for _ in range(2)]
        expected = [torch.zeros(shape, dtype=FP8_DTYPE, device=DEV) for _ in range(2)]
        write_kv(k, v, *expected, slots, k_scale, v_scale)
        tk.store_kv(k, v, *caches, slots, k_scale, v_scale)
        torch.cuda.synchronize()
        differing = sum(int((c.view(torch.uint8) != e.view(torch.uint8)).sum()) for c, e in zip(caches, expected))
        ok &= report("store", differing == 0, scales=[k_scale, v_scale], differing_bytes=differing)
    return ok


class Step:
    """Sequences of `ctx_lens` tokens, the last `q_lens` this step's, K/V already in fp8 caches (portable write)."""

    def __init__(self, q_lens, ctx_lens, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.ctx_lens = q_lens, ctx_lens
        self.starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
        counts = [-(-c // BLOCK) for c in ctx_lens]
        order = torch.randperm(sum(counts) + 1, generator=gen).tolist()
        self.tables = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
        shape = (len(order), BLOCK, KV_HEADS, DIM)
        self.caches = [torch.zeros(shape, dtype=FP8_DTYPE, device=DEV) for _ in range(2)]
        all_slots = [self.slot(s, p) for s, c in enumerate(ctx_lens) for p in range(c)]
        self.slots = [self.slot(s, p) for s, (q, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c - q, c)]
        k, v = (torch.randn(len(all_slots), KV_HEADS, DIM, generator=gen).mul(3).bfloat16().to(DEV) for _ in range(2))
        write_kv(k, v, *self.caches, torch.tensor(all_slots, device=DEV), K_SCALE, V_SCALE)
        self.q = torch.randn(sum(q_lens), HEADS, DIM, generator=gen).bfloat16().to(DEV)
        firsts = [sum(ctx_lens[:i]) for i in range(len(ctx_lens))]  # each sequence's first row in all_slots
        mine = [f + p for f, q, c in zip(firsts, q_lens, ctx_lens) for p in range(c - q, c)]
        self.k, self.v = k[mine], v[mine]

    def slot(self, seq, position):
        return self.tables[seq][position // BLOCK] * BLOCK + position % BLOCK

    def ints(self, values):
        return torch.tensor(values, dtype=torch.int32, device=DEV)

    def table(self):
        width = max(len(t) for t in self.tables)
        return self.ints([t + [0] * (width - len(t)) for t in self.tables])

    def reference(self):
        tails = [None] * len(self.q_lens)
        meta = step_metadata(
            self.slots, self.tables, self.starts, self.q_lens, self.ctx_lens, BLOCK, tails, DEV, torch.bfloat16
        )
        return portable_attention(self.q, self.k, self.v, *self.caches, meta, SCALE, k_scale=K_SCALE, v_scale=V_SCALE)


def check_kernels() -> bool:
    ok = True
    for ctx_lens in ([700, 33, 1500], [9, 4000]):
        step = Step([1] * len(ctx_lens), ctx_lens)
        table = step.table()
        for max_seq_len in (table.shape[1] * BLOCK, 64):  # splits as the width says, and one split
            out = tk.decode_attention(
                step.q, *step.caches, table, step.ints(ctx_lens), SCALE, max_seq_len, k_scale=K_SCALE, v_scale=V_SCALE
            )
            error = relative(out, step.reference())
            splits = tk.decode_splits(len(ctx_lens), KV_HEADS, max_seq_len)
            ok &= report("decode", error < TOLERANCE, ctx_lens=ctx_lens, splits=splits, relative_error=error)
    step = Step([300, 17, 128], [300, 900, 128 + 64])
    tiles = tk.prefill_tiles(step.q_lens, HEADS, KV_HEADS)
    out = tk.prefill_attention(
        step.q,
        *step.caches,
        step.table(),
        step.ints(step.starts),
        step.ints(step.q_lens),
        step.ints(step.ctx_lens),
        SCALE,
        tuple(torch.from_numpy(t).to(DEV) for t in tiles),
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    error = relative(out, step.reference())
    ok &= report("prefill", error < TOLERANCE, q_lens=step.q_lens, ctx_lens=step.ctx_lens, relative_error=error)
    return ok


def check_graph() -> bool:
    step = Step([1, 1, 1, 1], [100, 2000, 31, 700])
    table, lens, slots = step.table(), step.ints(step.ctx_lens), torch.tensor(step.slots, device=DEV)
    width = table.shape[1] * BLOCK

    def forward():
        tk.store_kv(step.k, step.v, *step.caches, slots, K_SCALE, V_SCALE)
        return tk.decode_attention(step.q, *step.caches, table, lens, SCALE, width, k_scale=K_SCALE, v_scale=V_SCALE)

    eager = forward().clone()
    forward()  # warm: compiled before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    graph.replay()
    torch.cuda.synchronize()
    return report("graph", torch.equal(captured, eager), max_abs_diff=float((captured - eager).abs().max()))


def _decode_ms(q, shape, dtype, table, lens, context) -> tuple[float, float]:
    """(median ms of one decode launch, GiB of the two caches) over random caches in `dtype`."""
    caches = [torch.randn(shape, device=DEV, dtype=torch.bfloat16).to(dtype) for _ in range(2)]
    ms = timed_ms(lambda: tk.decode_attention(q, *caches, table, lens, SCALE, context))
    return round(ms, 4), round(sum(c.numel() * c.element_size() for c in caches) / 2**30, 2)


def time_decode() -> None:
    for batch, context in ((256, 256), (256, 1024), (8, 8192), (8, 32768), (32, 8192), (32, 32768)):
        blocks_per_seq = context // BLOCK
        shape = (batch * blocks_per_seq, BLOCK, KV_HEADS, DIM)
        table = torch.arange(batch * blocks_per_seq, device=DEV, dtype=torch.int32).view(batch, blocks_per_seq)
        lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, HEADS, DIM, device=DEV, dtype=torch.bfloat16)
        row = {"check": "decode_time", "batch": batch, "context": context}
        for name, dtype, fp16_tiles in (
            ("bf16", torch.bfloat16, True),
            ("fp8", FP8_DTYPE, True),
            ("fp8_bf16_tiles", FP8_DTYPE, False),
        ):
            decode_kernels.FP8_DECODE_IN_FP16 = fp16_tiles
            row[f"{name}_ms"], row[f"{name}_cache_gib"] = _decode_ms(q, shape, dtype, table, lens, context)
            torch.cuda.empty_cache()
        decode_kernels.FP8_DECODE_IN_FP16 = True
        if batch == 256:  # the key tile's width, for fp8
            default = decode_kernels.DECODE_BLOCK_N
            for block_n in (32, 128):
                decode_kernels.DECODE_BLOCK_N = block_n
                row[f"fp8_block_n{block_n}_ms"] = _decode_ms(q, shape, FP8_DTYPE, table, lens, context)[0]
            decode_kernels.DECODE_BLOCK_N = default
        row["speedup"] = round(row["bf16_ms"] / row["fp8_ms"], 2)
        print(json.dumps(row), flush=True)


def _graphed_decode_ms(q, caches, table, lens, context, launches: int = 20) -> float:
    def step():
        for _ in range(launches):
            tk.decode_attention(q, *caches, table, lens, SCALE, context)

    return timed_ms(graphed(step), repeats=10) / launches


def sweep_decode() -> None:
    """decode_attention's tile width, warps and pipeline stages over bf16 and fp8 caches, each replayed from a CUDA
    graph of 20 launches (as a decode step runs it); one JSON line a (shape, cache), its configurations ranked."""
    defaults = (
        decode_kernels.DECODE_BLOCK_N,
        decode_kernels.DECODE_NUM_WARPS,
        decode_kernels.DECODE_NUM_WARPS_FP8,
        decode_kernels.DECODE_NUM_STAGES,
    )
    for batch, context in ((256, 256), (256, 1024), (64, 4096)):
        blocks_per_seq = context // BLOCK
        shape = (batch * blocks_per_seq, BLOCK, KV_HEADS, DIM)
        table = torch.randperm(batch * blocks_per_seq, device=DEV).to(torch.int32).view(batch, blocks_per_seq)
        lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
        q = torch.randn(batch, HEADS, DIM, device=DEV, dtype=torch.bfloat16)
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8_DTYPE)):
            caches = [torch.randn(shape, device=DEV, dtype=torch.bfloat16).to(dtype) for _ in range(2)]
            gib = sum(c.numel() * c.element_size() for c in caches) / 2**30
            found = []
            for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
                decode_kernels.DECODE_BLOCK_N, decode_kernels.DECODE_NUM_STAGES = block_n, stages
                decode_kernels.DECODE_NUM_WARPS = decode_kernels.DECODE_NUM_WARPS_FP8 = warps
                try:
                    ms = _graphed_decode_ms(q, caches, table, lens, context)
                except Exception as error:  # a shape past the shared memory, say
                    found.append((float("inf"), f"{block_n}/{warps}/{stages}: {type(error).__name__}"))
                    continue
                found.append((ms, f"{block_n}/{warps}/{stages}"))
            (
                decode_kernels.DECODE_BLOCK_N,
                decode_kernels.DECODE_NUM_WARPS,
                decode_kernels.DECODE_NUM_WARPS_FP8,
                decode_kernels.DECODE_NUM_STAGES,
            ) = defaults
            warps = defaults[2] if dtype == FP8_DTYPE else defaults[1]
            default = next(ms for ms, label in found if label == f"{defaults[0]}/{warps}/{defaults[3]}")
            ranked = sorted(found)[:6]
            print(
                json.dumps(
                    {
                        "check": "decode_sweep",
                        "batch": batch,
                        "context": context,
                        "cache": name,
                        "default_ms": round(default, 4),
                        "default_tb_s": round(gib * 2**30 / default / 1e9, 2),
                        "best": [(round(ms, 4), label) for ms, label in ranked],
                    }
                ),
                flush=True,
            )
            del caches
            torch.cuda.empty_cache()


def main() -> int:
    print(json.dumps({"device": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability()}))
    if "--sweep-decode" in sys.argv:
        sweep_decode()
        return 0
    ok = check_store()
    ok &= check_kernels()
    ok &= check_graph()
    time_decode()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
