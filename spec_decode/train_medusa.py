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
   With `share_lm_head=False` each head gets its own copy of the LM head and trains it too (at a tenth of the
   learning rate), in the standard Medusa format (one vocab x hidden matrix per head).
4. The end of the text (`held_out`, 10%) is kept out of training; top-1 accuracy per head is measured on it.
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
from tqdm import tqdm

from .medusa import MedusaHeads, save_medusa

log = logging.getLogger("tritonllm.spec_decode")

DEFAULT_TEXT = "data/medusa_training.txt"


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


PROJECTION_LR_SCALE = 0.1  # own vocabulary projections (share_lm_head=False) train at this fraction of the lr
MIN_HELD_OUT_TOKENS = 16
DISTILL_BATCH = 16  # self-distillation snippets per generate call


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


def default_text() -> str:
    return resources.files("tritonllm.spec_decode").joinpath(DEFAULT_TEXT).read_text(encoding="utf-8")


def train_medusa(model_dir: Union[str, Path], out_dir: Union[str, Path], settings: TrainSettings,
                 text: Optional[str] = None) -> TrainReport:
    started = time.monotonic()
    torch.manual_seed(settings.seed)
    tokenizer, base = _load_base(model_dir)
    token_ids, held_ids = _split(tokenizer(text if text is not None else default_text())["input_ids"],
                                 settings.held_out)
    if settings.distill_tokens:
        token_ids += _distill(base, token_ids, settings)
    states, targets = _dataset(*_base_outputs(base, _windows(token_ids, settings.window), settings.progress),
                               settings.num_heads)
    if held_ids:
        held_states, held_targets = _dataset(*_base_outputs(base, _windows(held_ids, settings.window), False),
                                             settings.num_heads)
    else:
        log.warning("the training text is too short to hold %d tokens out; accuracy is measured on the training data",
                    MIN_HELD_OUT_TOKENS)
        held_states, held_targets = states, targets
    lm_head = base.get_output_embeddings().weight.detach()
    heads = MedusaHeads(lm_head.shape[1], lm_head.shape[0], settings.num_heads, settings.num_layers,
                        shared_lm_head=settings.share_lm_head)
    if settings.share_lm_head:
        heads.share_lm_head(lm_head)
    else:
        heads.copy_lm_head(lm_head)
    losses = _train(heads, states, targets, settings)
    accuracy, train_accuracy = head_accuracy(heads, held_states, held_targets), head_accuracy(heads, states, targets)
    save_medusa(heads, out_dir, base_model=str(model_dir), dtype=settings.save_dtype)
    return TrainReport(Path(out_dir), len(token_ids), losses[0], losses[-1], accuracy, train_accuracy, len(held_ids),
                       time.monotonic() - started)


def _split(token_ids: list[int], held_out: float) -> tuple[list[int], list[int]]:
    """(training tokens, held-out tokens): the last `held_out` of the text, if that is enough to measure on."""
    count = int(len(token_ids) * held_out)
    if held_out <= 0 or count < MIN_HELD_OUT_TOKENS:
        return list(token_ids), []
    return list(token_ids[:-count]), list(token_ids[-count:])


