"""Trains Medusa heads for a Hugging Face model folder on text we ship, the base model frozen; CPU-friendly.

1. Tokenize the text and cut it into windows; optionally extend it with the base model's own greedy
   continuations of text snippets (`distill_tokens`), so the heads learn how this model continues, not just how
   the author did.
2. One frozen forward over every window gives the final-norm hidden states and the base model's own next-token
   choices. Head h at position t learns the base model's choice at t+h+1 (the token h+2 ahead): the heads must
   guess what greedy decoding will pick.
3. Each head starts as the identity ResBlock plus a copy of the base LM head (which stays frozen), so only the
   ResBlocks train: small, fast, and a fresh head is already a sensible guesser.
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


@dataclass
class TrainReport:
    out_dir: Path
    num_tokens: int
    first_loss: float
    last_loss: float
    head_accuracy: list[float]  # top-1 agreement with the base model's choice, per head, on the training data
    seconds: float


def default_text() -> str:
    return resources.files("tritonllm.spec_decode").joinpath(DEFAULT_TEXT).read_text(encoding="utf-8")


def train_medusa(model_dir: Union[str, Path], out_dir: Union[str, Path], settings: TrainSettings,
                 text: Optional[str] = None) -> TrainReport:
    started = time.monotonic()
    torch.manual_seed(settings.seed)
    tokenizer, base = _load_base(model_dir)
    token_ids = tokenizer(text if text is not None else default_text())["input_ids"]
    if settings.distill_tokens:
        token_ids += _distill(base, token_ids, settings)
    windows = _windows(token_ids, settings.window)
    states, targets = _dataset(*_base_outputs(base, windows, settings.progress), settings.num_heads)
    lm_head = base.get_output_embeddings().weight.detach()
    heads = MedusaHeads(lm_head.shape[1], lm_head.shape[0], settings.num_heads, settings.num_layers)
    heads.copy_lm_head(lm_head)
    losses = _train(heads, states, targets, settings)
    accuracy = head_accuracy(heads, states, targets)
    save_medusa(heads, out_dir, base_model=str(model_dir), dtype=settings.save_dtype)
    return TrainReport(Path(out_dir), len(token_ids), losses[0], losses[-1], accuracy, time.monotonic() - started)


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
    """Greedy continuations (64 tokens each) of 32-token snippets spread over the text."""
    prompts_needed = math.ceil(settings.distill_tokens / 64)
    stride = max(1, (len(token_ids) - 32) // prompts_needed)
    extra: list[int] = []
    starts = list(range(0, max(1, len(token_ids) - 32), stride))[:prompts_needed]
    for start in tqdm(starts, desc="Self-distillation", unit="prompt", disable=not settings.progress):
        prompt = torch.tensor([token_ids[start:start + 32]])
        out = base.generate(prompt, max_new_tokens=64, do_sample=False, pad_token_id=0)
        extra += out[0].tolist()
    return extra


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
    total = states.new_zeros(())
    for h, head in enumerate(heads.heads):
        valid = targets[:, h] != IGNORE
        if valid.any():
            # Later heads are weighted down: they are harder, and a path stops at its first miss anyway.
            total = total + 0.8 ** h * F.cross_entropy(head(states[valid]), targets[valid, h])
    return total


def _train(heads: MedusaHeads, states: torch.Tensor, targets: torch.Tensor, settings: TrainSettings) -> list[float]:
    trainable = [p for head in heads.heads for block in head[:-1] for p in block.parameters()]
    for head in heads.heads:
        head[-1].weight.requires_grad_(False)
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=0.0)
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
    accuracy = []
    for h, head in enumerate(heads.heads):
        valid = targets[:, h] != IGNORE
        guesses = torch.cat([head(chunk).argmax(dim=-1) for chunk in states[valid].split(1024)])
        accuracy.append(float((guesses == targets[valid, h]).float().mean()) if valid.any() else 0.0)
    return accuracy
