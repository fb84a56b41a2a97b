"""The fused elementwise kernels (models/fused_ops.py) equal the torch ops of models/layers.py on random inputs:
RMSNorm with and without the residual add, rotary in place on a strided view of a fused qkv output, SiLU-gated
multiply; fp32 to 1e-5, bf16 to 1e-2 (relative, compared in fp32). On CPU the kernels run in Triton's interpreter
(small sizes: it is slow); on CUDA compiled, with larger sizes, CUDA-graph replay and a recompile check on top."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonllm.engine.embedded.network import fused_ops as fo  # noqa: E402
from tritonllm.engine.embedded.network.layers import RMSNorm, apply_rotary  # noqa: E402

if not CUDA:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(fo._rms_norm_kernel, InterpretedFunction):
        pytest.skip(
            f"no CUDA, and the Triton kernels were compiled without TRITON_INTERPRET=1 (triton imported "
            f"first: {'triton' in sys.modules}); set TRITON_INTERPRET=1 before triton is imported",
            allow_module_level=True,
        )

DEVICE = torch.device("cuda" if CUDA else "cpu")
EPS = 1e-6
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.bfloat16]
gpu_only = pytest.mark.skipif(not CUDA, reason="large cases, CUDA graphs and compiled kernels need a GPU")


def randn(gen, *shape, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def rows(gen, num_rows, num_cols, dtype, pad=0, scale=1.0):
    """[num_rows, num_cols] random, `pad` columns short of its parent's rows when pad > 0 (a strided view)."""
    return randn(gen, num_rows, num_cols + pad, dtype=dtype, scale=scale)[:, :num_cols]


def assert_close(out, ref, tolerance=None):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    error = (out.float() - ref.float()).norm() / ref.float().norm()
    assert error < (tolerance or TOLERANCE[ref.dtype]), f"relative error {error:.2e}"


def assert_rounded_once(out, exact):
    """out is `exact` (computed in fp32) rounded once to out's dtype, up to a rare one-ulp flip (the kernels' exp
    and rsqrt are not torch's): far closer than the reference's several roundings in bf16."""
    assert_close(out, exact.to(out.dtype), 1e-3 if out.dtype == torch.bfloat16 else 1e-5)


def assert_norm_close(out, ref):
    """The kernel rounds where RMSNorm does, so in bf16 too it is off by a rare one-ulp flip only."""
    assert_close(out, ref, 1e-3 if ref.dtype == torch.bfloat16 else None)


def reference_norm(x, weight):
    norm = RMSNorm(weight.shape[0], EPS).to(DEVICE, weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        return norm(x)


def rope_tables(gen, num_tokens, head_dim, dtype):
    """cos, sin [T, head_dim] as layers.RotaryEmbedding builds them (halves repeated), at random positions."""
    positions = torch.randint(0, 8192, (num_tokens,), generator=gen).float()
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)


# ----------------------------------------------------------------------------------------------------------------
# rms_norm
# ----------------------------------------------------------------------------------------------------------------

NORM_SHAPES = [(1, 64), (3, 576), (17, 896), (64, 4096)] + ([(7, 8192), (300, 2048)] if CUDA else [])


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_rows,num_cols", NORM_SHAPES)
def test_rms_norm_equals_layers(num_rows, num_cols, dtype, residual):
    gen = torch.Generator().manual_seed(num_rows * num_cols)
    x = rows(gen, num_rows, num_cols, dtype, pad=num_rows % 2 * 40)  # odd row counts: a strided view
    weight = randn(gen, num_cols, dtype=dtype, scale=0.5) + 1
    if not residual:
        out = fo.rms_norm(x, weight, EPS)
        assert_norm_close(out, reference_norm(x, weight))
        assert out.is_contiguous()
        return
    res = rows(gen, num_rows, num_cols, dtype, pad=16)
    x_before, res_before = x.clone(), res.clone()
    out, sums = fo.rms_norm(x, weight, EPS, residual=res)
    ref_sums = x + res
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs must be left as they are"
    assert torch.equal(sums, ref_sums)  # one rounding of the exact sum, as torch's add
    assert_norm_close(out, reference_norm(ref_sums, weight))