def _load_base(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    base.requires_grad_(False)
    return tokenizer, base


def _windows(token_ids: list[int], window: int) -> list[torch.Tensor]:
    if len(token_ids) < 8:
        raise ValueError(f"the training text has only {len(token_ids)} tokens")
    return [torch.tensor(token_ids[start:start + window]) for start in range(0, len(token_ids), window)
            if len(token_ids[start:start + window]) >= 8]


@torch.no_grad()
def _base_outputs(base, windows: list[torch.Tensor], progress: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per window: final-norm hidden states [n, hidden] and the base model's greedy choices [n]."""
    hidden, choices = [], []
    for ids in tqdm(windows, desc="Base model forward", unit="window", disable=not progress):
        states = base.model(ids[None]).last_hidden_state[0]
        hidden.append(states)
        choices.append(base.get_output_embeddings()(states).argmax(dim=-1))
    return hidden, choices


@torch.no_grad()
def _distill(base, token_ids: list[int], settings: TrainSettings) -> list[int]:
    """Greedy continuations (64 tokens each) of 32-token snippets spread over the text, 16 snippets per batch (all
    the same length, so no padding)."""
    prompts_needed = math.ceil(settings.distill_tokens / 64)
    stride = max(1, (len(token_ids) - 32) // prompts_needed)
    extra: list[int] = []
    starts = list(range(0, max(1, len(token_ids) - 32), stride))[:prompts_needed]
    snippets = [token_ids[start:start + 32] for start in starts]
    groups = [[s for s in snippets if len(s) == length] for length in sorted({len(s) for s in snippets})]
    batches = [group[i:i + DISTILL_BATCH] for group in groups for i in range(0, len(group), DISTILL_BATCH)]
    with tqdm(total=len(snippets), desc="Self-distillation", unit="prompt", disable=not settings.progress) as bar:
        for batch in batches:
            out = base.generate(torch.tensor(batch), max_new_tokens=64, do_sample=False, pad_token_id=0)
            for row in out.tolist():  # a row that ended early is padded with 0s after its end token: cut them
                extra += row[:len(batch[0]) + _generated_length(row[len(batch[0]):], base)]
            bar.update(len(batch))
    return extra


def _generated_length(generated: list[int], base) -> int:
    """Tokens up to and including the first end token (all of them if none)."""
    eos = base.generation_config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return next((i + 1 for i, token in enumerate(generated) if token in ends), len(generated))


IGNORE = -100


def _dataset(hidden, choices, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All positions: states [N, hidden] and per-head targets [N, heads] (the base choice at t + h + 1 of the
    same window, IGNORE where the window ends first)."""
    targets = []
    for window_choices in choices:
        rows = torch.full((len(window_choices), num_heads), IGNORE, dtype=torch.long)
        for h in range(min(num_heads, len(window_choices) - 1)):
            rows[:len(window_choices) - h - 1, h] = window_choices[h + 1:]
        targets.append(rows)
    return torch.cat(hidden), torch.cat(targets)


def _loss(heads: MedusaHeads, states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = heads(states)  # [N, heads, vocab]; one matmul for all heads when they share the LM head
    total = states.new_zeros(())
    for h in range(heads.num_heads):
        valid = targets[:, h] != IGNORE
        if valid.any():
            # Later heads are weighted down: they are harder, and a path stops at its first miss anyway.
            total = total + 0.8 ** h * F.cross_entropy(logits[valid, h], targets[valid, h])
    return total


def _train(heads: MedusaHeads, states: torch.Tensor, targets: torch.Tensor, settings: TrainSettings) -> list[float]:
    projections = [p for projection in heads.projections() for p in projection.parameters()]
    blocks = [p for p in heads.parameters() if all(p is not q for q in projections)]
    groups = [{"params": blocks, "lr": settings.learning_rate}]
    if projections:
        groups.append({"params": projections, "lr": settings.learning_rate * PROJECTION_LR_SCALE})
    optimizer = torch.optim.AdamW(groups, lr=settings.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, settings.steps))
    generator = torch.Generator().manual_seed(settings.seed)
    losses = []
    bar = tqdm(range(settings.steps), desc="Training Medusa heads", unit="step", disable=not settings.progress)
    for _ in bar:
        rows = torch.randint(len(states), (min(settings.batch_positions, len(states)),), generator=generator)
        loss = _loss(heads, states[rows], targets[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses or [float("nan")]


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, states: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Per head, how often its top-1 equals the base model's choice it is meant to guess."""
    guesses = torch.cat([heads(chunk).argmax(dim=-1) for chunk in states.split(256)])  # [N, heads]
    accuracy = []
    for h in range(heads.num_heads):
        valid = targets[:, h] != IGNORE
        accuracy.append(float((guesses[valid, h] == targets[valid, h]).float().mean()) if valid.any() else 0.0)
    return accuracy
