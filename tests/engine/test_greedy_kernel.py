"""greedy_kernel.greedy_pick equals torch's argmax and log_softmax on the fp32 copy: the same tokens (ties to the
lowest index, across chunks and inside one), log-probs within 1e-5; bf16 logits read as they are; rows whose max
lies in the last, partly filled chunk. On CPU the kernels run in Triton's interpreter; on CUDA compiled, with a
128k vocabulary. The sampler takes the kernel for plain greedy batches only."""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tritonllm.engine.embedded import greedy_kernel, sampler  # noqa: E402
from tritonllm.engine.embedded.sequence import Sequence  # noqa: E402
from tritonllm.engine.types import SamplingParams  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
VOCAB = 128_256 if CUDA else 3 * greedy_kernel.CHUNK + 17  # a partial last chunk either way


def _reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    full = logits.float()
    tokens = full.argmax(dim=-1)
    return tokens, torch.log_softmax(full, dim=-1).gather(1, tokens[:, None])[:, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_greedy_pick_equals_torch(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    logits = (torch.randn((rows, VOCAB), generator=gen) * 4).to(dtype).to(DEVICE)
    logits[0, VOCAB - 3] = 40.0  # the max in the last, partial chunk
    tokens, logprobs = greedy_kernel.greedy_pick(logits)
    want_tokens, want_logprobs = _reference(logits)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens.tolist() == want_tokens.tolist()
    assert tokens[0].item() == VOCAB - 3
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


def test_ties_go_to_the_lowest_index():
    logits = torch.zeros((3, VOCAB), device=DEVICE)
    logits[0, [7, 9]] = 5.0  # inside one chunk
    logits[1, [greedy_kernel.CHUNK + 1, 3]] = 5.0  # across chunks, the later chunk written first
    logits[2] = 1.0  # every entry the max: uniform, log-prob -log(vocab)
    tokens, logprobs = greedy_kernel.greedy_pick(logits)
    assert tokens.tolist() == [7, 3, 0]
    assert logprobs[2].item() == pytest.approx(-torch.log(torch.tensor(float(VOCAB))).item(), rel=1e-5)


def test_masked_logits_as_guided_decoding_leaves_them():
    """-inf everywhere but a few tokens (a grammar's mask, applied in place before sampling): whole chunks are -inf."""
    logits = torch.full((2, VOCAB), float("-inf"), device=DEVICE)
    logits[0, [5, VOCAB - 2]] = torch.tensor([1.0, 2.0], device=DEVICE)
    logits[1, greedy_kernel.CHUNK + 3] = 0.5
    tokens, logprobs = greedy_kernel.greedy_pick(logits)
    want_tokens, want_logprobs = _reference(logits)
    assert tokens.tolist() == want_tokens.tolist() == [VOCAB - 2, greedy_kernel.CHUNK + 3]
    assert torch.isfinite(logprobs).all()
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


def test_strided_rows_and_empty_batch():
    wide = torch.randn((4, VOCAB + 64), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    rows = wide[:, 32 : 32 + VOCAB]  # rows further apart than their length
    tokens, logprobs = greedy_kernel.greedy_pick(rows)
    want_tokens, want_logprobs = _reference(rows)
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    empty = greedy_kernel.greedy_pick(torch.empty((0, VOCAB), device=DEVICE))
    assert empty[0].shape == (0,) and empty[1].shape == (0,)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        greedy_kernel.greedy_pick(rows.t())


def _seq(i: int, **params) -> Sequence:
    return Sequence(i, i, 0, [1], SamplingParams(max_tokens=4, **params))


def test_the_pair_holds_the_tokens_as_floats_then_their_logprobs():
    """What SampledTokens copies to the host as it is: no launch to stack tokens and log-probs."""
    logits = (torch.randn((3, VOCAB), generator=torch.Generator().manual_seed(6)) * 4).to(DEVICE)
    tokens, pair = greedy_kernel.greedy_pair(logits)
    want_tokens, want_logprobs = _reference(logits)
    assert pair.shape == (2, 3) and pair.dtype == torch.float32
    assert pair[0].tolist() == [float(t) for t in want_tokens.tolist()] and tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(pair[1], want_logprobs, rtol=1e-5, atol=1e-5)
    host = sampler.SampledTokens([_seq(0), _seq(1), _seq(2)], tokens, pair[1], pair).host()
    assert host[0] == want_tokens.tolist() and host[1] == pair[1].tolist()


def test_sampler_takes_the_kernel_for_plain_greedy_batches_on_cuda(monkeypatch):
    calls = []
    real = greedy_kernel.greedy_pair
    monkeypatch.setattr(greedy_kernel, "greedy_pair", lambda logits: calls.append(logits.dtype) or real(logits))
    logits = torch.randn((2, VOCAB), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(DEVICE)
    tokens, logprobs, pair = sampler.sample_on_device(logits, [_seq(0), _seq(1)])
    want_tokens, want_logprobs = _reference(logits)
    assert calls == ([torch.bfloat16] if CUDA else [])  # off CUDA, torch's ops
    assert (pair is not None) == CUDA
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


def test_processed_or_sampled_rows_take_the_fp32_path(monkeypatch):
    monkeypatch.setattr(greedy_kernel, "greedy_pair", lambda logits: pytest.fail("kernel taken"))
    logits = torch.randn((2, 50), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEVICE)
    banned = int(logits[0].float().argmax())
    seqs = [_seq(0, bad_words=[[banned]]), _seq(1)]
    tokens, _, pair = sampler.sample_on_device(logits, seqs)
    assert pair is None
    assert tokens[0].item() != banned
    assert logits.dtype == torch.bfloat16  # the caller's tensor left alone: the processors changed a copy
