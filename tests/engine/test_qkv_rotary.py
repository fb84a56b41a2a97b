"""RoPE and the KV store in qkv_proj's one-row int4 GEMV (quant/qkv_rotary.py): the rows a program takes, the
GEMV's rotated output and cache slots against the unfused GEMV plus kv_store.rotate_and_store_kv bit for bit
(plain or folded x, a bias, bf16 and FP8 caches, 4- and 8-row programs), what it refuses, which models take it
(fusion.install_qkv_rotary), a one-token attention step with it against one without, and on CUDA a W4A16
engine's greedy tokens with and without it. The kernels run on
TRITONLLM_TEST_DEVICE: compiled on CUDA, in Triton's interpreter on CPU."""

import os

import pytest
import torch

from tritonllm.engine.embedded.attention import step_metadata, triton_backend, triton_kernels
from tritonllm.engine.embedded.attention.fp8_cache import FP8_DTYPE
from tritonllm.engine.embedded.attention.kv_store import RotaryStore, rotate_and_store_kv
from tritonllm.engine.embedded.quant import fusion, kernels, qkv_rotary
from tritonllm.engine.embedded.quant import int4_decode_kernel as int4_decode

from .test_gate_up_runs import one_row_case
from .test_norm_fold import _one_row_forward, _w4a16, tiny, w4a16_greedy_tokens_on_cuda  # noqa: F401
from .test_quant_kernels import random_int4, random_x

DEVICE = torch.device(os.environ.get("TRITONLLM_TEST_DEVICE", "cpu"))
INTERPRETED_OR_CUDA = DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not INTERPRETED_OR_CUDA, reason="Triton kernels: CUDA or TRITON_INTERPRET=1")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
N = (HEADS + 2 * KV_HEADS) * HEAD_DIM
K, GROUP = 1024, 128
SLOT = 5  # of 3 blocks of 4 slots


def test_rotating_programs_take_a_run_from_each_half_of_one_head():
    rows = [qkv_rotary_rows(program, 8) for program in range(N // 8)]
    per_head = HEAD_DIM // 8
    assert rows[0] == [0, 1, 2, 3, 16, 17, 18, 19]
    assert rows[per_head - 1] == [12, 13, 14, 15, 28, 29, 30, 31]
    assert rows[per_head] == [32, 33, 34, 35, 48, 49, 50, 51]  # the next head
    first_value = (HEADS + KV_HEADS) * per_head
    assert rows[first_value] == list(range(192, 200))  # value heads: consecutive rows
    assert sorted(r for program in rows for r in program) == list(range(N))


def qkv_rotary_rows(program: int, block_n: int) -> list[int]:
    """rotary_rows' arithmetic on the host (the jit function's own is checked through the kernel below)."""
    per_head, run = HEAD_DIM // block_n, block_n // 2
    if program >= (HEADS + KV_HEADS) * per_head:
        return list(range(program * block_n, (program + 1) * block_n))
    base = (program // per_head) * HEAD_DIM + (program % per_head) * run
    return [base + r for r in range(run)] + [base + HEAD_DIM // 2 + r for r in range(run)]


def _caches(dtype, seed=3):
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randn(3, 4, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2)]
    return [v.to(dtype).to(DEVICE) for v in values]


def _rotation(seed=5):
    angles = torch.rand(1, HEAD_DIM // 2, generator=torch.Generator().manual_seed(seed)) * 6
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def _store(caches, cos, sin, k_scale=1.0, v_scale=1.0):
    slots = torch.tensor([SLOT], device=DEVICE)
    return RotaryStore(cos, sin, *caches, slots, k_scale, v_scale, HEADS, KV_HEADS)


@needs_kernels
@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, FP8_DTYPE)],
    ids=["fp32", "bf16", "bf16 fp8-cache"],
)
@pytest.mark.parametrize("folded", [False, True], ids=["plain x", "folded x"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("rows", [4, 8])
def test_the_one_row_gemv_rotates_and_stores_as_the_unfused_pair(dtype, cache_dtype, folded, with_bias, rows):
    qweight, scale, zero, bias, x, fold = one_row_case(N, K, GROUP, dtype, rows, folded, with_bias)
    variant = kernels.lane_gemv(rows, 1)
    cos, sin = _rotation()
    scales = (0.5, 2.0) if cache_dtype == FP8_DTYPE else (1.0, 1.0)

    expected = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, GROUP, variant, fold)
    expected_caches = _caches(cache_dtype)
    q, k, v = expected.view(1, -1, HEAD_DIM).split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    slots = torch.tensor([SLOT], device=DEVICE)
    rotate_and_store_kv(q, k, v, cos, sin, *expected_caches, slots, *scales)

    caches = _caches(cache_dtype)
    store = _store(caches, cos, sin, *scales)
    got = int4_decode.int4_decode_matmul(x, qweight, scale, zero, bias, GROUP, variant, fold, rotary=store)
    assert torch.equal(got, expected)
    for have, want in zip(caches, expected_caches):
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))  # (fp8: compared as bytes)
    untouched = [slot for slot in range(12) if slot != SLOT]
    fresh = _caches(cache_dtype)
    for have, before in zip(caches, fresh):
        assert torch.equal(
            have.view(12, -1)[untouched].view(torch.uint8), before.view(12, -1)[untouched].view(torch.uint8)
        )