def test_rms_norm_fp16_and_eps():
    gen = torch.Generator().manual_seed(1)
    x = rows(gen, 5, 96, torch.float16, scale=1e-3)  # tiny values: eps matters
    weight = randn(gen, 96, dtype=torch.float16) + 1
    norm = RMSNorm(96, 1e-5).to(DEVICE, torch.float16)
    with torch.no_grad():
        norm.weight.copy_(weight)
        assert_close(fo.rms_norm(x, weight, 1e-5), norm(x))


def test_rms_norm_of_no_rows():
    x = torch.empty(0, 64, device=DEVICE)
    out, sums = fo.rms_norm(x, torch.ones(64, device=DEVICE), EPS, residual=torch.empty(0, 64, device=DEVICE))
    assert out.shape == sums.shape == (0, 64)


# ----------------------------------------------------------------------------------------------------------------
# rotary_inplace
# ----------------------------------------------------------------------------------------------------------------

ROTARY_SHAPES = [(1, 16, 4, 64), (3, 16, 4, 128), (17, 16, 4, 64), (64, 16, 4, 128), (5, 4, 2, 80)] + (
    [(300, 32, 8, 128), (9, 64, 8, 96)] if CUDA else []
)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,heads,kv_heads,head_dim", ROTARY_SHAPES)
def test_rotary_in_place_on_a_qkv_slice(num_tokens, heads, kv_heads, head_dim, dtype):
    """q and k rotate together as a [T, heads + kv_heads, D] view of the fused qkv output; v is not touched."""
    gen = torch.Generator().manual_seed(num_tokens * heads + head_dim)
    qkv = randn(gen, num_tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q_and_k = qkv[:, : (heads + kv_heads) * head_dim].view(num_tokens, heads + kv_heads, head_dim)
    cos, sin = rope_tables(gen, num_tokens, head_dim, dtype)
    expected = apply_rotary(q_and_k, cos, sin)
    before = q_and_k.clone()
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    assert fo.rotary_inplace(q_and_k, cos, sin) is q_and_k
    assert q_and_k.data_ptr() == qkv.data_ptr()
    assert_close(qkv[:, : (heads + kv_heads) * head_dim].view_as(expected), expected)
    assert_rounded_once(q_and_k, apply_rotary(before.float(), cos.float(), sin.float()))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


def test_rotary_general_tables_and_strided_heads():
    """Tables whose halves differ and heads spaced apart (stride(1) > D) still follow apply_rotary exactly."""
    gen = torch.Generator().manual_seed(2)
    parent = randn(gen, 6, 5, 96, dtype=torch.float32)
    x = parent[:, :, 16:80]  # [6, 5, 64], stride(1) = 96
    cos, sin = randn(gen, 6, 64, dtype=torch.float32), randn(gen, 6, 64, dtype=torch.float32)
    expected = apply_rotary(x, cos, sin)
    outside = parent.clone()
    fo.rotary_inplace(x, cos, sin)
    assert_close(x, expected)
    outside[:, :, 16:80] = x
    assert torch.equal(parent, outside)


# ----------------------------------------------------------------------------------------------------------------
# silu_and_mul
# ----------------------------------------------------------------------------------------------------------------

SILU_SHAPES = [(1, 64), (3, 576), (17, 896), (64, 4096)] + ([(5, 14336), (300, 4864)] if CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_rows,size", SILU_SHAPES)
def test_silu_and_mul_equals_torch(num_rows, size, dtype):
    gen = torch.Generator().manual_seed(num_rows + size)
    gate_up = rows(gen, num_rows, 2 * size, dtype, pad=num_rows % 2 * 32)
    gate_up = gate_up * 3  # reach silu's tails
    gate, up = gate_up.split(size, dim=-1)
    out = fo.silu_and_mul(gate_up)
    assert_close(out, F.silu(gate) * up)
    assert_rounded_once(out, F.silu(gate.float()) * up.float())


# ----------------------------------------------------------------------------------------------------------------
# FP8 rows: the output quantized beside it, as the FP8 projection's own quantizer would
# ----------------------------------------------------------------------------------------------------------------


def assert_carries_its_fp8_rows(out):
    from tritonllm.engine.embedded.quant.fp8_kernel import quantize_rows

    carried = fo.fp8_rows_of(out)
    assert carried is not None and fo.fp8_rows_of(out.view(out.shape)) is None  # a view carries nothing
    values, scales = quantize_rows(out)
    assert carried[0].dtype == torch.float8_e4m3fn and carried[1].shape == (out.shape[0], 1)
    assert torch.equal(carried[1], scales)
    assert torch.equal(carried[0].view(torch.uint8), values.view(torch.uint8))


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_rows,num_cols", [(1, 64), (5, 576), (3, 4096)])
def test_rms_norm_with_fp8_rows_gives_the_same_output_and_its_rows(num_rows, num_cols, dtype, residual):
    gen = torch.Generator().manual_seed(num_rows + num_cols)
    x = rows(gen, num_rows, num_cols, dtype, pad=num_rows % 2 * 40, scale=4.0)
    weight = randn(gen, num_cols, dtype=dtype, scale=0.5) + 1
    res = rows(gen, num_rows, num_cols, dtype) if residual else None
    plain, fused = fo.rms_norm(x, weight, EPS, res), fo.rms_norm(x, weight, EPS, res, fp8_rows=True)
    if residual:
        assert torch.equal(plain[1], fused[1])
        plain, fused = plain[0], fused[0]
    assert torch.equal(plain, fused) and fo.fp8_rows_of(plain) is None
    assert_carries_its_fp8_rows(fused)


@pytest.mark.parametrize("split", [True, False], ids=["two-launches", "one-launch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("num_rows,size", [(1, 64), (3, 1500), (2, 2048), (2, 5000)])  # partial last blocks
def test_silu_and_mul_with_fp8_rows_gives_the_same_output_and_its_rows(num_rows, size, dtype, split, monkeypatch):
    monkeypatch.setattr(fo, "SILU_FP8_SPLIT", split)
    gen = torch.Generator().manual_seed(num_rows * size)
    gate_up = rows(gen, num_rows, 2 * size, dtype, pad=num_rows % 2 * 32, scale=3.0)
    gate_up[0, 7] = 0.0  # a zero among them; a whole zero row below
    if num_rows > 2:
        gate_up[2] = 0.0
    plain, fused = fo.silu_and_mul(gate_up), fo.silu_and_mul(gate_up, fp8_rows=True)
    assert torch.equal(plain, fused)
    assert_carries_its_fp8_rows(fused)


# ----------------------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------------------


def test_bad_arguments_are_refused():
    x = torch.zeros(4, 64, device=DEVICE)
    w = torch.ones(64, device=DEVICE)
    cases = [
        (lambda: fo.rms_norm(x[None], w, EPS), "2-D"),
        (lambda: fo.rms_norm(torch.zeros(64, 4, device=DEVICE).t(), w, EPS), "contiguous last"),
        (lambda: fo.rms_norm(x, torch.ones(32, device=DEVICE), EPS), "weight"),
        (lambda: fo.rms_norm(x, w.half(), EPS), "weight"),
        (lambda: fo.rms_norm(x.long(), w, EPS), "dtype"),
        (lambda: fo.rms_norm(x, w, EPS, residual=torch.zeros(3, 64, device=DEVICE)), "residual"),
        (lambda: fo.rms_norm(x, w, EPS, residual=x.half()), "residual"),
        (lambda: fo.rotary_inplace(x, x, x), "tokens, heads, head_dim"),
        (lambda: fo.rotary_inplace(torch.zeros(4, 2, 7, device=DEVICE), x[:, :7], x[:, :7]), "odd"),
        (lambda: fo.rotary_inplace(torch.zeros(4, 64, 2, device=DEVICE).transpose(1, 2), x, x), "contiguous last"),
        (lambda: fo.rotary_inplace(x.view(4, 1, 64), x[:3], x), "cos"),
        (lambda: fo.rotary_inplace(x.view(4, 1, 64), x, x[:, :32]), "sin"),
        (lambda: fo.rotary_inplace(x.view(4, 1, 64), x, torch.zeros(64, 4, device=DEVICE).t()), "sin"),
        (lambda: fo.silu_and_mul(x.view(-1)), "2-D"),
        (lambda: fo.silu_and_mul(x[:, :63]), "two equal halves"),
        (lambda: fo.silu_and_mul(torch.zeros(64, 4, device=DEVICE).t()), "contiguous last"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


# ----------------------------------------------------------------------------------------------------------------
# GPU only: CUDA graphs and compiled variants
# ----------------------------------------------------------------------------------------------------------------


def _layer_ops(hidden, residual, qkv, cos, sin, gate_up, weight, heads):
    head_dim = cos.shape[1]
    normed, sums = fo.rms_norm(hidden, weight, EPS, residual=residual)
    q_and_k = qkv[:, : heads * head_dim].view(qkv.shape[0], heads, head_dim)
    fo.rotary_inplace(q_and_k, cos, sin)
    return normed, sums, fo.silu_and_mul(gate_up)


@gpu_only
def test_kernels_replay_in_a_cuda_graph():
    """Captured once, replayed over new inputs copied into the same tensors: the results of eager runs."""
    gen = torch.Generator().manual_seed(3)
    tokens, hidden_size, heads, head_dim, inter = 4, 896, 18, 64, 4864
    widths = {
        "hidden": hidden_size,
        "residual": hidden_size,
        "qkv": (heads + 2) * head_dim,
        "cos": head_dim,
        "sin": head_dim,
        "gate_up": 2 * inter,
    }
    static = {name: rows(gen, tokens, width, torch.bfloat16) for name, width in widths.items()}
    weight = randn(gen, hidden_size, dtype=torch.bfloat16) + 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _layer_ops(**{k: v.clone() for k, v in static.items()}, weight=weight, heads=heads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _layer_ops(**static, weight=weight, heads=heads)
    for seed in (4, 5):
        gen = torch.Generator().manual_seed(seed)
        fresh = {k: randn(gen, *v.shape, dtype=v.dtype) for k, v in static.items()}
        for k, v in fresh.items():
            static[k].copy_(v)
        graph.replay()
        eager = _layer_ops(**fresh, weight=weight, heads=heads)
        assert all(torch.equal(a, b) for a, b in zip(outputs, eager, strict=True))
        assert torch.equal(static["qkv"], fresh["qkv"])


def _compiled_variants(kernel):
    caches = getattr(kernel, "device_caches", None)
    if not caches or not all(isinstance(entry[0], dict) for entry in caches.values()):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


@gpu_only
def test_token_counts_compile_nothing_new():
    gen = torch.Generator().manual_seed(6)
    kernels = (fo._rms_norm_kernel, fo._rotary_kernel, fo._silu_and_mul_kernel)
    counts = None
    for tokens in (1, 2, 3, 16, 17, 64, 100, 1):
        hidden, residual = rows(gen, tokens, 576, torch.bfloat16), rows(gen, tokens, 576, torch.bfloat16)
        qkv = rows(gen, tokens, 15 * 64, torch.bfloat16)
        cos, sin = rope_tables(gen, tokens, 64, torch.bfloat16)
        _layer_ops(
            hidden,
            residual,
            qkv,
            cos,
            sin,
            rows(gen, tokens, 2 * 1536, torch.bfloat16),
            torch.ones(576, dtype=torch.bfloat16, device=DEVICE),
            heads=12,
        )
        now = [_compiled_variants(k) for k in kernels]
        counts = counts or now
        assert now == counts, f"token count {tokens} compiled new variants: {counts} -> {now}"
