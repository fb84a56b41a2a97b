"""Turns each sequence's next-token logits into a token and its log-probability.

Order of the logit processors: embedding bias, bad words, min_tokens (end and stop tokens banned), repetition /
presence / frequency penalties; then greedy argmax, or temperature, top-k, top-p and a draw (a seeded sequence from
its own generator, so that it gives the same tokens whatever else is in the batch; the others together on the
device). Log-probs are the log-softmax
of the processed logits (after temperature, before top-k/top-p truncation)."""

from __future__ import annotations

from typing import Optional

import torch

from . import greedy_kernel
from .host_arrays import HostArrays
from .sequence import Sequence

NEG_INF = float("-inf")


@torch.inference_mode()
def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """logits: [N, vocab] float32, one row per sequence. Returns the chosen tokens and their log-probs, brought
    back from the device in one copy."""
    return SampledTokens(seqs, *sample_on_device(logits, seqs)).host()


class SampledTokens:
    """A step's sampled tokens and log-probs: on the device (the next step's inputs can read them there), and on
    their way to the host in one copy that does not block it until `host()` is called."""

    def __init__(
        self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, pair: Optional[torch.Tensor] = None
    ):
        """pair: [2, N] fp32, the tokens then their log-probs, where the sampler left them so (else stacked here)."""
        self.seqs = seqs
        self.tokens = tokens
        # Token ids are exact in float32 (vocabularies stay far below 2^24): one copy for both.
        both = torch.stack((tokens.to(logprobs.dtype), logprobs)) if pair is None else pair
        self.event = None
        if both.device.type == "cuda":
            self._host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            self._host.copy_(both, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self._host = both

    def host(self) -> tuple[list[int], list[float]]:
        if self.event is not None:
            self.event.synchronize()
        return [int(token) for token in self._host[0].tolist()], self._host[1].tolist()


@torch.inference_mode()
def sample_on_device(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Tokens [N] (int64) and their log-probs [N], on the logits' device, batched: greedy rows take the argmax,
    unseeded sampled rows draw together from the device's generator; a seeded row draws from its own generator
    (the same tokens whatever else is in the batch). `logits` may be the LM head's own dtype: a batch of plain
    greedy rows is read as it is (greedy_kernel.py on CUDA), any other is processed in an fp32 copy. Third: the
    greedy kernel's [2, N] pair of both (SampledTokens' `pair`), or None."""
    if all(seq.params.greedy and _processors_idle(seq) for seq in seqs):
        return _greedy_on_device(logits)
    logits = logits.float()
    for row, seq in enumerate(seqs):
        if not _processors_idle(seq):
            _process_row(logits[row], seq)
    sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
    tokens = logits.argmax(dim=-1)
    if sampled:
        logits = _scaled(logits, seqs)
        _draw_rows(logits, tokens, seqs, sampled)
    return tokens, chosen_logprobs(logits, tokens), None


GREEDY_KERNEL = True  # False: torch's argmax and logsumexp on CUDA too


def greedy_choices(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax and its log-softmax (fp32), from logits of any float dtype."""
    tokens, logprobs, _ = _greedy_on_device(logits)
    return tokens, logprobs


def _greedy_on_device(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """greedy_choices, and the kernel's [2, N] pair of both where it ran (on CUDA), else None."""
    if GREEDY_KERNEL and logits.device.type == "cuda" and logits.stride(-1) == 1:
        tokens, pair = greedy_kernel.greedy_pair(logits)
        return tokens, pair[1], pair
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    return tokens, chosen_logprobs(logits, tokens), None


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[row, tokens[row]] for each row, without writing the whole log-softmax (a vocabulary-wide
    tensor a row)."""
    return logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def _scaled(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Each sampled row divided by its temperature (greedy rows unchanged)."""
    temperatures = [
        1.0 if seq.params.greedy or seq.params.temperature is None else seq.params.temperature for seq in seqs
    ]
    if all(t == 1.0 for t in temperatures):
        return logits
    divisors = torch.tensor(temperatures, dtype=logits.dtype)
    if logits.device.type == "cuda":
        divisors = divisors.pin_memory().to(logits.device, non_blocking=True)
    return logits / divisors[:, None]


def _draw_rows(logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """Draw the sampled `rows` into `tokens`: seeded ones one by one from their own generators, the others at
    once (top-k / top-p per row, then an exponential race on the device)."""
    seeded = [row for row in rows if seqs[row].params.seed is not None]
    free = [row for row in rows if seqs[row].params.seed is None]
    for row in seeded:
        tokens[row] = _draw(logits[row], seqs[row])
    if free:
        index = HostArrays.one(free, logits.device) if len(free) < len(seqs) else None
        chosen = logits if index is None else logits.index_select(0, index)
        filtered = (
            torch.stack([_filtered(chosen[i], seqs[row].params) for i, row in enumerate(free)])
            if any(_truncates(seqs[row].params) for row in free)
            else chosen
        )
        drawn = _race(filtered)
        if index is None:
            tokens.copy_(drawn)
        else:
            tokens.index_copy_(0, index, drawn)


def _truncates(params) -> bool:
    return bool(params.top_k) or (params.top_p is not None and params.top_p < 1.0)


def _race(logits: torch.Tensor) -> torch.Tensor:
    """One draw per row from softmax(logits): the argmax of probabilities over exponential noise (the same
    distribution as a multinomial draw, without leaving the device)."""
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    return (probs / noise).argmax(dim=-1)


@torch.inference_mode()
def plain_greedy_choices(seq: Sequence, logits: torch.Tensor) -> Optional[list[tuple[int, float]]]:
    """(token, log-prob) of every row at once, as `sample` would choose them row by row, for a greedy sequence
    whose rows no logit processor changes (none is set, and min_tokens is already reached); None otherwise. One
    device round trip for a whole draft tree instead of two a row."""
    params = seq.params
    if not params.greedy or not _processors_idle(seq):
        return None
    tokens, logprobs = greedy_choices(logits)
    return list(zip(tokens.tolist(), logprobs.tolist()))


def _processors_idle(seq: Sequence) -> bool:
    """Whether `_process_row` leaves this sequence's rows as they are, now and after more tokens."""
    params = seq.params
    return (
        params.embedding_bias is None
        and not params.bad_words
        and not _has_penalty(params)
        and not _min_tokens_pending(seq)
    )


@torch.inference_mode()
def beam_logprobs(logits: torch.Tensor, beams: list[Sequence]) -> torch.Tensor:
    """Log-probs a beam search ranks by: log-softmax first, then the logit processors (HF's order for beams).
    Sampling knobs (temperature, top-k/p, seed) do not apply: beam search is deterministic."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    for row, seq in enumerate(beams):
        _process_row(logprobs[row], seq)
    return logprobs


def _process_row(row: torch.Tensor, seq: Sequence) -> None:
    params = seq.params
    if params.embedding_bias is not None:
        row += torch.as_tensor(params.embedding_bias, dtype=row.dtype, device=row.device)[: row.shape[0]]
    if params.bad_words:
        _ban(row, banned_by_words(seq.all_token_ids(), params.bad_words))
    if _min_tokens_pending(seq):
        _ban(row, end_tokens(seq))
    if _has_penalty(params):
        _apply_penalties(row, seq)


def _min_tokens_pending(seq: Sequence) -> bool:
    """Whether the sequence is still short of its min_tokens (its end tokens are banned until then). A guided
    sequence's grammar alone decides where it may end: banning the end token it is left with would leave no token."""
    min_tokens = seq.params.min_tokens
    return min_tokens is not None and len(seq.output_token_ids) < min_tokens and not seq.params.guided


def _ban(row: torch.Tensor, token_ids) -> None:
    ids = [t for t in token_ids if 0 <= t < row.shape[0]]
    if ids:
        row[ids] = NEG_INF


def banned_by_words(token_ids: list[int], words: list[list[int]]) -> list[int]:
    """Last tokens of the bad words whose other tokens the sequence has just produced."""
    banned = []
    for word in words:
        head = word[:-1]
        if not head or token_ids[-len(head) :] == head:
            banned.append(word[-1])
    return banned


def end_tokens(seq: Sequence) -> list[int]:
    params = seq.params
    ids = [params.end_id] if params.end_id is not None and params.end_id >= 0 else []
    ids += list(params.stop_token_ids or [])
    ids += [word[0] for word in params.stop_words or [] if len(word) == 1]
    return ids


def _has_penalty(params) -> bool:
    return bool((params.repetition_penalty not in (None, 1.0)) or params.presence_penalty or params.frequency_penalty)


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    params = seq.params
    if params.repetition_penalty not in (None, 1.0):
        seen = torch.tensor(sorted(set(seq.all_token_ids())), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and seq.output_token_ids:
        outputs = torch.tensor(seq.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(outputs, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        row -= (params.frequency_penalty or 0.0) * counts
        row -= (params.presence_penalty or 0.0) * (counts > 0).to(row.dtype)


@torch.inference_mode()
def sampling_probs(row: torch.Tensor, seq: Sequence) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled sequence's next-token distribution as `sample` draws from it (processors, temperature, top-k,
    top-p), and the log-probs `sample` reports. Processes `row` in place. For rejection sampling."""
    _process_row(row, seq)
    temperature = seq.params.temperature if seq.params.temperature is not None else 1.0
    row /= temperature
    return torch.softmax(_filtered(row, seq.params), dim=-1).cpu(), torch.log_softmax(row, dim=-1).cpu()


def _draw(row: torch.Tensor, seq: Sequence) -> int:
    probs = torch.softmax(_filtered(row, seq.params), dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=seq.generator)[0])


def _filtered(row: torch.Tensor, params) -> torch.Tensor:
    """A copy of `row` with what top-k / top-p cut set to -inf."""
    filtered = row.clone()
    if params.top_k:
        k = min(params.top_k, filtered.shape[0])
        threshold = torch.topk(filtered, k).values[-1]
        filtered.masked_fill_(filtered < threshold, NEG_INF)
    if params.top_p is not None and params.top_p < 1.0:
        filtered = _top_p(filtered, params.top_p)
    return filtered


def _top_p(row: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(row, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
    drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    sorted_logits.masked_fill_(drop, NEG_INF)
    return torch.full_like(row, NEG_INF).scatter(0, order, sorted_logits)
