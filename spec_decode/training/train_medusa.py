"""Trains Medusa heads for a Hugging Face model folder on text we ship, the base model frozen; CPU-friendly.

1. Tokenize the text and cut it into windows; optionally extend it with the base model's own greedy
   continuations of text snippets (`distill_tokens`), so the heads learn how this model continues, not just how
   the author did.
2. One frozen forward over every window gives the final-norm hidden states and the base model's own next-token
   choices. Head h at position t learns the base model's choice at t+h+1 (the token h+2 ahead): the heads must
   guess what greedy decoding will pick.
3. Each head starts as the identity ResBlock in front of the base LM head, so a fresh head is already a sensible
   guesser. By default the heads share that head (frozen, see medusa.py's `medusa_shared_lm_head`): only the
   ResBlocks train, all heads' logits come from one matmul, and the checkpoint holds the ResBlocks alone (a few MB).
   With a draft vocabulary (`draft_vocab`, the most frequent targets) shared heads train over its columns alone.
   With `share_lm_head=False` each head gets its own copy of the LM head and trains it too (at a tenth of the
   learning rate), in the standard Medusa format (one vocab x hidden matrix per head).
4. The end of the text (`held_out`, 10%) is kept out of training; top-1 accuracy per head is measured on it.

With `distill_prompts` the data is the model's own greedy answers to chat requests instead (distill.py: rewrite,
summarise, explain ... the shipped texts and topics), trained on from the last prompt token on, and accuracy is
measured on the answers to the requests `tritonllm bench spec` makes, whose texts are never trained on. That is
the data the shipped SmolLM2 heads come from (trained on a GPU with `--device cuda`; docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F

from ..checkpoint_files import frequent_tokens
from ..medusa import MedusaHeads, save_medusa
from . import distill
from .frozen_base import base_outputs, load_base
from .training_loop import BestCheckpoint, chain_score, deadline, run_steps

log = logging.getLogger("tritonllm.spec_decode")

DEFAULT_TEXT = "data/medusa_training.txt"  # under spec_decode/training


@dataclass
class TrainSettings:
    num_heads: int = 3
    num_layers: int = 1
    steps: int = 200
    batch_positions: int = 256
    window: int = 256
    learning_rate: float = 1e-3
    distill_tokens: int = 0
    seed: int = 0
    save_dtype: torch.dtype = torch.float32
    progress: bool = True
    share_lm_head: bool = True
    held_out: float = 0.1  # fraction of the text (its end) kept out of training to measure accuracy on
    distill_prompts: int = 0  # > 0: train on the model's answers to about this many chat requests (distill.py)
    distill_max_tokens: int = 256  # longest answer
    distill_batch: int = 16  # requests per generate call
    forward_batch: int = 8  # sequences per frozen forward
    distill_rounds: int = 1  # answers per request: one greedy, the others sampled at distill_temperature
    distill_temperature: float = 0.7
    distill_own_requests: int = 0  # > 0: also this many requests the model writes itself (distill.py)
    validation_share: float = 0.05  # chat data: topics kept apart to pick the best checkpoint on
    eval_every: int = 100  # steps between validation checks (chat data)
    device: str = "cpu"
    draft_vocab: int = 0  # > 0: save the most frequent greedy choices as the heads' draft vocabulary
    time_limit: float = 0.0  # > 0: stop the steps this many seconds after the start (training_loop.run_steps)


PROJECTION_LR_SCALE = 0.1  # own vocabulary projections (share_lm_head=False) train at this fraction of the lr
MIN_HELD_OUT_TOKENS = 16
DISTILL_BATCH = 16  # text-continuation snippets per generate call


@dataclass
class TrainReport:
    out_dir: Path
    num_tokens: int
    first_loss: float
    last_loss: float
    head_accuracy: list[float]  # top-1 agreement with the base model's choice, per head, on held-out text
    train_accuracy: list[float]  # the same on the training positions
    held_out_tokens: int  # 0: the text was too short to hold some out; head_accuracy is on the training data
    seconds: float
    best_step: Optional[int] = None  # chat data: the step whose heads were kept (best on validation)
    validation_accuracy: Optional[list[float]] = None


def default_text() -> str:
    return resources.files("tritonllm.spec_decode.training").joinpath(DEFAULT_TEXT).read_text(encoding="utf-8")


def train_medusa(
    model_dir: Union[str, Path], out_dir: Union[str, Path], settings: TrainSettings, text: Optional[str] = None
) -> TrainReport:
    started = time.monotonic()
    torch.manual_seed(settings.seed)
    tokenizer, base = load_base(model_dir, settings.device)
    make_data = _chat_data if settings.distill_prompts else _text_data
    (states, targets), (held_states, held_targets), validation, num_tokens, held_tokens = make_data(
        base, tokenizer, settings, text
    )
    lm_head = base.get_output_embeddings().weight.detach()
    heads = MedusaHeads(
        lm_head.shape[1],
        lm_head.shape[0],
        settings.num_heads,
        settings.num_layers,
        shared_lm_head=settings.share_lm_head,
    ).to(lm_head.device)
    vocab = None
    if settings.draft_vocab:
        valid = targets[targets != IGNORE]
        vocab = frequent_tokens(torch.bincount(valid.cpu(), minlength=lm_head.shape[0]), settings.draft_vocab)
    _attach_lm_head(heads, lm_head, vocab)
    losses, best_step = _train(heads, states, targets, settings, validation, deadline(started, settings.time_limit))
    accuracy, train_accuracy = head_accuracy(heads, held_states, held_targets), head_accuracy(heads, states, targets)
    validation_accuracy = head_accuracy(heads, *validation) if validation else None
    save_medusa(heads.cpu(), out_dir, base_model=str(model_dir), dtype=settings.save_dtype, draft_vocab=vocab)
    return TrainReport(
        Path(out_dir),
        num_tokens,
        losses[0],
        losses[-1],
        accuracy,
        train_accuracy,
        held_tokens,
        time.monotonic() - started,
        best_step,
        validation_accuracy,
    )


def _attach_lm_head(heads: MedusaHeads, lm_head: torch.Tensor, vocab: Optional[torch.Tensor]) -> None:
    """Shared heads get the base LM head, or with a draft vocabulary its columns alone: they will only ever guess
    those tokens, so they train with the softmax they are used with, and the logits cost a fraction. Heads with
    their own projections start from copies of it (their draft vocabulary is only saved)."""
    if not heads.shared_lm_head:
        heads.copy_lm_head(lm_head)
    elif vocab is None:
        heads.share_lm_head(lm_head)
    else:
        vocab = vocab.to(lm_head.device)
        columns = lm_head[vocab]
        heads.share_lm_head(lambda hidden: F.linear(hidden, columns), lm_head.shape[0])
        heads.restrict_vocab(vocab)


def _text_data(base, tokenizer, settings: TrainSettings, text: Optional[str]):
    """Windows of the text (plus greedy continuations); accuracy on the text's held-out end; no validation."""
    token_ids, held_ids = _split(
        tokenizer(text if text is not None else default_text())["input_ids"], settings.held_out
    )
    if settings.distill_tokens:
        token_ids += _distill(base, tokenizer, token_ids, settings)
    train = _dataset(*base_outputs(base, _windows(token_ids, settings.window), settings.progress), settings.num_heads)
    if not held_ids:
        log.warning(
            "the training text is too short to hold %d tokens out; accuracy is measured on the training data",
            MIN_HELD_OUT_TOKENS,
        )
        return train, train, None, len(token_ids), 0
    held = _dataset(*base_outputs(base, _windows(held_ids, settings.window), False), settings.num_heads)
    return train, held, None, len(token_ids), len(held_ids)


