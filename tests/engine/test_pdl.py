"""Programmatic dependent launch (backend/engine/embedded/pdl.py): where it applies, and on CUDA that a decode
layer's kernels launched with it (pdl.SMALL_KERNELS and the word GEMV) give, replay after replay of a CUDA graph,
exactly what the same kernels give launched without it. The PTX order (waits before any global access) is checked
without a GPU by quant_sm90_compile.py."""

import os

import pytest
import torch

from tritonllm.engine.embedded import pdl
from tritonllm.engine.embedded.attention.triton_kernels import decode_attention, store_kv
from tritonllm.engine.embedded.network.fused_ops import rms_norm, rotary_inplace
from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode
from tritonllm.engine.embedded.quant.formats import pack_int4

DEVICE = torch.device(os.environ.get("TRITONLLM_TEST_DEVICE", "cpu"))
cuda_only = pytest.mark.skipif(DEVICE.type != "cuda", reason="PDL needs TRITONLLM_TEST_DEVICE=cuda")


def test_pdl_never_applies_off_cuda(monkeypatch):
    monkeypatch.setattr(pdl, "SMALL_KERNELS", True)
    assert not pdl.pdl_on(torch.device("cpu")) and not pdl.chained(torch.device("cpu"))
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}


def test_the_switches_turn_it_off(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", False)
    monkeypatch.setattr(pdl, "SMALL_KERNELS", True)
    assert not pdl.chained(torch.device("cuda", 0))  # decided before asking the device anything


HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS, HIDDEN = 8, 2, 64, 16, 8, 256
CONTEXT = 37  # keys already cached; the step's token goes to slot CONTEXT


def random(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


class DecodeLayer:
    """A decode step's chain for one token: norm, QKV (cuBLAS), RoPE, KV store, decode attention, output
    projection (the int4 word GEMV launched with PDL)."""

    def __init__(self):
        self.hidden, self.residual = random(1, HIDDEN, seed=1), random(1, HIDDEN, seed=2)
        self.norm_weight = random(HIDDEN, seed=3) * 0.1 + 1
        width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.qkv_weight = random(width, HIDDEN, seed=4) * HIDDEN**-0.5
        self.cos, self.sin = random(1, HEAD_DIM, seed=5), random(1, HEAD_DIM, seed=6)
        self.k_cache = random(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, seed=7)
        self.v_cache = random(BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, seed=8)
        self.block_tables = torch.arange(BLOCKS, dtype=torch.int32, device=DEVICE)[None]
        self.seq_lens = torch.tensor([CONTEXT + 1], dtype=torch.int32, device=DEVICE)
        self.slots = torch.tensor([CONTEXT], dtype=torch.int64, device=DEVICE)
        generator = torch.Generator().manual_seed(9)
        values = torch.randint(0, 16, (HIDDEN, HEADS * HEAD_DIM), generator=generator, dtype=torch.uint8)
        self.o_weight = pack_int4(values).to(DEVICE)
        self.o_scale = (torch.rand(HIDDEN, HEADS * HEAD_DIM // 128, generator=generator) * 0.01).to(DEVICE)
        self.o_scale = self.o_scale.to(torch.bfloat16)
        self.o_zero = torch.randint(0, 16, self.o_scale.shape, generator=generator, dtype=torch.uint8).to(DEVICE)
        self.gemv = int4_decode.DecodeVariant(
            block_m=1, block_n=16, block_k=256, num_warps=4, num_stages=1, use_dot=False, words=True, pdl=True
        )

    def __call__(self):
        normed, summed = rms_norm(self.hidden, self.norm_weight, 1e-5, residual=self.residual)
        qkv = torch.nn.functional.linear(normed, self.qkv_weight).view(1, HEADS + 2 * KV_HEADS, HEAD_DIM)
        q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        rotary_inplace(q, self.cos, self.sin)
        rotary_inplace(k, self.cos, self.sin)
        store_kv(k, v, self.k_cache, self.v_cache, self.slots)
        attended = decode_attention(
            q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, HEAD_DIM**-0.5, BLOCKS * BLOCK
        )
        flat = attended.reshape(1, HEADS * HEAD_DIM)
        out = int4_decode.int4_decode_matmul(flat, self.o_weight, self.o_scale, self.o_zero, None, 128, self.gemv)
        return summed, attended, out


@cuda_only
def test_a_decode_layer_launched_with_pdl_equals_it_launched_without(monkeypatch):
    layer = DecodeLayer()
    monkeypatch.setattr(pdl, "SMALL_KERNELS", True)
    layer()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = layer()
    for seed in range(10):
        layer.hidden.copy_(random(1, HIDDEN, seed=100 + seed))
        graph.replay()
        got = [t.clone() for t in outputs]
        monkeypatch.setattr(pdl, "ENABLED", False)  # the same chain, no kernel launched with PDL
        expected = layer()
        monkeypatch.setattr(pdl, "ENABLED", True)
        for name, have, want in zip(("sum", "attention", "output projection"), got, expected):
            assert torch.equal(have, want), f"replay {seed}: the {name} differs"