@needs_kernels
def test_the_rotation_is_refused_where_the_program_cannot_hold_it():
    qweight, scale, zero = random_int4(N, K, GROUP, seed=1)
    x = random_x(1, K)
    store = _store(_caches(torch.float32), *_rotation())
    with pytest.raises(ValueError, match="without split K"):
        int4_decode.int4_decode_matmul(
            x, qweight, scale, zero, None, GROUP, kernels.lane_gemv(8, 1, split_k=2), rotary=store
        )
    with pytest.raises(ValueError, match="do not hold rotary pairs"):
        int4_decode.int4_decode_matmul(x, qweight, scale, zero, None, GROUP, kernels.lane_gemv(64, 1), rotary=store)
    narrow, narrow_scale, narrow_zero = random_int4(N - HEAD_DIM, K, GROUP, seed=1)
    with pytest.raises(ValueError, match=r"is not \[tokens"):
        int4_decode.int4_decode_matmul(
            x, narrow, narrow_scale, narrow_zero, None, GROUP, kernels.lane_gemv(8, 1), rotary=store
        )


def test_the_kernel_shape_decides_where_qkv_may_rotate():
    assert qkv_rotary.rotary_fits(8, 128) and qkv_rotary.rotary_fits(4, 32)
    assert not qkv_rotary.rotary_fits(64, 32) and not qkv_rotary.rotary_fits(4, 6)
    qweight, _, _ = random_int4(N, K, GROUP, seed=1)
    assert kernels.int4_rotates(qweight, GROUP, torch.bfloat16, HEAD_DIM)
    assert not kernels.int4_rotates(qweight[:, :-2], GROUP, torch.bfloat16, HEAD_DIM)  # rows not whole words


def test_a_w4a16_llama_rotates_in_every_qkv(tiny):  # noqa: F811
    model = _w4a16(tiny)
    assert fusion.install_qkv_rotary(model) == len(model.decoder_layers)
    assert all(layer.self_attn.rotary_in_qkv for layer in model.decoder_layers)
    other = _w4a16(tiny)
    other.decoder_layers[0].self_attn.qkv_proj.register_forward_hook(lambda *args: None)  # e.g. a TP all-reduce
    assert fusion.install_qkv_rotary(other) == len(other.decoder_layers) - 1
    assert not other.decoder_layers[0].self_attn.rotary_in_qkv


@needs_kernels
def test_a_one_token_attention_step_rotating_in_qkv_answers_as_without(tiny, monkeypatch):  # noqa: F811
    """LlamaAttention on one token with the Triton backend's metadata: its output and both caches as when the KV
    store's launch rotates (qkv_proj through the one-row kernel in both), with that launch never called."""
    plain, rotating = _w4a16(tiny), _w4a16(tiny)
    assert fusion.install_qkv_rotary(rotating) == len(rotating.decoder_layers)
    attention = plain.decoder_layers[0].self_attn
    attention.qkv_proj.forward = _one_row_forward(attention.qkv_proj)
    heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
    kernels = triton_backend.TritonAttention(heads, kv_heads, 4, DEVICE)
    # one sequence at position 5 (6 keys), its blocks 2 and 0: slot 0 * 4 + 1
    meta = step_metadata([1], [[2, 0]], [0], [1], [6], 4, [None], DEVICE, torch.float32, kernels=kernels)
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(1, attention.qkv_proj.in_features, generator=generator).to(DEVICE)
    angles = torch.rand(1, head_dim // 2, generator=generator).repeat(1, 2) * 6
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    caches = [torch.randn(3, 4, kv_heads, head_dim, generator=generator).to(DEVICE) for _ in range(2)]
    want_caches, before = [c.clone() for c in caches], [c.clone() for c in caches]
    want = attention(hidden, cos, sin, meta, want_caches)
    calls = []
    monkeypatch.setattr(triton_kernels, "rotate_and_store_kv", lambda *args: calls.append(args))
    got = rotating.decoder_layers[0].self_attn(hidden, cos, sin, meta, caches)
    assert calls == []
    assert torch.equal(got, want)
    assert all(torch.equal(have, expected) for have, expected in zip(caches, want_caches))
    assert not torch.equal(caches[0][0, 1], before[0][0, 1])  # slot 1, the step's: its key stored


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine folds norms (and rotates in qkv) on CUDA only")
def test_cuda_the_engine_decodes_alike_with_and_without_the_rotation_in_qkv(tiny, monkeypatch):  # noqa: F811
    """One request at a time (one-row decode steps, in CUDA graphs): the same greedy tokens either way."""
    outputs = []
    for on in (True, False):
        monkeypatch.setattr(fusion, "ROTARY_IN_QKV", on)

        def check(model, on=on):
            assert model.decoder_layers[0].self_attn.rotary_in_qkv == on

        outputs.append(w4a16_greedy_tokens_on_cuda(tiny, check))
    assert outputs[0] == outputs[1]