def _chat_data(base, tokenizer, settings: TrainSettings, text: Optional[str]):
    """The model's answers to chat requests (some topics kept for validation); accuracy on its answers to the
    bench's requests."""
    train, validation, held = distill.distilled_sets(
        base, tokenizer, text if text is not None else default_text(), settings
    )
    return (
        _answers_dataset(base, train, settings, settings.progress),
        _answers_dataset(base, held, settings, False),
        _answers_dataset(base, validation, settings, False) if validation else None,
        sum(len(ids) for ids, _ in train),
        sum(len(ids) - start for ids, start in held),
    )


def _answers_dataset(base, sequences: list[distill.Distilled], settings: TrainSettings, progress: bool):
    """Positions from each prompt's last token on (where decoding happens), with their per-head targets."""
    hidden, choices = base_outputs(base, [torch.tensor(ids) for ids, _ in sequences], progress, settings.forward_batch)
    starts = [start - 1 for _, start in sequences]
    return _dataset(
        [h[s:] for h, s in zip(hidden, starts)], [c[s:] for c, s in zip(choices, starts)], settings.num_heads
    )


def _split(token_ids: list[int], held_out: float) -> tuple[list[int], list[int]]:
    """(training tokens, held-out tokens): the last `held_out` of the text, if that is enough to measure on."""
    count = int(len(token_ids) * held_out)
    if held_out <= 0 or count < MIN_HELD_OUT_TOKENS:
        return list(token_ids), []
    return list(token_ids[:-count]), list(token_ids[-count:])


def _windows(token_ids: list[int], window: int) -> list[torch.Tensor]:
    if len(token_ids) < 8:
        raise ValueError(f"the training text has only {len(token_ids)} tokens")
    return [
        torch.tensor(token_ids[start : start + window])
        for start in range(0, len(token_ids), window)
        if len(token_ids[start : start + window]) >= 8
    ]


def _distill(base, tokenizer, token_ids: list[int], settings: TrainSettings) -> list[int]:
    """Greedy continuations (64 tokens each, up to an end token) of 32-token snippets spread over the text,
    DISTILL_BATCH snippets per generate call; each snippet and its continuation, one after the other."""
    prompts_needed = math.ceil(settings.distill_tokens / 64)
    stride = max(1, (len(token_ids) - 32) // prompts_needed)
    starts = list(range(0, max(1, len(token_ids) - 32), stride))[:prompts_needed]
    snippets = [token_ids[start : start + 32] for start in starts]
    answers = distill.greedy_answers(
        base, tokenizer, snippets, 64, DISTILL_BATCH, settings.progress, "Self-distillation"
    )
    return [token for ids, _ in answers for token in ids]


IGNORE = -100


def _dataset(hidden, choices, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All positions: states [N, hidden] and per-head targets [N, heads] (the base choice at t + h + 1 of the
    same window, IGNORE where the window ends first)."""
    targets = []
    for window_choices in choices:
        rows = torch.full((len(window_choices), num_heads), IGNORE, dtype=torch.long, device=window_choices.device)
        for h in range(min(num_heads, len(window_choices) - 1)):
            rows[: len(window_choices) - h - 1, h] = window_choices[h + 1 :]
        targets.append(rows)
    return torch.cat(hidden), torch.cat(targets)


def logit_columns(targets: torch.Tensor, vocab: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """Targets (token ids) as the heads' logit columns: the same ids without a draft vocabulary, else each id's
    place in `vocab`, IGNORE for ids outside it (no column can guess them)."""
    if vocab is None:
        return targets
    column = torch.full((vocab_size + 1,), IGNORE, dtype=torch.long, device=targets.device)
    column[vocab.to(targets.device)] = torch.arange(len(vocab), device=targets.device)
    return column[targets.where(targets != IGNORE, vocab_size)]


def _loss(heads: MedusaHeads, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """targets: logit columns (`logit_columns`)."""
    logits = heads(states)  # [N, heads, vocab]; one matmul for all heads when they share the LM head
    total = states.new_zeros(())
    for h in range(heads.num_heads):
        valid = targets[:, h] != IGNORE
        if valid.any():
            # Later heads are weighted down: they are harder, and a path stops at its first miss anyway.
            total = total + 0.8**h * F.cross_entropy(logits[valid, h], targets[valid, h])
    return total


def _train(
    heads: MedusaHeads,
    states: torch.Tensor,
    targets: torch.Tensor,
    settings: TrainSettings,
    validation=None,
    stop_at: Optional[float] = None,
) -> tuple[list[float], Optional[int]]:
    """Returns the losses and, with validation data, the step whose heads were kept (the best on it)."""
    projections = [p for projection in heads.projections() for p in projection.parameters()]
    blocks = [p for p in heads.parameters() if all(p is not q for q in projections)]
    groups = [{"params": blocks, "lr": settings.learning_rate}]
    if projections:
        groups.append({"params": projections, "lr": settings.learning_rate * PROJECTION_LR_SCALE})
    optimizer = torch.optim.AdamW(groups, lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, settings.steps))
    generator = torch.Generator().manual_seed(settings.seed)
    columns = logit_columns(targets, heads.draft_vocab, heads.vocab_size)

    def batch_loss() -> torch.Tensor:
        rows = torch.randint(len(states), (min(settings.batch_positions, len(states)),), generator=generator)
        rows = rows.to(states.device)
        return _loss(heads, states[rows], columns[rows])

    best = BestCheckpoint(heads, None if validation is None else lambda: chain_score(head_accuracy(heads, *validation)))
    return run_steps(
        batch_loss,
        optimizer,
        schedule,
        settings.steps,
        settings.eval_every,
        best,
        "Training Medusa heads",
        settings.progress,
        stop_at=stop_at,
    )


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, states: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Per head, how often its top-1 equals the base model's choice it is meant to guess."""
    guesses = torch.cat([heads(chunk).argmax(dim=-1) for chunk in states.split(1024)])  # [N, heads]
    if heads.draft_vocab is not None:  # columns -> token ids
        guesses = heads.draft_vocab[guesses]
    accuracy = []
    for h in range(heads.num_heads):
        valid = targets[:, h] != IGNORE
        accuracy.append(float((guesses[valid, h] == targets[valid, h]).float().mean()) if valid.any() else 0.0)
    return accuracy
